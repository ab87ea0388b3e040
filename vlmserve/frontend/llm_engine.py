"""The in-process engine (offline `LLM`): preprocessing, the engine core, detokenization."""

from __future__ import annotations

import itertools
from collections.abc import Callable
from typing import Any

from vlmserve.config import EngineConfig
from vlmserve.engine.core import EngineCore
from vlmserve.errors import PromptTooLongError
from vlmserve.frontend.output import OutputProcessor
from vlmserve.inputs.processor import InputProcessor, PromptInput
from vlmserve.models.metadata import sampling_defaults
from vlmserve.multimodal.inputs import ProcessedPrompt
from vlmserve.outputs import RequestOutput
from vlmserve.request import Request, RequestStatus
from vlmserve.sampling_params import SamplingParams


class LLMEngine:
    """`EngineCore` plus what the server's front ends do in their own processes: prompts to
    `Request`s (`process_request`) and tokens to text (`step` returns `RequestOutput`s)."""

    def __init__(self, config: EngineConfig) -> None:
        self.core = EngineCore(config)
        self.config = self.core.config  # resolved for this device (`resolve_config`)
        self.scheduler, self.executor = self.core.scheduler, self.core.executor
        self.model_path, self.hf_config = self.core.model_path, self.core.hf_config
        self.max_model_len = self.core.max_model_len
        self.eos_token_ids = self.core.eos_token_ids
        model_processor = self.core.model_processor
        self.tokenizer = model_processor.tokenizer
        self.input_processor = InputProcessor.for_model(self.model_path, self.hf_config,
                                                        model_processor)
        self.output_processor = OutputProcessor(self.tokenizer)
        self.sampling_defaults = sampling_defaults(self.config, self.model_path)
        self._ids = itertools.count()

    @classmethod
    def from_kwargs(cls, **kwargs: Any) -> LLMEngine:
        return cls(EngineConfig.from_kwargs(**kwargs))

    @property
    def num_steps(self) -> int:
        return self.core.num_steps

    # ---- requests --------------------------------------------------------------------------

    def process_request(self, prompt: PromptInput, params: SamplingParams | None = None,
                        request_id: str | None = None) -> Request:
        """Validate and preprocess (tokenize, decode and process images, hash, positions).
        Reads only configuration, so it may run on other threads, overlapping the steps.
        Bad input raises an `InvalidRequestError` naming the problem. One request, whatever
        ``params.n`` (`process_requests`: all of them)."""
        return self.process_requests(prompt, params, request_id)[0]

    def process_requests(self, prompt: PromptInput, params: SamplingParams | None = None,
                         request_id: str | None = None) -> list[Request]:
        """`process_request` for the ``params.n`` completions of one prompt, preprocessed
        once: ids ``request_id``, then ``request_id``-1, -2, ...; with a seed, the i-th
        samples with seed + i (`SamplingParams.completion`), as the server's ``n``."""
        params = self.checked_params(params)
        return self.requests_of(self.input_processor.process(prompt), params, request_id)

    def checked_params(self, params: SamplingParams | None) -> SamplingParams:
        """``params`` (None: the model's defaults), checked against the model's vocabulary
        and limits: an `InvalidSamplingParamsError` names what is wrong."""
        params = params or SamplingParams(**self.sampling_defaults)
        self.input_processor.check_sampling(params)
        return params

    def requests_of(self, processed: ProcessedPrompt, params: SamplingParams,
                    request_id: str | None = None) -> list[Request]:
        """The requests of a prompt processed here or elsewhere (a preprocessing process of
        the same model), ``params`` checked (`checked_params`); one that can never fit the
        context raises `PromptTooLongError`."""
        request_id = request_id if request_id is not None else str(next(self._ids))
        reqs = [Request(request_id if i == 0 else f"{request_id}-{i}", processed,
                        params.completion(i) if params.n > 1 else params, self.eos_token_ids)
                for i in range(params.n)]
        reason = self.scheduler.limits.check(reqs[0].num_prompt_tokens,
                                             [f.length for f in reqs[0].mm_features],
                                             [img.name for img in processed.images])
        if reason is not None:
            raise PromptTooLongError(reason)
        return reqs

    def add_processed_request(self, req: Request) -> str:
        """Queue a request from `process_request`."""
        self.core.add_request(req)
        self.output_processor.add(req.request_id)
        return req.request_id

    def add_request(self, prompt: PromptInput, params: SamplingParams | None = None,
                    request_id: str | None = None) -> str:
        """Validate and queue a request (with ``params.n`` > 1, its other completions as
        ``request_id``-1, -2, ...: `process_requests`). Bad input raises an
        `InvalidRequestError` naming the problem and leaves the engine untouched."""
        if request_id is not None and request_id in self.scheduler.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        reqs = self.process_requests(prompt, params, request_id)
        for req in reqs:
            self.add_processed_request(req)
        return reqs[0].request_id

    def abort_request(self, request_ids: str | list[str]) -> None:
        for rid in [request_ids] if isinstance(request_ids, str) else request_ids:
            self.core.abort_request(rid)
            self.output_processor.drop(rid)

    def shutdown(self) -> None:
        self.core.shutdown()

    def has_unfinished_requests(self) -> bool:
        return self.core.has_unfinished_requests()

    # ---- the loop --------------------------------------------------------------------------

    def step(self, while_waiting: Callable[[], bool] | None = None) -> list[RequestOutput]:
        """One engine step (`EngineCore.step`). Returns an output for every request that
        finished, and for every other request that got new tokens unless it asked for its
        final output only. `while_waiting` (host work while the device is busy, e.g.
        preprocessing the next prompt) runs on this thread: on another it would contend with
        the step loop for the GIL."""
        return self._outputs(self.core.step(while_waiting))

    def drain(self) -> list[RequestOutput]:
        """Read back every step still in flight (after aborts, nothing else is running)."""
        return self._outputs(self.core.drain())

    def _outputs(self, updated: list[Request]) -> list[RequestOutput]:
        outputs = []
        for req in updated:
            out = self.output_processor.process(req, self._stop)
            if out is not None:
                outputs.append(out)
        return outputs

    def _stop(self, req: Request) -> None:
        self.core.abort_request(req.request_id, RequestStatus.FINISHED_STOPPED)
        req.status = RequestStatus.FINISHED_STOPPED  # also when a length limit ended it too

    def reset_prefix_cache(self) -> None:
        self.core.reset_prefix_cache()

    def get_stats(self) -> dict[str, Any]:
        return self.core.get_stats()
