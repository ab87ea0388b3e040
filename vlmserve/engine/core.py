"""The engine core: scheduler + executor + the step loop, on token ids only.

It knows nothing of text: requests arrive preprocessed (`Request`), and each step returns
the requests that got a token (and, for those that asked, its log-probabilities, appended to
`Request.output_logprobs`). `LLMEngine` wraps it in-process with preprocessing and
detokenization (the offline `LLM`); `engine/core_proc.py` runs it in a process of its own
for the server, whose front ends do that work.
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import FIRST_COMPLETED, CancelledError, Future, wait
from dataclasses import dataclass
from typing import Any

import torch

from vlmserve.config import EngineConfig, resolve_config
from vlmserve.core.admission import AdmissionLimits
from vlmserve.core.kv_cache_groups import group_max_tokens
from vlmserve.core.scheduler import Scheduler
from vlmserve.core.scheduler_output import SchedulerOutput
from vlmserve.errors import InvalidRequestError, PromptTooLongError
from vlmserve.executor.multiproc import MultiprocExecutor
from vlmserve.executor.uniproc import UniprocExecutor
from vlmserve.layers.attention import triton_available
from vlmserve.models.metadata import (
    eos_token_ids,
    load_model_processor,
    local_engine_config,
    max_model_len,
    text_config,
)
from vlmserve.models.registry import image_row_width, images_whole, prompt_whole
from vlmserve.request import Request, RequestStatus
from vlmserve.transfer.consumer_ledger import consumer_ledger
from vlmserve.utils import device_memory, resolve_device, resolve_dtype
from vlmserve.worker.model_runner import StepResult

logger = logging.getLogger(__name__)
LOG_INTERVAL_S = 10.0
# this many failed steps in a row, none succeeding between them: the engine itself is broken
# (not a request), and the step's error is raised
MAX_FAILED_STEPS_IN_A_ROW = 16


@dataclass(frozen=True)
class ModelInfo:
    """What a front end needs from a loaded model: where it is and what admission allows."""

    model_path: str
    max_model_len: int
    eos_token_ids: tuple[int, ...]
    limits: AdmissionLimits


class StepTrace:
    """One JSON line per step read back, for finding where latency goes
    (``VLMSERVE_STEP_TRACE=path``; off otherwise): perf_counter seconds when the host had
    launched the step and when its tokens were read back, the host's milliseconds launching
    it (wall, and the core thread's CPU time: less means it waited), on CUDA the device's
    milliseconds from its first to its last event (gaps where the device waited for the
    host's launches included) and of those the vision tower's (from the first event to the
    tower's end) with the host's milliseconds launching the tower (wall and CPU), the caching
    allocator's retries so far, its decodes, prompt tokens, and the images (and their rows)
    its encoder ran."""

    def __init__(self, path: str) -> None:
        self._file = open(path, "a", buffering=1 << 16)  # noqa: SIM115 - open for the core's life
        self._launched: dict[int, tuple[float, float]] = {}

    @staticmethod
    def clocks() -> tuple[float, float]:
        """(wall, this thread's CPU) seconds: a launch whose CPU time falls short of its
        wall time waited (for the device, a lock, or a CPU other processes held)."""
        return time.perf_counter(), time.thread_time()

    def launched(self, so: SchedulerOutput, began: tuple[float, float]) -> None:
        now, cpu = self.clocks()
        self._launched[id(so)] = (now, 1e3 * (now - began[0]), 1e3 * (cpu - began[1]))

    def read_back(self, so: SchedulerOutput, result: StepResult) -> None:
        launch, launch_ms, launch_cpu_ms = self._launched.pop(id(so), (None, None, None))
        device_ms = None if result.start is None else result.start.elapsed_time(result.event)
        vision_ms = (None if result.encoded is None
                     else result.start.elapsed_time(result.encoded))
        n = so.num_scheduled_tokens.values()
        decodes = sum(1 for k in n if k == 1)
        self._file.write(json.dumps({
            "launch": launch, "done": time.perf_counter(), "launch_ms": launch_ms,
            "launch_cpu_ms": launch_cpu_ms, "device_ms": device_ms,
            "vision_launch_ms": result.encode_launch_ms,
            "vision_launch_cpu_ms": result.encode_launch_cpu_ms,
            "vision_ms": vision_ms, "alloc_retries": self._alloc_retries(),
            "decodes": decodes, "prompt_tokens": sum(n) - decodes,
            "images": len(so.encoder_inputs),
            "image_rows": sum(i.length for i in so.encoder_inputs.values())}) + "\n")

    @staticmethod
    def _alloc_retries() -> int | None:
        """The caching allocator's count of allocations that failed and were retried after
        freeing its cache (each one synchronizes the device), so far; None off CUDA."""
        if not torch.cuda.is_available() or not torch.cuda.is_initialized():
            return None
        return torch.cuda.memory_stats().get("num_alloc_retries", 0)

    def close(self) -> None:
        self._file.close()


class EngineCore:
    """Scheduler and executor. `step()` schedules and launches a step and returns the
    requests that got a token (a step late with async scheduling)."""

    def __init__(self, config: EngineConfig, model_processor=None, serving: bool = False
                 ) -> None:
        """`serving`: for a server (its role in `resolve_config`: a server's batch limits and
        image rows beside decodes); `config` is resolved here for this device and model (a
        model or tokenizer given by name becomes its folder: `local_model_config`, which a
        server's parent did already, so this process never reaches the Hub)."""
        config = local_engine_config(config)
        mc = config.model_config
        device = resolve_device(mc.device)
        self.model_path, self.hf_config, processor = load_model_processor(mc)
        context = max_model_len(mc, self.hf_config)  # too long: refused before the weights
        self.model_processor = model_processor or processor
        dtype = resolve_dtype(mc.dtype, device)
        config = resolve_config(
            config, "serving" if serving else "offline", device.type, device_memory(device),
            triton=triton_available(device), dtype=str(dtype).removeprefix("torch."),
            max_image_tokens=self.model_processor.max_image_tokens,
            max_video_item_tokens=getattr(self.model_processor, "max_video_item_tokens", 0),
            max_model_len=context,
            embedding_row_bytes=image_row_width(self.hf_config) * dtype.itemsize,
            prompt_whole=prompt_whole(self.hf_config))
        self.config = config
        mc, sc, cc = config.model_config, config.scheduler_config, config.cache_config
        self.max_model_len = context
        executor_cls = MultiprocExecutor if config.tensor_parallel else UniprocExecutor
        self.executor = executor_cls(config, self.model_path, self.hf_config,
                                     self.max_model_len)
        kv_tokens = min(group_max_tokens(g.kind, g.num_blocks, cc.block_size,
                                         sc.max_num_batched_tokens)
                        for g in self.executor.cache_groups if g.kind.kind != "linear")
        if kv_tokens < self.max_model_len:
            # a request alone must always fit, or it is preempted and re-admitted forever
            logger.warning("the KV cache holds %d tokens, fewer than max_model_len=%d: "
                           "requests are limited to %d tokens", kv_tokens,
                           self.max_model_len, kv_tokens)
            self.max_model_len = kv_tokens
        self.scheduler = Scheduler(
            max_num_seqs=sc.max_num_seqs,
            max_num_batched_tokens=sc.max_num_batched_tokens,
            max_model_len=self.max_model_len,
            num_kv_blocks=self.executor.num_kv_blocks,
            block_size=cc.block_size,
            enable_chunked_prefill=sc.enable_chunked_prefill,
            max_num_encoder_tokens=sc.max_num_encoder_tokens,
            max_num_prefill_tokens_while_decoding=sc.max_num_prefill_tokens_while_decoding,
            max_num_encoder_tokens_while_decoding=sc.max_num_encoder_tokens_while_decoding,
            encoder_cache_rows=config.resolved.encoder_cache_rows,
            retain_encoder_outputs=cc.enable_mm_cache,
            plan_prefetch=cc.mm_embedding_offload,
            enable_prefix_caching=cc.enable_prefix_caching,
            whole_images=images_whole(self.hf_config),
            cache_groups=self.executor.cache_groups,
            num_snapshot_slots=self.executor.num_snapshot_slots,
        )
        if mc.kernel_warmup:
            self.executor.warmup(self.model_processor)
        self.eos_token_ids = eos_token_ids(self.model_path, self.model_processor.tokenizer)
        self.executor.runner.enable_structured_outputs(
            self.model_processor.tokenizer, text_config(self.hf_config).vocab_size,
            self.eos_token_ids, config.structured_outputs_config)
        ex = self.executor
        logger.info(
            "engine ready: %s on %s (%s), max_model_len %d, KV cache %d tokens in %s (%d "
            "blocks of %d), max_num_seqs %d, max_num_batched_tokens %d%s, image rows beside "
            "decodes %s, prefix caching %s",
            mc.model, ex.device, str(ex.dtype).removeprefix("torch."), self.max_model_len,
            kv_tokens, str(ex.kv_dtype).removeprefix("torch."), ex.num_kv_blocks,
            cc.block_size, sc.max_num_seqs,
            sc.max_num_batched_tokens,
            " (sized to the device)" if config.resolved.limits_sized else "",
            sc.max_num_encoder_tokens_while_decoding or "not capped",
            "on" if cc.enable_prefix_caching else "off")
        self.async_scheduling = sc.async_scheduling
        # structured requests whose grammar is compiling: admitted once it is compiled
        self._compiling: dict[str, tuple[Request, Future]] = {}
        # steps launched and not read back yet (at most one with async scheduling)
        self._in_flight: deque[tuple[SchedulerOutput, StepResult]] = deque()
        self.num_steps = 0
        self.num_generated_tokens = 0
        self.num_computed_tokens = 0  # scheduled into steps: prompt chunks and decodes
        self._logged = (time.monotonic(), 0, 0)  # (time, computed, generated) at the last log
        self._failed_in_a_row = 0
        self._last_progress = time.monotonic()  # a step computed tokens, or nothing waited
        self._last_log = time.monotonic()
        trace = os.environ.get("VLMSERVE_STEP_TRACE")
        self._trace = StepTrace(trace) if trace else None

    @property
    def info(self) -> ModelInfo:
        return ModelInfo(str(self.model_path), self.max_model_len, self.eos_token_ids,
                         self.scheduler.limits)

    # ---- requests --------------------------------------------------------------------------

    def add_request(self, req: Request) -> None:
        """Queue a preprocessed request; one that can never fit raises `PromptTooLongError`,
        a request id in use a `ValueError`."""
        if req.request_id in self.scheduler.requests or req.request_id in self._compiling:
            raise ValueError(f"request id {req.request_id!r} is already in use")
        reason = self.scheduler.check_admissible(req)
        if reason is not None:
            raise PromptTooLongError(reason)
        if not self.has_unfinished_requests():  # idle until now: no stall
            self._last_progress = time.monotonic()
        so = req.sampling_params.structured_outputs
        grammars = self.executor.runner.grammars
        if so is not None and grammars is not None:
            # held back until compiled (the runner takes that compile), so no step waits for
            # a grammar; one over the limits raises here
            compiled = grammars.start(so, req.request_id)
            if not compiled.done():
                self._compiling[req.request_id] = (req, compiled)
                return
        self.scheduler.add_request(req)

    def _admit_compiled(self, wait_s: float = 0.0) -> list[Request]:
        """Requests whose grammar is compiled go to the scheduler (waiting up to ``wait_s``
        for one when nothing else can run); one whose grammar failed to compile is returned,
        finished with its error."""
        if wait_s > 0.0:
            wait([f for _, f in self._compiling.values()], wait_s, FIRST_COMPLETED)
        failed = []
        for rid, (req, compiled) in list(self._compiling.items()):
            if not compiled.done():
                continue
            del self._compiling[rid]
            error = CancelledError() if compiled.cancelled() else compiled.exception()
            if error is None:  # the runner takes the compile
                self.scheduler.add_request(req)
                continue
            self.executor.runner.grammars.forget(rid)
            if isinstance(error, InvalidRequestError):  # the client's grammar: refused
                req.error, req.refused = str(error), True
            else:
                req.error = f"its structured output's grammar did not compile: {error!r}"
            req.status = RequestStatus.FINISHED_ERROR
            failed.append(req)
        return failed

    def abort_request(self, request_id: str,
                      status: RequestStatus = RequestStatus.FINISHED_ABORTED) -> bool:
        """Finish a request now, releasing what it holds; False if it was not running."""
        if self.executor.runner.grammars is not None:
            self.executor.runner.grammars.forget(request_id)  # if the runner never took it
        if self._compiling.pop(request_id, None) is not None:
            return False  # nothing of it reached the worker
        if request_id not in self.scheduler.requests:
            return False
        self.scheduler.finish_request(request_id, status)
        return True

    def has_unfinished_requests(self) -> bool:
        return (self.scheduler.has_unfinished_requests() or bool(self._in_flight)
                or bool(self._compiling))

    def reset_prefix_cache(self) -> None:
        """Forget every cached prefix (for benchmarks: the next requests start cold)."""
        self.scheduler.reset_prefix_cache()

    def shutdown(self) -> None:
        """Stop tensor-parallel worker processes (no-op for one process)."""
        if self.executor.runner.grammars is not None:
            self.executor.runner.grammars.shutdown()
        self.executor.shutdown()
        if self._trace is not None:
            self._trace.close()

    # ---- the loop --------------------------------------------------------------------------

    def step(self, while_waiting: Callable[[], bool] | None = None) -> list[Request]:
        """Schedule and launch a step, then read back tokens: with async scheduling the
        previous step's, sampled while the host scheduled and launched this one, so the
        device never waits for the host. Returns the requests that got a token (finished
        ones with their final status).

        `while_waiting()` does one piece of host work each time it is called while the device
        is still busy with the step being read back; it returns False when it has nothing
        more to do.

        A step that raises fails only the request it ran alone; with several, they are
        recomputed as suspects, each alone (`Scheduler.fail_steps`), and a request found to
        fail is returned finished with `FINISHED_ERROR`."""
        failed: list[Request] = []
        if self._compiling:
            idle = not self.scheduler.has_unfinished_requests() and not self._in_flight
            failed = self._admit_compiled(wait_s=0.005 if idle else 0.0)
        so = self.scheduler.schedule()
        if so.num_scheduled_tokens or not self.scheduler.has_unfinished_requests():
            self._last_progress = time.monotonic()
            self.num_computed_tokens += sum(so.num_scheduled_tokens.values())
        updated: list[Request] = failed
        began = StepTrace.clocks() if self._trace is not None else None
        try:
            self._in_flight.append((so, self.executor.execute_model(so)))
            if self._trace is not None:
                self._trace.launched(so, began)
        except Exception as e:  # noqa: BLE001 - contained: see the docstring
            return failed + self._fail_step(so, e)
        self.num_steps += 1
        keep = 1 if self.async_scheduling and not so.is_empty else 0
        try:
            self._read_back(updated, keep, while_waiting)
        except Exception as e:  # noqa: BLE001 - the step being read back failed
            updated += self._fail_step(self._in_flight[0][0], e)
        if time.monotonic() - self._last_log > LOG_INTERVAL_S:
            self._log_stats()
        return updated

    def drain(self) -> list[Request]:
        """Read back every step still in flight (after aborts, nothing else is running)."""
        updated: list[Request] = []
        try:
            self._read_back(updated, 0)
        except Exception as e:  # noqa: BLE001 - as in `step`
            updated += self._fail_step(self._in_flight[0][0], e)
        return updated

    def _read_back(self, updated: list[Request], keep: int,
                   while_waiting: Callable[[], bool] | None = None) -> None:
        while len(self._in_flight) > keep:
            done, result = self._in_flight[0]
            while while_waiting is not None and not result.ready() and while_waiting():
                pass
            tokens = result.get()
            self._in_flight.popleft()
            if self._trace is not None:
                self._trace.read_back(done, result)
            for rid, (first, scored, ranks) in result.prompt_logprobs.items():
                req = self.scheduler.requests.get(rid)
                if req is not None and req.prompt_logprobs is not None:
                    req.prompt_logprobs[first:first + len(scored)] = scored
                    req.prompt_logprob_ranks[first:first + len(ranks)] = ranks
            new = self.scheduler.update_from_output(done, tokens)
            if result.logprobs:  # the requests that asked: their token's logprobs
                for req in new:
                    if req.output_logprobs is not None:
                        req.output_logprobs.append(result.logprobs[req.request_id])
            self.num_generated_tokens += len(new)
            updated += new
            if not done.is_empty:
                self._failed_in_a_row = 0

    def _fail_step(self, failed: SchedulerOutput, error: Exception) -> list[Request]:
        """Step `failed` raised; the results of the other steps in flight are lost with it
        (see `step`)."""
        self._failed_in_a_row += 1
        if getattr(error, "fatal", False):  # the engine itself is broken (a rank is gone)
            raise error
        if self._failed_in_a_row >= MAX_FAILED_STEPS_IN_A_ROW:
            raise RuntimeError(f"{self._failed_in_a_row} steps failed in a row; the engine "
                               "cannot serve") from error
        lost = [done for done, _ in self._in_flight if done is not failed]
        self._in_flight.clear()
        n = len(failed.num_scheduled_tokens)
        logger.error("a step of %d request(s) failed: %r; %s", n, error,
                     "failing it" if n == 1 else "running each of them alone from now on",
                     exc_info=error)
        return self.scheduler.fail_step(failed, lost, f"{type(error).__name__}: {error}")

    # ---- stats -----------------------------------------------------------------------------

    def _log_stats(self) -> None:
        now = self._last_log = time.monotonic()
        then, computed, generated = self._logged
        self._logged = (now, self.num_computed_tokens, self.num_generated_tokens)
        dt = max(now - then, 1e-9)
        generated = self.num_generated_tokens - generated
        # a decode computes one token for each it generates: the rest were prompt tokens
        prompt = self.num_computed_tokens - computed - generated
        s = self.get_stats()
        logger.info(
            "prompt %.0f tokens/s, generation %.0f tokens/s, running %d, waiting %d, KV cache "
            "%.1f%%, prefix cache hit rate %.1f%%, image embeddings %.1f MiB on device / "
            "%.1f MiB on host, encoder cache hits %d misses %d evictions %d, prefetch waits %d",
            max(prompt, 0) / dt, generated / dt, s["num_running"], s["num_waiting"],
            100 * s["kv_cache_usage"], 100 * s["prefix_cache_hit_rate"],
            s["mm_embedding_bytes_device"] / 2**20, s["mm_embedding_bytes_host"] / 2**20,
            s["num_encoder_cache_hits"], s["num_images_encoded"], s["num_encoder_cache_evictions"],
            s["prefetch_waits"])

    @property
    def stalled_s(self) -> float:
        """Seconds the engine has had requests and computed no token for them (0 when it
        makes progress or has nothing to do)."""
        if not self.scheduler.has_unfinished_requests():
            return 0.0
        return time.monotonic() - self._last_progress

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
            "kv_cache_dtype": str(self.executor.kv_dtype).removeprefix("torch."),
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
            "num_failed_steps": self.scheduler.num_failed_steps,
            "stalled_s": self.stalled_s,
            "num_generated_tokens": self.num_generated_tokens,
            # embedding handles from encoder servers opened in this process
            **{f"encoder_handles_{k}": v for k, v in vars(consumer_ledger().stats()).items()},
            "time": time.time(),
        }
