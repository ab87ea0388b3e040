"""A request as the engine core sees it: tokens, images, progress and status."""

from __future__ import annotations

import enum
import time

from vlmserve.multimodal.inputs import ImageInput, MultiModalFeature, ProcessedPrompt
from vlmserve.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"
    FINISHED_ERROR = "error"  # a step that ran it alone raised: `Request.error` says why

    def __init__(self, value: str) -> None:
        # a plain attribute, not a property: the engine asks every request every step
        self.finished = value in ("stop", "length", "abort", "error")


class Request:
    """One sequence. `num_computed_tokens` counts tokens whose KV is in the cache; each step
    the scheduler tries to bring it up to `num_tokens` (prompt + outputs so far, in flight
    included)."""

    def __init__(
        self,
        request_id: str,
        prompt: ProcessedPrompt,
        sampling_params: SamplingParams,
        eos_token_ids: tuple[int, ...] = (),
        arrival_time: float | None = None,
    ) -> None:
        self.request_id = request_id
        self.prompt = prompt.prompt
        self.prompt_token_ids = prompt.prompt_token_ids
        # where its images sit (what scheduling reads), and the encoder's input of each
        # distinct image by content hash (sent to the worker by the step that encodes it)
        self.mm_features: list[MultiModalFeature] = [img.feature for img in prompt.images]
        self.encoder_inputs: dict[str, ImageInput] = {img.mm_hash: img for img in prompt.images}
        # position just past the last image row (0 without images): from there on a request
        # has no image left to encode or to hold
        self.images_end = max((f.offset + f.length for f in self.mm_features), default=0)
        # the model's position data (see layers/positions.py), opaque here
        self.prompt_positions = prompt.prompt_positions
        self.position_offset = prompt.position_offset
        self.sampling_params = sampling_params
        self.eos_token_ids = eos_token_ids
        self.arrival_time = time.monotonic() if arrival_time is None else arrival_time
        self.output_token_ids: list[int] = []
        # one {token id: logprob} per output token if the request asked (`logprobs`), or None
        self.output_logprobs: list[dict[int, float]] | None = (
            None if sampling_params.logprobs is None else [])
        # with `prompt_logprobs`: per prompt token its {token id: logprob} and its rank (None
        # for the first; filled as the prompt's chunks are read back, sent with the first
        # output: `prompt_logprobs_sent`)
        self.prompt_logprobs: list[dict[int, float] | None] | None = None
        self.prompt_logprob_ranks: list[int | None] | None = None
        if sampling_params.prompt_logprobs is not None:
            self.prompt_logprobs = [None] * len(self.prompt_token_ids)
            self.prompt_logprob_ranks = [None] * len(self.prompt_token_ids)
        self.prompt_logprobs_sent = False
        # tokens being sampled by steps not yet read back: scheduled on as if known (their
        # values reach the worker's next step on the device), replaced as results arrive
        self.num_placeholders = 0
        self.num_computed_tokens = 0
        self.num_preemptions = 0
        self.status = RequestStatus.WAITING
        self.error: str | None = None  # why it finished with FINISHED_ERROR
        self.refused = False  # that error is the client's input (a 400), not a step's fault
        # prefix caching: keys of its full blocks so far, and how many are registered
        self.block_keys: list[bytes] = []
        self.num_registered_blocks = 0

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        """Prompt + outputs, counting the outputs still in flight."""
        return len(self.prompt_token_ids) + len(self.output_token_ids) + self.num_placeholders

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def decodes_next(self) -> bool:
        """Its next step computes one token, past every image: a decode."""
        start = self.num_computed_tokens
        return start >= self.images_end and start + 1 == self.num_tokens

    @property
    def num_image_tokens(self) -> int:
        return sum(f.length for f in self.mm_features)

    def __repr__(self) -> str:
        return (f"Request({self.request_id!r}, status={self.status.value}, "
                f"computed={self.num_computed_tokens}/{self.num_tokens})")
