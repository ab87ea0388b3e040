"""Process, thread and device helpers every process of ours shares (front ends, engine core,
encoder core, tensor-parallel ranks): nothing here imports another vlmserve module."""

from __future__ import annotations

import ctypes
import fcntl
import gc
import importlib
import logging
import os
import queue
import signal
import tempfile
import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any, TypeVar

import torch

logger = logging.getLogger(__name__)
IDLE_POLL_MS = 200  # while idle, how often a child process checks its parent's liveness
_DTYPES = {"float32": torch.float32, "float": torch.float32, "bfloat16": torch.bfloat16,
           "float16": torch.float16, "half": torch.float16}


def limit_host_threads(threads: int = 1) -> None:
    """Give torch `threads` intra-op threads in a process that is one of many on the host (a
    preprocessing worker, a front end, a GPU engine core), unless the user set
    OMP_NUM_THREADS: each process would otherwise start one thread per core. On the H200
    host a dozen such processes shared 16 cores, and the engine core's pixel staging (one
    memcpy) took an estimated tens of milliseconds a step; contention is the likely cause,
    not isolated. vLLM also sets OMP_NUM_THREADS=1 by default."""
    if "OMP_NUM_THREADS" not in os.environ:
        torch.set_num_threads(threads)


def cuda_module_available(device, module: str) -> bool:
    """Whether ``module`` (a CUDA kernel library: triton, fla) can run on ``device``: a CUDA
    device and the module importable."""
    if device.type != "cuda":
        return False
    try:
        importlib.import_module(module)
    except ImportError:
        return False
    return True


def resolve_device(name: str, rank: int | None = None) -> torch.device:
    """`auto` is CUDA when available; a tensor-parallel rank takes this host's GPU `rank`
    (its local rank)."""
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {name!r} asked for, but torch sees no CUDA GPU here; use "
                         "--device cpu (or auto)")
    if device.type == "cuda" and rank is not None:
        device = torch.device("cuda", rank)
    return device


def to_device(t: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """A host tensor built for this step, on ``device`` without waiting for its stream: on
    CUDA it is copied from pinned memory (torch's caching host allocator, whose block is
    reused only once the copy is done). From pageable memory the driver stages the copy and
    "may synchronize with the stream" (CUDA's API synchronization notes), which would make
    the launch wait for every step queued before it; torch's sync debug mode does not see
    such a wait."""
    device = torch.device(device)
    if device.type != "cuda" or t.device.type != "cpu":
        return t.to(device)
    if torch.cuda.is_current_stream_capturing():  # a graph would replay the copy from a
        # pinned block the host allocator hands out again
        raise RuntimeError("a host tensor copied inside a CUDA graph capture: build it "
                           "before the capture and copy it into the graph's buffers")
    if not t.is_pinned():
        t = t.pin_memory()
    return t.to(device, non_blocking=True)


def device_memory(device: torch.device) -> int | None:
    """A GPU's total memory in bytes (what its default batch limits are sized by); None for
    any other device."""
    if device.type != "cuda":
        return None
    return torch.cuda.get_device_properties(device).total_memory


class DeviceShare:
    """This process's share of a GPU, ``utilization`` of its memory (vLLM's
    gpu_memory_utilization), for a `with` block that loads a model and sizes its caches:
    `budget()` is the share less what the process took since the block began. Entering
    refuses a GPU whose free memory is below the share, and waits for any other process of
    this host sizing its caches on the same GPU (a lock file per GPU), so engines started
    together (cores of `--data-parallel-size` sharing a GPU, Ray replicas of half a GPU) do
    not count each other's allocations as their own. A rank of a tensor-parallel engine
    passes ``lock=False``: it meets the other ranks in collectives while sizing, and two such
    engines each holding one GPU's lock would wait for each other for good. On any other
    device it does nothing: `budget()` is None."""

    def __init__(self, device: torch.device, utilization: float, lock: bool = True) -> None:
        self.device, self.utilization, self.locks = device, utilization, lock
        self.free_at_start = self.total = self._cached_at_start = 0
        self._lock: int | None = None

    def __enter__(self) -> DeviceShare:
        if self.device.type != "cuda":
            return self
        if self.locks:
            self._take_lock()
        try:
            gc.collect()  # an engine this process dropped may still hold the GPU in a cycle
            self.free_at_start, self.total = torch.cuda.mem_get_info(self.device)
            self._cached_at_start = _cached_free(self.device)
            want = self.utilization * self.total
            free = self.free_at_start + self._cached_at_start  # free for this process
            if free < want:
                gib = 1 << 30
                raise RuntimeError(
                    f"the GPU has {free / gib:.1f} GiB free of "
                    f"{self.total / gib:.1f} GiB at start, less than gpu_memory_utilization="
                    f"{self.utilization:g} asks for ({want / gib:.1f} GiB): lower it, or free "
                    "the memory other processes hold")
        except BaseException:
            self.__exit__(None, None, None)
            raise
        return self

    def _take_lock(self) -> None:
        uuid = torch.cuda.get_device_properties(self.device).uuid
        path = os.path.join(tempfile.gettempdir(), f"vlmserve-gpu-{uuid}.lock")
        try:
            self._lock = os.open(path, os.O_RDWR | os.O_CREAT, 0o666)
        except OSError:  # no lock where the temp folder is not writable: sized as if alone
            return
        try:
            fcntl.flock(self._lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            logger.info("waiting for another engine on GPU %s to size its caches", uuid)
            fcntl.flock(self._lock, fcntl.LOCK_EX)

    def __exit__(self, *exc: object) -> None:
        if self._lock is not None:
            os.close(self._lock)  # closing the file releases its lock
            self._lock = None

    def budget(self) -> float | None:
        """Bytes this process may still take within its share (None off CUDA)."""
        if self.device.type != "cuda":
            return None
        free, _ = torch.cuda.mem_get_info(self.device)
        # what it took: from the device, and from blocks torch's allocator held free at start
        taken = self.free_at_start - free + self._cached_at_start - _cached_free(self.device)
        return self.utilization * self.total - taken


def _cached_free(device: torch.device) -> int:
    """Bytes torch's caching allocator holds on ``device`` unused: free for this process,
    not for the device."""
    return torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if name not in _DTYPES:
        raise ValueError(f"unknown dtype {name!r}; choose from auto, {', '.join(_DTYPES)}")
    return _DTYPES[name]


def die_with_parent() -> None:
    """Ask the kernel to SIGKILL this process when its parent exits (Linux); the parent
    starts it through `start_children`."""
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except OSError:  # not Linux: the idle parent check below still ends us
        pass


T = TypeVar("T")
_starts: queue.SimpleQueue | None = None
_starts_lock = threading.Lock()


def _run_starts(starts: queue.SimpleQueue) -> None:
    while True:
        fn, done = starts.get()
        if done.set_running_or_notify_cancel():
            try:
                done.set_result(fn())
            except BaseException as e:  # noqa: BLE001 - the caller's to raise
                done.set_exception(e)


def start_children(fn: Callable[[], T]) -> T:
    """``fn()``, which starts child processes that die with their parent
    (`die_with_parent`), run on a thread that lives as long as this process. The kernel
    sends PR_SET_PDEATHSIG when the *thread* that started the child ends, not the process:
    a child started from a thread pool's worker (``asyncio.to_thread``; anyio's pool, which
    retires threads idle for 10 s) is killed when that worker is retired. The main thread
    lives as long as the process."""
    global _starts
    if threading.current_thread() is threading.main_thread():
        return fn()
    with _starts_lock:
        if _starts is None:
            _starts = queue.SimpleQueue()
            threading.Thread(target=_run_starts, args=(_starts,), daemon=True,
                             name="vlmserve-child-starter").start()
    done: Future = Future()
    _starts.put((fn, done))
    return done.result()


def pid_alive(pid: int) -> bool:
    """Whether process `pid` runs (a zombie, dead but not yet reaped, does not)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False
    except OSError:  # no /proc: ask the kernel
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        return True


def freeze_startup_heap() -> None:
    """Move every object alive now (modules, model, tokenizer, processor: they live as long
    as the process) out of the garbage collector's reach. A full pass over them costs ~90 ms
    in a front end (torch and transformers imported), a stall of every stream and step each
    time enough request objects have outlived the young generations. Call once start-up is
    done, in every long-lived process of our own (never in a user's: the in-process `LLM`
    must not pin its caller's objects, nor its own model once dropped)."""
    gc.collect()
    gc.freeze()


def run_by_name(target: str, *args: Any) -> Any:
    """Call the function named `target` ("package.module:function"), imported here: a spawned
    process's entry point, so that the parent imports only this module, not the target's (a
    front end starting an engine core never loads the engine's modules itself)."""
    module, _, name = target.partition(":")
    return getattr(importlib.import_module(module), name)(*args)
