"""The one contract between the scheduler (what to do) and the worker (doing it)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from vlmserve.multimodal.inputs import ImageInput, MultiModalFeature
from vlmserve.sampling_params import SamplingParams

if TYPE_CHECKING:
    import torch


@dataclass
class NewRequestData:
    """Everything the worker needs about a request it has not seen (or saw before a
    preemption): all its tokens so far, where its images sit, its position data (the model's,
    opaque here: see layers/positions.py)."""

    request_id: str
    token_ids: list[int]
    num_prompt_tokens: int
    mm_features: list[MultiModalFeature]
    prompt_positions: torch.Tensor | None
    position_offset: int
    sampling_params: SamplingParams
    eos_token_ids: tuple[int, ...]  # what min_tokens holds back (with stop_token_ids)
    block_ids: list[int]  # its block table in the first KV group
    num_computed_tokens: int
    # its block tables in the other KV groups (models with several attention kinds)
    extra_block_ids: list[list[int]] = field(default_factory=list)
    # models with linear-attention layers: its running state slot, and the snapshot slot
    # that state starts from (None: zeros); see core/kv_cache_manager.py
    state_slot: int | None = None
    restore_slot: int | None = None


@dataclass
class CachedRequestData:
    """Delta for a request the worker already holds."""

    request_id: str
    new_block_ids: list[int]
    num_computed_tokens: int
    new_extra_block_ids: list[list[int]] = field(default_factory=list)  # other KV groups


@dataclass
class SchedulerOutput:
    new_requests: list[NewRequestData] = field(default_factory=list)
    cached_requests: list[CachedRequestData] = field(default_factory=list)
    # request id -> tokens to compute this step, in batch order
    num_scheduled_tokens: dict[str, int] = field(default_factory=dict)
    # request id -> position its chunk ends at (the scheduler's own bookkeeping)
    chunk_ends: dict[str, int] = field(default_factory=dict)
    # the encoder's input of every image to encode this step, by content hash: the only place
    # pixels travel
    encoder_inputs: dict[str, ImageInput] = field(default_factory=dict)
    # encoder outputs nobody needs any more (content hashes)
    free_encoder_hashes: list[str] = field(default_factory=list)
    # requests finished, aborted or preempted since the last step: the worker drops them
    finished_request_ids: set[str] = field(default_factory=set)
    # the preempted ones among them: the worker keeps their sampling generators for the resume
    preempted_request_ids: set[str] = field(default_factory=set)
    # image rows (hash, first row, end row) the NEXT step is expected to read from entries
    # that exist after this step's encoder runs: the worker copies them to the GPU ahead
    prefetch: list[tuple[str, int, int]] = field(default_factory=list)
    # linear-attention snapshots to take (request id, position, snapshot slot): after the
    # step, the slot holds the request's state after its first `position` tokens
    snapshots: list[tuple[str, int, int]] = field(default_factory=list)

    @property
    def total_num_scheduled_tokens(self) -> int:
        return sum(self.num_scheduled_tokens.values())

    @property
    def is_empty(self) -> bool:
        return not self.num_scheduled_tokens
