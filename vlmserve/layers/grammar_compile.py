"""Grammar compiles, bounded: each grammar is compiled (xgrammar, against the model's
tokenizer) in a compile process of our own, so that no grammar a client sends can hold the
engine core's loop or grow its memory. A compile past its deadline
(`grammar_compile_timeout`) or its memory limit (`grammar_compile_memory_gb`) ends with its
process and refuses its request naming the option; a compile whose requests are all gone
(aborted) ends at once; a grammar that kills its process twice is refused. Each process
compiles one grammar at a time, the smallest waiting first, and one over
`LARGE_GRAMMAR_BYTES` never takes the last free process, so small grammars never wait behind
large ones. Compile processes are forked by a zygote that imported xgrammar and read the
tokenizer once (layers/grammar_processes.py), so one that was ended is replaced in
milliseconds. Compiled grammars come back
serialized and are kept in the engine core by their text (up to `CACHE_BYTES`).

What a request may ask for at all (bytes, nesting, choices) is checked before anything
compiles (`grammar.check_grammar_limits`, also by the front end).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from concurrent.futures import Future
from typing import Any

from vlmserve.config import StructuredOutputsConfig
from vlmserve.errors import InvalidSamplingParamsError
from vlmserve.layers.grammar import _xgrammar, check_grammar_limits
from vlmserve.layers.grammar_processes import CompileProcess, Spec, Zygote
from vlmserve.sampling_params import StructuredOutputsParams

logger = logging.getLogger(__name__)
# compiled grammars kept in the engine core for requests that ask again (vLLM's default size)
CACHE_BYTES = 512 << 20
# a grammar this large (its text, in bytes) never takes the last free compile process
LARGE_GRAMMAR_BYTES = 16 << 10
COMPILE_THREADS = 4  # xgrammar's threads in one compile process
PROCESS_CACHE_BYTES = 64 << 20  # xgrammar's own cache in one compile process
POLL_S = 0.02  # how often a running compile's deadline, memory and requests are checked
MAX_DEATHS = 2  # a grammar whose compile process dies this often is refused


class GrammarCompileError(InvalidSamplingParamsError):
    """A request's grammar was refused while compiling: past its deadline or memory limit,
    it killed its compile process, or xgrammar cannot compile it (the client's input)."""


class _Job:
    """One grammar being compiled for the requests in `waiters` (and, with `keep`, for a
    caller that is no request)."""

    def __init__(self, spec: Spec) -> None:
        self.spec = spec
        self.size = len(spec[1].encode())
        self.large = self.size > LARGE_GRAMMAR_BYTES
        self.future: Future = Future()
        self.waiters: set[str] = set()
        self.keep = False
        self.cancelled = False  # every request that asked is gone
        self.pid: int | None = None  # the compile process running it
        self.deaths = 0  # compile processes that died running it


class GrammarCompiler:
    """Grammars compiled against the model's tokenizer in `grammar_compile_workers` compile
    processes, under the limits of ``config``, cached by their text. The engine core
    `start`s a request's compile when it arrives and admits it once compiled; the runner
    `take`s that compile; `forget` drops a request's claim (its compile ends when no request
    waits for it). Nothing is started or imported until a request asks for structured
    output."""

    def __init__(self, tokenizer: Any, vocab_size: int, eos_token_ids: tuple[int, ...],
                 config: StructuredOutputsConfig | None = None) -> None:
        self._tokenizer, self.vocab_size, self._eos = tokenizer, vocab_size, list(eos_token_ids)
        self.config = config or StructuredOutputsConfig()
        self._cond = threading.Condition()
        self._pending: list[_Job] = []
        self._running: set[_Job] = set()
        self._jobs: dict[Spec, _Job] = {}  # pending or running, by spec
        self._job_of: dict[str, _Job] = {}  # request id -> the job it waits for
        self._by_request: dict[str, Future] = {}  # for the runner's `take`
        self._cache: OrderedDict[Spec, Any] = OrderedDict()
        self._cache_bytes = 0
        self._running_large = 0
        self._spare = 0  # compile processes idle or starting
        self._threads: list[threading.Thread] = []
        self._stop = threading.Event()
        self._setup_lock = threading.Lock()
        self._zygote: Zygote | None = None
        self._info: Any = None  # xgrammar's TokenizerInfo (compiled grammars are read with it)

    # ---- the engine core's side ------------------------------------------------------------

    def start(self, params: StructuredOutputsParams, request_id: str | None = None
              ) -> Future:
        """The compiled grammar of ``params``, soon (its limits are checked now: a grammar
        over them raises `InvalidSamplingParamsError`); with ``request_id``, kept for the
        runner's `take`, and the compile ends if that request is forgotten before it is
        done (and no other request waits for the same grammar)."""
        check_grammar_limits(params, self.config)
        spec = params.spec
        with self._cond:
            compiled = self._cache.get(spec)
            if compiled is not None:
                self._cache.move_to_end(spec)
                future: Future = Future()
                future.set_result(compiled)
            else:
                job = self._jobs.get(spec)
                if job is None:
                    job = self._jobs[spec] = _Job(spec)
                    self._pending.append(job)
                    self._cond.notify_all()
                if request_id is None:
                    job.keep = True
                else:
                    job.waiters.add(request_id)
                    self._job_of[request_id] = job
                future = job.future
            if request_id is not None:
                self._by_request[request_id] = future
            if not self._threads:
                self._threads = [threading.Thread(target=self._serve, name=f"grammar-{i}",
                                                  daemon=True)
                                 for i in range(self.config.grammar_compile_workers)]
                for t in self._threads:
                    t.start()
        return future

    def take(self, request_id: str, params: StructuredOutputsParams) -> Future:
        """The compile the engine core started for this request (compiled by now: no wait
        behind other compiles), or a new one."""
        with self._cond:
            compiled = self._by_request.pop(request_id, None)
        return compiled if compiled is not None else self.start(params)

    def forget(self, request_id: str) -> None:
        """The request ended before the runner took its grammar: its compile ends if no
        other request waits for it."""
        with self._cond:
            self._by_request.pop(request_id, None)
            job = self._job_of.pop(request_id, None)
            if job is None or job.future.done():
                return
            job.waiters.discard(request_id)
            if job.waiters or job.keep:
                return
            job.cancelled = True  # running: its process is ended at its next check
            if self._jobs.get(job.spec) is job:
                del self._jobs[job.spec]
            waiting = job in self._pending
            if waiting:
                self._pending.remove(job)
        if waiting:
            job.future.cancel()

    def busy(self) -> dict[int, list[str]]:
        """The compile processes compiling now, each with the requests it compiles for."""
        with self._cond:
            return {job.pid: sorted(job.waiters) for job in self._running
                    if job.pid is not None}

    def shutdown(self) -> None:
        with self._cond:
            self._stop.set()
            pending, self._pending = self._pending, []
            self._cond.notify_all()
        for job in pending:
            job.future.cancel()
        for t in self._threads:
            t.join(5)
        with self._setup_lock:
            if self._zygote is not None:
                self._zygote.close()

    # ---- the compile processes -------------------------------------------------------------

    def _pick(self) -> _Job | None:
        """The smallest waiting grammar, unless it is large and would take the last free
        compile process (under the lock)."""
        if not self._pending:
            return None
        job = min(self._pending, key=lambda j: j.size)
        if (job.large and self.config.grammar_compile_workers > 1
                and self._running_large >= self.config.grammar_compile_workers - 1):
            return None
        return job

    def _serve(self) -> None:
        """One compile process's thread: starts it when more grammars wait than processes
        are idle or starting (again at once after it was ended), hands it one grammar at a
        time."""
        proc: CompileProcess | None = None
        restart = False
        try:
            while True:
                with self._cond:
                    job = None
                    while not self._stop.is_set():
                        if proc is not None:
                            job = self._pick()
                            if job is not None:
                                break
                        elif restart or len(self._pending) > self._spare:
                            break
                        self._cond.wait()
                    if self._stop.is_set():
                        return
                    if job is None:
                        self._spare += 1  # starting
                    else:
                        self._spare -= 1
                        self._pending.remove(job)
                        self._running.add(job)
                        self._running_large += job.large
                        job.pid = proc.pid
                if job is None:
                    proc, restart = self._start_process(), False
                    if proc is None:
                        with self._cond:
                            self._spare -= 1
                    continue
                if self._compile(proc, job):
                    with self._cond:
                        self._spare += 1
                        self._cond.notify_all()
                else:
                    proc.kill()
                    proc, restart = None, True
        finally:
            if proc is not None:
                proc.kill()

    def _start_process(self) -> CompileProcess | None:
        try:
            return self._zygote_now().fork(self._stop)
        except Exception as e:  # noqa: BLE001 - reported to the requests waiting
            if not self._stop.is_set():
                self._fail_pending(e)
            return None

    def _fail_pending(self, error: Exception) -> None:
        logger.error("grammar compiles fail: %s", error)
        with self._cond:
            failed, self._pending = self._pending, []
            for job in failed:
                self._jobs.pop(job.spec, None)
                self._drop_waiters(job)
        for job in failed:
            job.future.set_exception(RuntimeError(f"no grammar compile process: {error}"))

    def _zygote_now(self) -> Zygote:
        """The zygote, started now if it is not running (the tokenizer built once, here)."""
        import msgspec
        with self._setup_lock:
            if self._zygote is None or not self._zygote.alive():
                if self._info is None:
                    self._info = _xgrammar().TokenizerInfo.from_huggingface(
                        self._tokenizer, vocab_size=self.vocab_size, stop_token_ids=self._eos)
                setup = msgspec.msgpack.encode({
                    "tokenizer_info": self._info.serialize_json(), "threads": COMPILE_THREADS,
                    "cache_bytes": PROCESS_CACHE_BYTES})
                self._zygote = Zygote(setup, self._stop)
            return self._zygote

    def _compile(self, proc: CompileProcess, job: _Job) -> bool:
        """Run ``job`` in ``proc`` and settle it; False if ``proc`` had to be ended (or
        died)."""
        import msgspec
        cfg = self.config
        try:
            proc.conn.send_bytes(msgspec.msgpack.encode(list(job.spec)))
            base = proc.rss()
            deadline = time.monotonic() + cfg.grammar_compile_timeout
            while not proc.conn.poll(POLL_S):
                error = None
                if job.cancelled or self._stop.is_set():
                    self._settle(job, cancelled=True)
                    return False
                if time.monotonic() > deadline:
                    error = (f"the grammar did not compile within "
                             f"{cfg.grammar_compile_timeout:g} s (--grammar-compile-timeout)")
                rss = proc.rss()
                if (rss is not None and base is not None
                        and rss - base > cfg.grammar_compile_memory_gb * 2**30):
                    error = (f"compiling the grammar took more than "
                             f"{cfg.grammar_compile_memory_gb:g} GiB of memory "
                             "(--grammar-compile-memory-gb)")
                if error is not None:
                    logger.warning("a grammar compile ended: %s", error)
                    self._settle(job, error=GrammarCompileError(f"structured outputs: {error}"))
                    return False
            ok, payload = msgspec.msgpack.decode(proc.conn.recv_bytes())
        except (EOFError, OSError):
            job.deaths += 1
            logger.warning("a grammar compile process died (%d time(s) on this grammar)",
                           job.deaths)
            if job.deaths < MAX_DEATHS:
                self._retry(job)
            else:
                self._settle(job, error=GrammarCompileError(
                    f"structured outputs: the grammar killed its compile process "
                    f"{job.deaths} times"))
            return False
        if not ok:
            self._settle(job, error=GrammarCompileError(
                f"structured outputs: the grammar did not compile: {payload}"))
            return True
        try:
            compiled = _xgrammar().CompiledGrammar.deserialize_json(payload, self._info)
        except Exception as e:  # noqa: BLE001 - not the client's: a 500
            self._settle(job, error=RuntimeError(f"a compiled grammar could not be read: {e}"))
            return False
        self._settle(job, result=compiled)
        return True

    def _retry(self, job: _Job) -> None:
        with self._cond:
            self._stop_running(job)
            if job.cancelled:
                cancelled = True
            else:
                cancelled = False
                self._pending.append(job)
                self._cond.notify_all()
        if cancelled:
            job.future.cancel()

    def _stop_running(self, job: _Job) -> None:
        if job in self._running:
            self._running.discard(job)
            self._running_large -= job.large
        job.pid = None

    def _drop_waiters(self, job: _Job) -> None:
        for rid in job.waiters:
            if self._job_of.get(rid) is job:
                del self._job_of[rid]

    def _settle(self, job: _Job, result: Any = None, error: Exception | None = None,
                cancelled: bool = False) -> None:
        with self._cond:
            self._stop_running(job)
            if self._jobs.get(job.spec) is job:
                del self._jobs[job.spec]
            self._drop_waiters(job)
            if result is not None:
                self._remember(job.spec, result)
            self._cond.notify_all()
        if cancelled:
            job.future.cancel()
        elif error is not None:
            job.future.set_exception(error)
        else:
            job.future.set_result(result)

    def _remember(self, spec: Spec, compiled: Any) -> None:
        size = compiled.memory_size_bytes
        if size > CACHE_BYTES:
            return
        self._cache[spec] = compiled
        self._cache_bytes += size
        while self._cache_bytes > CACHE_BYTES:
            _, old = self._cache.popitem(last=False)
            self._cache_bytes -= old.memory_size_bytes
