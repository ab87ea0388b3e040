"""The synchronous engine: admission, the step loop (schedule -> execute -> update), outputs."""

from __future__ import annotations

import gc
import itertools
import logging
import time
from collections import deque
from collections.abc import Callable
from typing import Any

from transformers import GenerationConfig

from vlmserve.config import EngineConfig
from vlmserve.core.scheduler import Scheduler
from vlmserve.core.scheduler_output import SchedulerOutput
from vlmserve.engine.output import OutputProcessor
from vlmserve.engine.processor import InputProcessor, PromptInput
from vlmserve.errors import PromptTooLongError
from vlmserve.executor.multiproc import MultiprocExecutor
from vlmserve.executor.uniproc import UniprocExecutor
from vlmserve.models.builtin import resolve_model
from vlmserve.models.loader import load_hf_config
from vlmserve.models.registry import resolve_model_class
from vlmserve.outputs import RequestOutput
from vlmserve.request import Request, RequestStatus
from vlmserve.sampling_params import SamplingParams
from vlmserve.worker.model_runner import StepResult

logger = logging.getLogger(__name__)
LOG_INTERVAL_S = 10.0


def _text_config(hf_config):
    return getattr(hf_config, "text_config", None) or hf_config


def _max_image_tokens(model_processor) -> int:
    """Most placeholder tokens one image can become (from the image processor's pixel cap)."""
    unit = model_processor.patch_size * model_processor.merge_size
    return max(int(model_processor.max_pixels) // (unit * unit), 1)


def _eos_ids(path, tokenizer) -> tuple[int, ...]:
    ids: list[int] = []
    try:
        gen = GenerationConfig.from_pretrained(str(path), local_files_only=True)
        eos = gen.eos_token_id
        ids.extend(eos if isinstance(eos, list) else [eos] if eos is not None else [])
    except OSError:
        pass
    if tokenizer.eos_token_id is not None and tokenizer.eos_token_id not in ids:
        ids.append(tokenizer.eos_token_id)
    return tuple(ids)


class LLMEngine:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        mc, sc, cc = config.model_config, config.scheduler_config, config.cache_config
        self.model_path = resolve_model(mc.model)
        self.hf_config = load_hf_config(self.model_path)
        tcfg = _text_config(self.hf_config)
        model_cls = resolve_model_class(self.hf_config)
        model_processor = model_cls.input_processor_cls(self.model_path, self.hf_config)
        self.tokenizer = model_processor.tokenizer
        self.max_model_len = mc.max_model_len or tcfg.max_position_embeddings
        self.input_processor = InputProcessor(model_processor, tcfg.vocab_size)
        executor_cls = (MultiprocExecutor if config.parallel_config.tensor_parallel_size > 1
                        else UniprocExecutor)
        self.executor = executor_cls(config, self.model_path, self.hf_config,
                                     self.max_model_len)
        self.scheduler = Scheduler(
            max_num_seqs=sc.max_num_seqs,
            max_num_batched_tokens=sc.max_num_batched_tokens,
            max_model_len=self.max_model_len,
            num_kv_blocks=self.executor.num_kv_blocks,
            block_size=cc.block_size,
            enable_chunked_prefill=sc.enable_chunked_prefill,
            max_num_encoder_tokens=sc.max_num_encoder_tokens or max(
                sc.max_num_batched_tokens, _max_image_tokens(model_processor)),
            encoder_cache_rows=self.executor.encoder_cache_rows,
            retain_encoder_outputs=cc.enable_mm_cache,
            plan_prefetch=self.executor.mm_offload,
        )
        self.eos_token_ids = _eos_ids(self.model_path, self.tokenizer)
        self.output_processor = OutputProcessor(self.tokenizer)
        self._ids = itertools.count()
        self.async_scheduling = sc.async_scheduling
        # steps launched and not read back yet (at most one with async scheduling)
        self._in_flight: deque[tuple[SchedulerOutput, StepResult]] = deque()
        self.num_steps = 0
        self.num_generated_tokens = 0
        self._last_log = time.monotonic()
        # the model, tokenizer and processor live as long as the engine: keep them out of the
        # collector's full passes, which otherwise cost a share of every busy step
        gc.collect()
        gc.freeze()

    @classmethod
    def from_kwargs(cls, **kwargs: Any) -> LLMEngine:
        return cls(EngineConfig.from_kwargs(**kwargs))

    # ---- requests --------------------------------------------------------------------------

    def process_request(self, prompt: PromptInput, params: SamplingParams | None = None,
                        request_id: str | None = None) -> Request:
        """Validate and preprocess (tokenize, decode and process images, hash, positions).
        Reads only configuration, so it may run on other threads, overlapping the steps.
        Bad input raises an `InvalidRequestError` naming the problem."""
        params = params or SamplingParams()
        params.validate()
        request_id = request_id if request_id is not None else str(next(self._ids))
        processed = self.input_processor.process(prompt)
        req = Request(request_id, processed, params, self.eos_token_ids)
        reason = self.scheduler.check_admissible(req)
        if reason is not None:
            raise PromptTooLongError(reason)
        return req

    def add_processed_request(self, req: Request) -> str:
        """Queue a request from `process_request` (engine thread only)."""
        if req.request_id in self.scheduler.requests:
            raise ValueError(f"request id {req.request_id!r} is already in use")
        self.scheduler.add_request(req)
        self.output_processor.add(req.request_id)
        return req.request_id

    def add_request(self, prompt: PromptInput, params: SamplingParams | None = None,
                    request_id: str | None = None) -> str:
        """Validate and queue a request. Bad input raises an `InvalidRequestError` naming the
        problem and leaves the engine untouched."""
        if request_id is not None and request_id in self.scheduler.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        return self.add_processed_request(self.process_request(prompt, params, request_id))

    def abort_request(self, request_ids: str | list[str]) -> None:
        for rid in [request_ids] if isinstance(request_ids, str) else request_ids:
            self.scheduler.finish_request(rid, RequestStatus.FINISHED_ABORTED)
            self.output_processor.drop(rid)

    def shutdown(self) -> None:
        """Stop tensor-parallel worker processes (no-op for one process)."""
        self.executor.shutdown()

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests() or bool(self._in_flight)

    # ---- the loop --------------------------------------------------------------------------

    def step(self, while_waiting: Callable[[], bool] | None = None) -> list[RequestOutput]:
        """One engine step: schedule and launch it, then read back and report tokens. With
        async scheduling the tokens read back are the previous step's: they were sampled
        while the host scheduled and launched this one, so the device never waits for the
        host. Returns an output for every request that finished, and for every other request
        that got new tokens unless it asked for its final output only.

        `while_waiting()` does one piece of host work (preprocessing a prompt) each time it
        is called while the device is still busy with the step being read back; it returns
        False when it has nothing more to do. Host work done here, on the engine thread, does
        not contend with the step loop for the GIL as work on other threads would."""
        so = self.scheduler.schedule()
        self._in_flight.append((so, self.executor.execute_model(so)))
        self.num_steps += 1
        keep = 1 if self.async_scheduling and not so.is_empty else 0
        outputs = self._read_back(keep, while_waiting)
        if time.monotonic() - self._last_log > LOG_INTERVAL_S:
            self._log_stats()
        return outputs

    def drain(self) -> list[RequestOutput]:
        """Read back every step still in flight (after aborts, nothing else is running)."""
        return self._read_back(0)

    def _read_back(self, keep: int, while_waiting: Callable[[], bool] | None = None
                   ) -> list[RequestOutput]:
        """Process launched steps, oldest first, until `keep` are left in flight."""
        outputs = []
        while len(self._in_flight) > keep:
            done, result = self._in_flight.popleft()
            while while_waiting is not None and not result.ready() and while_waiting():
                pass
            outputs.extend(self._process_step(done, result.get()))
        return outputs

    def _process_step(self, so: SchedulerOutput, sampled: dict[str, int]
                      ) -> list[RequestOutput]:
        updated = self.scheduler.update_from_output(so, sampled)
        self.num_generated_tokens += len(updated)
        outputs = []
        for req in updated:
            if self.output_processor.update(req):
                self.scheduler.finish_request(req.request_id, RequestStatus.FINISHED_STOPPED)
            if req.status.finished:
                self.output_processor.flush(req)
                outputs.append(self.output_processor.make_output(req))
                self.output_processor.drop(req.request_id)
            elif req.sampling_params.output_kind == "cumulative":
                outputs.append(self.output_processor.make_output(req))
        return outputs

    def _log_stats(self) -> None:
        self._last_log = time.monotonic()
        s = self.get_stats()
        logger.info(
            "running %d, waiting %d, KV cache %.1f%%, image embeddings %.1f MiB on device / "
            "%.1f MiB on host, encoder cache hits %d misses %d evictions %d, prefetch waits %d",
            s["num_running"], s["num_waiting"], 100 * s["kv_cache_usage"],
            s["mm_embedding_bytes_device"] / 2**20, s["mm_embedding_bytes_host"] / 2**20,
            s["num_encoder_cache_hits"], s["num_images_encoded"], s["num_encoder_cache_evictions"],
            s["prefetch_waits"])

    def get_stats(self) -> dict[str, Any]:
        s = self.scheduler.stats()
        runner = self.executor.runner
        store = runner.store
        timeline = runner.timeline
        if timeline is not None:
            timeline.collect()
        return {
            **s.__dict__,
            "num_kv_blocks": self.scheduler.kv.num_blocks,
            "mm_embedding_offload": store.offload,
            "mm_embedding_bytes_device": store.bytes_on_device,
            "mm_embedding_bytes_host": store.bytes_on_host,
            "mm_embedding_entries": store.num_entries,
            "mm_embedding_peak_bytes_device": store.stats.peak_device_bytes,
            "prefetch_hit_rows": store.stats.prefetch_hit_rows,
            "prefetch_miss_rows": store.stats.prefetch_miss_rows,
            "prefetch_waits": store.stats.prefetch_waits,
            "mm_host_pool_misses": store.stats.host_pool_misses,
            "encoder_batches": runner.encoder.num_batches,
            # device seconds in steps / between them (CUDA; None elsewhere)
            "device_busy_s": timeline.busy_s if timeline is not None else None,
            "device_idle_s": timeline.idle_s if timeline is not None else None,
            "num_steps": self.num_steps,
            "num_generated_tokens": self.num_generated_tokens,
            "time": time.time(),
        }
