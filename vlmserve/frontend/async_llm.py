"""The server's front end of the engine: preprocessing and detokenization here, the engine
core in a process of its own (engine/core_proc.py), so neither waits for the other's
interpreter lock.

`AsyncLLM(config)` starts an engine-core process and talks to it; `AsyncLLM(config,
core=CoreHandle(...))` joins one that another process started (`--api-server-count N`: N
front ends, one core). With `data_parallel_size=N` it starts (or joins) N cores and routes
each request to one by cache affinity (frontend/dp_client.py). On the caller's event loop
(any number of them) a request is preprocessed (frontend/preprocess.py: tokens, images
decoded, resized and hashed, the model's position data; in a pool of processes, or a worker
thread), checked against the core's limits and handed over; its stream (frontend/streams.py)
is returned. The core's tokens come back through one I/O thread (frontend/core_client.py),
which detokenizes them and ends every stream within a fraction of a second if the core dies.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import itertools
import logging
import multiprocessing as mp
import os
import time
from collections.abc import AsyncIterator, Sequence
from typing import Any

from vlmserve.config import EngineConfig
from vlmserve.core.admission import AdmissionLimits
from vlmserve.core.dp_routing import AffinityRouter, RouteKey
from vlmserve.encoder.client import EncoderClient, consumer_id
from vlmserve.engine.launch import CoreHandle, start_engine_cores
from vlmserve.engine.messages import Encoder, relabeled
from vlmserve.frontend.core_client import CoreClient
from vlmserve.frontend.dp_client import DataParallelClient
from vlmserve.frontend.output import OutputProcessor
from vlmserve.frontend.preprocess import (
    encoder_client,
    preprocess,
    preprocess_in_worker,
    send_to_encoders,
    start_pool,
    tokenize_in_worker,
)
from vlmserve.frontend.process_pool import ProcessPool
from vlmserve.frontend.streams import EngineDeadError, RequestStream, RequestTiming
from vlmserve.inputs.processor import ImageLoader, InputProcessor, PromptInput
from vlmserve.layers.grammar import check_grammar_limits
from vlmserve.models.metadata import (
    load_model_processor,
    local_engine_config,
    sampling_defaults,
)
from vlmserve.models.processing import ChatTemplateOptions
from vlmserve.multimodal.image import load_image
from vlmserve.multimodal.inputs import MultiModalFeature, ProcessedPrompt
from vlmserve.outputs import RequestOutput
from vlmserve.request import Request
from vlmserve.sampling_params import SamplingParams
from vlmserve.utils import pid_alive

logger = logging.getLogger(__name__)
# the most requests a front end has waiting for encoder servers at once
ENCODE_THREADS = 64

class AsyncLLM:
    """Front end of an engine core in another process; `generate` streams to asyncio code.

    `AsyncLLM(config)` (or `AsyncLLM.from_kwargs(model=..., ...)`, the option names of
    `LLM(...)`) starts the core and waits until its model is loaded; `core=` joins a running
    one instead.
    """

    def __init__(self, config: EngineConfig,
                 core: CoreHandle | Sequence[CoreHandle] | None = None,
                 log_level: str = "info", preprocess_workers: int = 0,
                 encoder_urls: Sequence[str] = (), encoder_transport: str = "auto",
                 image_cache_bytes: int = 0, preprocess_threads: int = 1,
                 data_parallel_size: int = 1, dp_routing: str = "affinity") -> None:
        """`preprocess_threads`: torch intra-op threads of each preprocessing process (its
        share of the host's cores: the pool's processes are its parallelism).
        `data_parallel_size`: engine cores (started here, or `core` a handle of each), each
        request routed to one by `dp_routing` (`core/dp_routing.py`)."""
        self._preprocess_threads = preprocess_threads
        # processed images kept by source in each preprocessing process (or this one)
        self.image_cache_bytes = image_cache_bytes
        # images encoded by encoder servers (`vlmserve serve --role encoder`), if any
        self.encoder_urls, self.encoder_transport = tuple(encoder_urls), encoder_transport
        self._encoder_client: EncoderClient | None = None
        self._encoder_clients: list[EncoderClient | None] = []
        self._encode_threads: concurrent.futures.ThreadPoolExecutor | None = None
        self._pool: ProcessPool | None = None
        self._procs: list[mp.process.BaseProcess] = []
        self.model_name: str = config.model_config.model  # as the user named it
        # a model given by name becomes its folder here, once: the core and the
        # preprocessing processes get the folder (a server's parent did this already)
        config = self.config = local_engine_config(config)
        if core is None:
            started = start_engine_cores(config, data_parallel_size, log_level)
            self._procs = [proc for proc, _ in started]
            cores = [handle for _, handle in started]
        else:
            cores = [core] if isinstance(core, CoreHandle) else list(core)
        assert len(cores) == data_parallel_size, (len(cores), data_parallel_size)
        self.core = cores[0]
        try:
            path, hf_config, model_processor = load_model_processor(config.model_config)
            self.sampling_defaults = sampling_defaults(config, path)
            self.input_processor = InputProcessor.for_model(path, hf_config, model_processor,
                                                            image_cache_bytes=image_cache_bytes)
            self._encoder = Encoder()
            self._ids = itertools.count()
            # one I/O thread (and detokenizer) per core
            clients = [CoreClient(h, functools.partial(self._core_alive, i, h),
                                  OutputProcessor(model_processor.tokenizer))
                       for i, h in enumerate(cores)]
            info = clients[0].info
            self.output_processor = clients[0].output_processor
            self.max_model_len: int = info.max_model_len
            self.eos_token_ids = tuple(info.eos_token_ids)
            self.limits = AdmissionLimits(**info.limits)
            self.core_pid = info.pid
            self.block_size = config.cache_config.block_size
            self.client: CoreClient | DataParallelClient = clients[0]
            if len(clients) > 1:
                self.client = DataParallelClient(clients, AffinityRouter(
                    len(clients), self.block_size, dp_routing,
                    max_blocks=self.limits.max_kv_tokens // self.block_size,
                    max_image_rows=self.limits.encoder_cache_rows,
                    seed=config.model_config.seed))
            # every front end of a core is one consumer to the encoder servers
            self.encoder_consumer = consumer_id(self.core.address)
            self._encoder_clients = [encoder_client(self.encoder_urls, encoder_transport,
                                                    consumer_id(h.address), self.limits)
                                     for h in cores]
            self._encoder_client = self._encoder_clients[0]
            # the requests waiting for encoder servers, each on a thread of its own here
            # (blocked in I/O): as many in flight as come, whatever the preprocessing pool
            self._encode_threads = (concurrent.futures.ThreadPoolExecutor(
                ENCODE_THREADS, thread_name_prefix="encode") if self._encoder_client else None)
            self._preprocess_workers = preprocess_workers
            if preprocess_workers > 0:
                self._pool = self._new_pool()
        except BaseException:
            self._kill_core()
            raise

    @property
    def _proc(self) -> mp.process.BaseProcess | None:
        """The engine core this front end started (the first, with several)."""
        return self._procs[0] if self._procs else None

    @property
    def data_parallel_size(self) -> int:
        c = self.client
        return len(c.clients) if isinstance(c, DataParallelClient) else 1

    @classmethod
    def from_kwargs(cls, **kwargs: Any) -> AsyncLLM:
        return cls(EngineConfig.from_kwargs(**kwargs))

    # ---- the API (any thread / event loop) -------------------------------------------------

    @property
    def is_running(self) -> bool:
        """False once the engine core is dead or shut down (checked now, not at the I/O
        thread's next look)."""
        return self.client.is_running

    @property
    def num_streams(self) -> int:
        """Requests this front end is serving (handed to the core, not finished)."""
        return self.client.num_streams

    def apply_chat_template(self, messages: list[dict], tools: list[dict] | None = None,
                            options: ChatTemplateOptions | None = None) -> str:
        return self.input_processor.model_processor.apply_chat_template(messages, tools,
                                                                        options)

    async def add_request(self, prompt: PromptInput, params: SamplingParams | None = None,
                          request_id: str | None = None, arrival_time: float | None = None,
                          image_loader: ImageLoader = load_image,
                          default_max_tokens: int | None = None) -> RequestStream:
        """Preprocess a request (in a preprocessing process, or a worker thread without
        them), hand it to the core and return its stream. Bad input raises the engine's
        `InvalidRequestError` here, before any output. `image_loader` turns each image source
        of the prompt into an image (a server's limits); a max_tokens given must fit after
        the prompt, None becomes `default_max_tokens` where that fits (see `preprocess`)."""
        return (await self.add_requests(prompt, params, request_id, 1, arrival_time,
                                        image_loader, default_max_tokens))[0]

    async def add_requests(self, prompt: PromptInput, params: SamplingParams | None = None,
                           request_id: str | None = None, n: int = 1,
                           arrival_time: float | None = None,
                           image_loader: ImageLoader = load_image,
                           default_max_tokens: int | None = None) -> list[RequestStream]:
        """`add_request` for ``n`` completions of one prompt (the OpenAI API's ``n``), each a
        request of its own (ids ``request_id`` with "-1", "-2", ... for all but the first;
        with a seed, the i-th samples with seed + i, as vLLM's) from one preprocessing: their
        messages share the prompt's pixels."""
        self._check_alive()
        params = params or SamplingParams(**self.sampling_defaults)
        loop = asyncio.get_running_loop()
        rid = request_id if request_id is not None else f"async-{next(self._ids)}"
        arrival = arrival_time if arrival_time is not None else time.monotonic()
        text, token_ids, frames, features = await self._preprocess(
            prompt, params, rid, image_loader, default_max_tokens)
        core = 0
        if isinstance(self.client, DataParallelClient):  # every choice of `n` goes there too
            core = self.client.route(RouteKey.of(token_ids, features, self.block_size)).replica
        todo = [(rid, params, frames)]
        for i in range(1, n):
            child_id = f"{rid}-{i}"
            child = params.completion(i)
            child_frames = relabeled(frames, child_id, child.seed)
            if child_frames is None:  # embedding handles: each child is encoded on its own
                *_, child_frames = await self._preprocess(prompt, child, child_id,
                                                          image_loader, default_max_tokens)
            todo.append((child_id, child, child_frames))
        encoders = self._encoder_clients[core] if self._encoder_clients else None
        if encoders is not None:  # on threads here, not in the pool's processes
            sent = await asyncio.gather(*(asyncio.wrap_future(self._encode_threads.submit(
                send_to_encoders, encoders, f, self.input_processor.hidden_size))
                for _, _, f in todo))
            todo = [(cid, child, f) for (cid, child, _), f in zip(todo, sent, strict=True)]
        self._check_alive()
        streams = []
        for child_id, child, child_frames in todo:
            req = Request(child_id, ProcessedPrompt(text, token_ids), child, self.eos_token_ids)
            stream = RequestStream(self, child_id, loop, RequestTiming(arrival),
                                   delta=child.output_kind == "delta")
            stream.timing.num_prompt_tokens = req.num_prompt_tokens
            if isinstance(self.client, DataParallelClient):
                self.client.add(stream, req, child_frames, core)
            else:
                self.client.add(stream, req, child_frames)
            streams.append(stream)
        return streams

    async def tokenize(self, prompt: PromptInput, image_loader: ImageLoader = load_image
                       ) -> list[int]:
        """``prompt``'s token ids as the engine would run them (images expanded to their
        rows), preprocessed as a request's; its length is not checked."""
        if self._pool is None:
            return await asyncio.to_thread(
                lambda: self.input_processor.process(prompt, image_loader).prompt_token_ids)
        return await self._in_pool(tokenize_in_worker, prompt, image_loader)

    async def _preprocess(self, prompt: PromptInput, params: SamplingParams, rid: str,
                          image_loader: ImageLoader, default_max_tokens: int | None
                          ) -> tuple[str | None, list[int], list, list[MultiModalFeature]]:
        """(prompt text, prompt token ids, `AddRequest` frames, where its images sit) from a
        preprocessing process, or a worker thread without them."""
        limits = self.config.structured_outputs_config
        if params.structured_outputs is not None and limits is not None:
            # here too, before the pool's pickling: a JSON schema nested 500 deep (as a dict)
            # raised RecursionError there, a 500 (the check walks it without recursing)
            check_grammar_limits(params.structured_outputs, limits)
        if self._pool is None:
            return await asyncio.to_thread(preprocess, self.input_processor, self.limits,
                                           self.eos_token_ids, self._encoder, prompt, params,
                                           rid, image_loader, default_max_tokens,
                                           self.config.structured_outputs_config)
        return await self._in_pool(preprocess_in_worker, prompt, params, rid, image_loader,
                                   default_max_tokens)

    async def _in_pool(self, fn, *args):
        """``fn(*args)`` in a preprocessing process (one that dies running it is replaced and
        it is retried once: `ProcessPool`; a request that kills two raises
        `WorkerDiedError`)."""
        return await asyncio.wrap_future(self._pool.submit(fn, *args))

    async def generate(self, prompt: PromptInput, params: SamplingParams | None = None,
                       request_id: str | None = None) -> AsyncIterator[RequestOutput]:
        """Stream the outputs of one request (cumulative unless `params.output_kind` says
        otherwise; the last has `finished=True`)."""
        stream = await self.add_request(prompt, params, request_id)
        try:
            async for out in stream:
                yield out
        finally:
            stream.abort()

    def abort(self, request_id: str) -> None:
        self.client.abort(request_id)

    def fail_all(self, error: BaseException) -> None:
        """End every unfinished request with `error` and abort it in the core."""
        self.client.fail_all(error)

    async def _call(self, method: str) -> Any:
        """Call a method of the engine core (between two of its steps); its result."""
        self._check_alive()
        return await asyncio.wrap_future(self.client.call(method))

    async def reset_prefix_cache(self) -> None:
        """Forget every cached prefix (for benchmarks)."""
        await self._call("reset_prefix_cache")

    async def get_stats(self) -> dict[str, Any]:
        """The engine core's stats now (between two of its steps), plus this front end's."""
        stats = await self._call("get_stats")
        stats.update(num_streams=self.num_streams, frontend_pid=os.getpid(),
                     engine_core_pid=self.core_pid)
        if self._encoder_client is not None:  # this front end's side of --encoder-url
            stats["encoder_client"] = self._encoder_client.stats()
            if len(self._encoder_clients) > 1:
                for core, enc in zip(stats["cores"], self._encoder_clients, strict=True):
                    core["encoder_client"] = enc.stats()
        return stats

    def shutdown(self, timeout: float = 30.0) -> None:
        """Stop the engine core (if this front end started it) and the I/O thread;
        unfinished requests end with `EngineDeadError`."""
        self.client.stop(bool(self._procs), timeout)
        if self._encode_threads is not None:
            self._encode_threads.shutdown(wait=False, cancel_futures=True)
            for enc in self._encoder_clients:
                enc.close()
        if self._pool is not None:  # the workers hold nothing: stopped
            self._pool.shutdown()
        for proc in self._procs:
            proc.join(timeout)
        self._kill_core()

    def _new_pool(self, wait: bool = True) -> ProcessPool:
        return start_pool(self._preprocess_workers, self.config.model_config, self.limits,
                          self.eos_token_ids, wait, self.image_cache_bytes,
                          self._preprocess_threads, self.config.structured_outputs_config)

    def _kill_core(self) -> None:
        for proc in self._procs:
            if proc.is_alive():
                proc.kill()
                proc.join(5)

    def _check_alive(self) -> None:
        if not self.is_running:
            raise EngineDeadError(
                f"the engine is not running ({self.client.error or 'shut down'})")

    def _core_alive(self, index: int, core: CoreHandle) -> bool:
        if self._procs:
            return self._procs[index].is_alive()
        return pid_alive(core.pid)
