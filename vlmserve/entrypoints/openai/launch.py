"""`vlmserve serve`: the processes of the server and their lifecycle.

    --api-server-count 1 (default)        --api-server-count N
    this process: HTTP front end          this process: supervisor (binds the port, waits)
      '- child: engine core                 |- child: engine core
                                            '- N children: HTTP front ends, a socket each

With --data-parallel-size M there are M engine cores where one is drawn (each on its own GPUs);
every front end routes each request to one of them (frontend/dp_client.py). A core that dies
fails its own requests; the server exits 1 only when every core is gone.

Under torchrun (`torchrun ... -m vlmserve serve ... --tensor-parallel-size N`), global rank 0
is this server, whose engine core (a child: it inherits torchrun's variables) is tensor-parallel
rank 0; every other rank runs the executor's worker loop instead, until rank 0 shuts down.

The port is bound before anything loads, so a port in use fails at once. Every child dies
with its parent (PR_SET_PDEATHSIG): killing the server leaves no engine process behind.
If the engine core dies, each front end ends its in-flight requests with an error, answers
`/health` with 503 and exits 1 (and so does the supervisor). SIGTERM (or Ctrl-C) stops
accepting connections, lets in-flight requests finish for up to `--shutdown-timeout`
seconds, ends the rest with an error, stops the engine core and exits 0.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import multiprocessing as mp
import multiprocessing.connection
import os
import shutil
import signal
import socket
import sys
import tempfile
from types import FrameType
from typing import Any

import uvicorn
from prometheus_client.multiprocess import mark_process_dead

from vlmserve.config import EngineConfig
from vlmserve.distributed.parallel_state import torchrun_env
from vlmserve.encoder.ledger import TRANSPORTS
from vlmserve.engine.launch import core_environment
from vlmserve.entrypoints.args import ServerConfig, engine_kwargs
from vlmserve.entrypoints.openai.connections import raise_file_limit, server_config
from vlmserve.entrypoints.openai.reasoning import REASONING_PARSERS
from vlmserve.entrypoints.openai.server import build_app
from vlmserve.entrypoints.openai.tool_calls import TOOL_CALL_PARSERS
from vlmserve.frontend.async_llm import (
    AsyncLLM,
    CoreHandle,
    EngineDeadError,
    start_engine_cores,
)
from vlmserve.models.loader import load_hf_config
from vlmserve.models.metadata import local_engine_config, local_model_config, max_model_len
from vlmserve.utils import (
    die_with_parent,
    freeze_startup_heap,
    limit_host_threads,
    resolve_device,
)

logger = logging.getLogger("vlmserve.server")
DEAD_EXIT_DELAY_S = 1.0
_PROM_DIR_VAR = "PROMETHEUS_MULTIPROC_DIR"


def bind_sockets(host: str, port: int, count: int = 1) -> list[socket.socket]:
    """`count` listening sockets on host:port, bound now; a port in use raises `SystemExit`
    naming it. Several front ends get one socket each in an SO_REUSEPORT group, so the kernel
    spreads connections over them by address hash (one shared socket hands most of them to
    whichever process woke last). A plain bind proves the port free first: another server's
    reuse-port group would otherwise take this one in silently."""
    sock = _bind(host, port, reuse_port=False)
    if count == 1:
        return [sock]
    port = sock.getsockname()[1]  # port 0: the one the kernel chose, for all of them
    sock.close()
    return [_bind(host, port, reuse_port=True) for _ in range(count)]


def _bind(host: str, port: int, reuse_port: bool) -> socket.socket:
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    if reuse_port:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise SystemExit(f"cannot listen on {host}:{port}: {e.strerror}") from None
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock


class _Server(uvicorn.Server):
    """uvicorn that exits with our code, not by re-raising the signal that stopped it: 0
    after SIGTERM/SIGINT, 1 once `core_died` (the engine or encoder core is gone)."""

    def __init__(self, config: uvicorn.Config) -> None:
        super().__init__(config)
        self.exit_code = 0
        self._loop: asyncio.AbstractEventLoop | None = None

    async def serve(self, sockets: list[socket.socket] | None = None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().serve(sockets)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        first = not self.should_exit
        super().handle_exit(sig, frame)
        self._captured_signals.clear()  # exit with our code, not by re-raising the signal
        if first and self._loop is not None:
            self.draining()

    def draining(self) -> None:
        """The first SIGTERM/SIGINT's hook (uvicorn stops accepting and waits for requests)."""

    def core_died(self, error: BaseException) -> None:  # any thread
        """In-flight requests have been ended with the error; /health answers 503 for
        `DEAD_EXIT_DELAY_S` (so probes see why), then the server exits 1."""
        logger.error("%s: the server exits", error)
        self.exit_code = 1
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self._loop.call_later, DEAD_EXIT_DELAY_S,
                                            setattr, self, "should_exit", True)
        else:
            self.should_exit = True


class _FrontEndServer(_Server):
    """An LLM front end: the first SIGTERM/SIGINT drains (in-flight requests get
    `shutdown_timeout` seconds, then an error)."""

    def __init__(self, config: uvicorn.Config, engine: AsyncLLM, serving: Any,
                 shutdown_timeout: float) -> None:
        super().__init__(config)
        self.engine, self.serving, self.shutdown_timeout = engine, serving, shutdown_timeout

    def draining(self) -> None:
        logger.info("shutting down: in-flight requests have %.0f s to finish",
                    self.shutdown_timeout)
        self.serving.draining = True
        self._loop.call_soon_threadsafe(self._loop.call_later, self.shutdown_timeout,
                                        self._end_the_rest)

    def _end_the_rest(self) -> None:
        self.engine.fail_all(EngineDeadError(
            f"the server is shutting down (--shutdown-timeout {self.shutdown_timeout:g} s)"))


def serve_frontend(config: EngineConfig, cfg: ServerConfig, sock: socket.socket,
                   cores: list[CoreHandle] | None = None) -> int:
    """Run one HTTP front end on `sock` until it stops; its exit code. Without `cores`, it
    starts the engine cores itself (--data-parallel-size of them)."""
    engine = AsyncLLM(config, core=cores, log_level=cfg.log_level,
                      data_parallel_size=cfg.data_parallel_size, dp_routing=cfg.dp_routing,
                      preprocess_workers=cfg.preprocess_workers,
                      preprocess_threads=preprocess_threads(cfg),
                      encoder_urls=[u for u in (cfg.encoder_url or "").split(",") if u],
                      encoder_transport=cfg.encoder_transport,
                      image_cache_bytes=cfg.processed_image_cache_mb << 20)
    try:
        app = build_app(engine, cfg)
        server = _FrontEndServer(
            server_config(app, cfg, timeout_graceful_shutdown=cfg.shutdown_timeout + 5),
            engine, app.state.serving, cfg.shutdown_timeout)
        engine.client.add_dead_callback(server.core_died)
        freeze_startup_heap()
        server.run(sockets=[sock])
        return server.exit_code
    finally:
        engine.shutdown()


def serve_encoder(cfg: ServerConfig, kwargs: dict[str, Any]) -> int:
    """`vlmserve serve --role encoder`: the vision tower behind POST /v1/encode, until
    SIGTERM or Ctrl-C (exit 0; every live handle is reclaimed as the core stops) or the
    encoder core's death (exit 1). The encoder core is a child (`encoder/service.py`); this
    process is the HTTP front end, or with `--api-server-count N` the supervisor of N."""
    from vlmserve.encoder.service import start_encoder_core
    from vlmserve.entrypoints.openai.encoder_server import encoder_kwargs

    socks = bind_sockets(cfg.host, cfg.port, cfg.api_server_count)  # a busy port fails now
    # a model (and tokenizer) given by name becomes its folder here, once: the encoder core
    # and the front ends get the folder
    mc = local_model_config(EngineConfig.from_kwargs(**kwargs).model_config)
    kwargs = {**kwargs, "model": mc.model, "tokenizer": mc.tokenizer}
    try:
        proc, address = start_encoder_core(encoder_kwargs(cfg, kwargs), cfg.log_level)
    except RuntimeError as e:
        raise SystemExit(f"{e}") from None
    if len(socks) > 1:
        ctx = mp.get_context("spawn")
        fronts = [ctx.Process(target=_encoder_frontend_main, name=f"vlmserve-encoder-api-{i}",
                              args=(cfg, kwargs, sock, address, proc.pid))
                  for i, sock in enumerate(socks)]
        return _run_processes([proc], fronts, socks, cfg)
    try:
        return serve_encoder_frontend(cfg, kwargs, socks[0], address, proc.pid, owns_core=True)
    finally:
        proc.join(30)  # the core stops on the front end's Stop (or dies with it)
        if proc.is_alive():
            proc.kill()
            proc.join(5)


def serve_encoder_frontend(cfg: ServerConfig, kwargs: dict[str, Any], sock: socket.socket,
                           address: str, core_pid: int, owns_core: bool) -> int:
    """One encoder front end on `sock` over the encoder core at `address`; its exit code.
    `owns_core`: it stops the core as it stops (the only front end)."""
    from vlmserve.encoder.encoder import encoder_input_processor
    from vlmserve.encoder.service import EncoderCoreClient
    from vlmserve.entrypoints.openai.encoder_server import build_encoder_app

    mc = EngineConfig.from_kwargs(**kwargs).model_config  # its model a folder: serve_encoder
    processor = encoder_input_processor(
        mc.model, load_hf_config(mc.model, trust_remote_code=mc.trust_remote_code), mc)
    server = _Server(server_config(None, cfg, timeout_graceful_shutdown=cfg.shutdown_timeout))
    core = EncoderCoreClient(address, core_pid, on_dead=server.core_died, owns_core=owns_core)
    cuda = resolve_device(kwargs.get("device") or "auto").type == "cuda"
    server.config.app = build_encoder_app(core, processor, cfg, cuda=cuda)
    freeze_startup_heap()
    logger.info("encoder server for %s on http://%s:%d (handles: %s, lease %g s)",
                mc.model, cfg.host, cfg.port, cfg.encoder_transport,
                cfg.encoder_lease)
    server.run(sockets=[sock])
    return server.exit_code


def _encoder_frontend_main(cfg: ServerConfig, kwargs: dict[str, Any], sock: socket.socket,
                           address: str, core_pid: int) -> None:
    die_with_parent()
    _setup_logging(cfg)
    sys.exit(serve_encoder_frontend(cfg, kwargs, sock, address, core_pid, owns_core=False))


def preprocess_threads(cfg: ServerConfig) -> int:
    """Each preprocessing process's share of the host's cores (torch threads, for resizing),
    after one for the engine core and one for each front end: with 4 front ends of 2 workers
    on 16 cores, 1 (a thread per core in every process would oversubscribe the host 8
    times); with 1 front end of 2 workers, 7."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (
        os.cpu_count() or 1)
    workers = max(cfg.api_server_count * cfg.preprocess_workers, 1)
    return max(1, (cores - 1 - cfg.api_server_count) // workers)


def _frontend_main(config: EngineConfig, cfg: ServerConfig, sock: socket.socket,
                   cores: list[CoreHandle]) -> None:
    die_with_parent()
    if cfg.preprocess_workers > 0:  # its heavy host work runs in its pool
        limit_host_threads()
    _setup_logging(cfg)
    sys.exit(serve_frontend(config, cfg, sock, cores))


def _supervise(config: EngineConfig, cfg: ServerConfig, socks: list[socket.socket]) -> int:
    """Start the engine core and `api_server_count` front ends; wait for them. The front ends
    keep their Prometheus metrics in a directory of this process's own (multiprocess mode), so
    each one's `/metrics` shows them all."""
    metrics_dir = tempfile.mkdtemp(prefix="vlmserve-metrics-")
    saved = os.environ.get(_PROM_DIR_VAR)
    # a spawned child imports prometheus_client anew and reads this at import time
    os.environ[_PROM_DIR_VAR] = metrics_dir
    try:
        return _run_llm(config, cfg, socks, metrics_dir)
    finally:
        if saved is None:
            os.environ.pop(_PROM_DIR_VAR, None)
        else:
            os.environ[_PROM_DIR_VAR] = saved
        shutil.rmtree(metrics_dir, ignore_errors=True)


def _run_llm(config: EngineConfig, cfg: ServerConfig, socks: list[socket.socket],
             metrics_dir: str) -> int:
    ctx = mp.get_context("spawn")
    started = start_engine_cores(config, cfg.data_parallel_size, cfg.log_level)
    cores = [handle for _, handle in started]
    fronts = [ctx.Process(target=_frontend_main, name=f"vlmserve-api-{i}",
                          args=(config, cfg, sock, cores))
              for i, sock in enumerate(socks)]
    return _run_processes([proc for proc, _ in started], fronts, socks, cfg, metrics_dir)


def _run_processes(core_procs: list[mp.process.BaseProcess],
                   fronts: list[mp.process.BaseProcess], socks: list[socket.socket],
                   cfg: ServerConfig, metrics_dir: str | None = None) -> int:
    """Start the front ends (not yet started) over the running cores and wait: SIGTERM or
    SIGINT drains them all; the death of every core or a front end's failure stops the rest
    (a core that dies while others live fails only its requests); the cores are stopped last.
    The exit code: 1 after a failure, else 0."""
    for p in fronts:
        p.start()
    for sock in socks:
        sock.close()
    stopping = False
    dead: set[int] = set()
    cores_gone: set[int] = set()

    def mark_dead() -> None:  # its "live" gauges (its stream count) leave the sums
        if metrics_dir is None:
            return
        for p in fronts:
            if p.pid is not None and p.exitcode is not None and p.pid not in dead:
                dead.add(p.pid)
                mark_process_dead(p.pid, metrics_dir)

    def on_signal(sig: int, _: FrameType | None) -> None:
        nonlocal stopping
        stopping = True
        for p in fronts:
            if p.is_alive():
                p.terminate()  # SIGTERM: each drains

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    failed = False
    try:
        while any(p.is_alive() for p in fronts):
            watch = [p.sentinel for p in fronts if p.is_alive()]
            watch += [p.sentinel for p in core_procs if p.is_alive()]
            mp.connection.wait(watch, timeout=1.0)
            mark_dead()
            if failed or stopping:
                continue
            for i, p in enumerate(core_procs):
                if not p.is_alive() and i not in cores_gone:
                    cores_gone.add(i)
                    logger.error("%s %d died (exit code %s)", p.name, i, p.exitcode)
            if len(cores_gone) == len(core_procs):  # each front end tells its clients, exits 1
                failed = True
            elif gone := [p for p in fronts if p.exitcode not in (None, 0)]:
                logger.error("%s exited with %s; the server stops", gone[0].name,
                             gone[0].exitcode)
                failed = True
                on_signal(signal.SIGTERM, None)
    finally:
        for p in fronts:
            p.join(cfg.shutdown_timeout + 10)
            if p.is_alive():
                p.kill()
                p.join(5)
        mark_dead()
        for p in core_procs:
            if p.is_alive():
                p.terminate()
        for p in core_procs:
            p.join(30)
            if p.is_alive():
                p.kill()
    # a front end SIGTERMed before its server started exits by the signal: that is clean too
    return 1 if failed or any(p.exitcode not in (0, -signal.SIGTERM) for p in fronts) else 0


def _setup_logging(cfg: ServerConfig) -> None:
    logging.basicConfig(level=cfg.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")


def run_server(args: Any) -> None:
    """`vlmserve serve`: bind the port, start the processes, serve until stopped; exits
    non-zero if the engine core dies. The options are checked before anything loads: a
    mistake raises `SystemExit` or `ValueError` with one line (the CLI prints it)."""
    cfg = ServerConfig.from_args(args)
    # the engine's options as well (values, a device that is not here): no process starts
    config = EngineConfig.from_kwargs(**engine_kwargs(args))
    resolve_device(config.model_config.device)
    if cfg.data_parallel_size > 1 and cfg.role == "llm":
        core_environment(config, cfg.data_parallel_size)  # the cores fit the GPUs
    if cfg.api_server_count < 1:
        raise SystemExit("--api-server-count must be >= 1")
    if cfg.data_parallel_size < 1:
        raise SystemExit("--data-parallel-size must be >= 1")
    if cfg.role not in ("llm", "encoder"):
        raise SystemExit(f"--role must be llm or encoder, not {cfg.role!r}")
    if cfg.encoder_transport not in TRANSPORTS:
        raise SystemExit(f"--encoder-transport must be one of {', '.join(TRANSPORTS)}")
    if cfg.tool_call_parser is not None and cfg.tool_call_parser not in TOOL_CALL_PARSERS:
        raise SystemExit(f"--tool-call-parser must be one of "
                         f"{', '.join(TOOL_CALL_PARSERS)}, not {cfg.tool_call_parser!r}")
    try:
        cfg.chat_template_text()
    except ValueError as e:
        raise SystemExit(f"{e}") from None
    if cfg.reasoning_parser is not None and cfg.reasoning_parser not in REASONING_PARSERS:
        raise SystemExit(f"--reasoning-parser must be one of "
                         f"{', '.join(REASONING_PARSERS)}, not {cfg.reasoning_parser!r}")
    for name in ("request_header_timeout", "timeout_keep_alive", "limit_concurrency"):
        value = getattr(cfg, name)
        if value is not None and not value > 0:
            raise SystemExit(f"--{name.replace('_', '-')} must be > 0")
    if cfg.enable_auto_tool_choice and cfg.tool_call_parser is None:
        raise SystemExit("--enable-auto-tool-choice needs --tool-call-parser (one of "
                         f"{', '.join(TOOL_CALL_PARSERS)})")
    _setup_logging(cfg)
    raise_file_limit()  # connections are capped from it (each process inherits it)
    if cfg.encoder_api_key:  # the front ends' preprocessing processes inherit it
        os.environ["VLMSERVE_ENCODER_API_KEY"] = cfg.encoder_api_key
    if cfg.role == "encoder":
        sys.exit(serve_encoder(cfg, engine_kwargs(args)))
    # clients name the model as the user did ("org/name"), not by its folder
    cfg = dataclasses.replace(cfg, served_model_name=cfg.served_model_names()
                              or (config.model_config.model,))
    env = torchrun_env()
    if env is not None and cfg.data_parallel_size > 1:
        raise SystemExit("--data-parallel-size does not run under torchrun (its tensor "
                         "parallelism spans hosts); run a server per host, or use Ray")
    if env is not None and env.rank != 0:  # torchrun: rank 0 serves, the others do this
        from vlmserve.executor.multiproc import run_torchrun_worker

        code = run_torchrun_worker(config, env)
        # out without the interpreter's teardown: a gloo thread may still be releasing the
        # last broadcast's tensors, and a release that needs the interpreter while it
        # finalizes aborts the process (std::terminate), so torchrun would see a failure
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    socks = bind_sockets(cfg.host, cfg.port, cfg.api_server_count)
    # the port is ours: now a model (and tokenizer) given by name becomes its folder, once
    # (a download may take a while); every process started from here gets the folder
    config = local_engine_config(config)
    mc = config.model_config  # a --max-model-len beyond the model's context: refused now
    max_model_len(mc, load_hf_config(mc.model, mc.model_impl,
                                     trust_remote_code=mc.trust_remote_code))
    if cfg.api_server_count == 1:
        code = serve_frontend(config, cfg, socks[0])
    else:
        code = _supervise(config, cfg, socks)
    sys.exit(code)
