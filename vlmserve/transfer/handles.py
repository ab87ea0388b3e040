"""Embedding handles: plain picklable descriptions of a 2-D tensor of embedding rows that a
producer (the encoder) holds for one consumer.

    ShmHandle       CPU: the rows in a POSIX shared-memory segment (same host)
    CudaIpcHandle   CUDA: a CUDA IPC handle of the rows' own block (same host)
    BytesHandle     any host: the rows inline as safetensors bytes

Consumer side: ``handle.open()`` or ``handle.copy_into(dst)`` copies the rows out and then
releases the handle; ``handle.release()`` gives it up unread (e.g. its content hash is already
cached). Each notifies the producer's ledger (``opened`` before the read, ``released`` after
it) through the consumer ledger of this process, which also refuses a second open.

Producer side: ``make_*`` functions (used by `HandleLedger.export`) return the handle and the
backing object whose ``free(...)`` the ledger calls once, on release or at the lease.
"""

from __future__ import annotations

import json
import mmap
import os
import re
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing import resource_tracker
from multiprocessing.shared_memory import SharedMemory
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from vlmserve.transfer.consumer_ledger import ConsumerLedger


class HandleError(RuntimeError):
    """A handle that cannot be (or may no longer be) read."""


class HandleOpenedTwiceError(HandleError):
    """The handle was already opened or released in this process."""


class HandleExpiredError(HandleError):
    """The handle's lease ran out: the producer may have reclaimed its rows."""


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


# the dtypes of embedding rows a handle may carry (a model's float dtypes)
ROW_DTYPES = ("float32", "float16", "bfloat16")
# a shared-memory segment's name: what a producer makes, nothing a path could be made of
_SEGMENT_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,199}")


def check_segment_name(name: str) -> None:
    """`HandleError` unless ``name`` is a plain segment name (no ``/``, not ``.`` or
    ``..``, no NUL, 1 to 200 characters of letters, digits, ``_``, ``.``, ``-``)."""
    if not isinstance(name, str) or not _SEGMENT_NAME.fullmatch(name):
        shown = name if len(name) <= 40 else name[:40] + "..."
        raise HandleError(f"shared-memory segment name {shown!r}: expected 1 to 200 letters, "
                          "digits, '_', '.' or '-', not starting with '.' or '-'")


@dataclass
class EmbeddingHandle:
    """Rows ``[shape[0], shape[1]]`` of ``dtype`` held by a producer until released.

    ``release_address``: the producer ledger's zmq PULL endpoint (``ipc://`` or ``tcp://``);
    ``expires_at``: wall-clock time (``time.time()``) after which the producer may reclaim
    the rows; opening later raises `HandleExpiredError`.
    """

    handle_id: str
    shape: tuple[int, ...]
    dtype: str
    release_address: str | None
    expires_at: float

    kind = "base"

    @property
    def torch_dtype(self) -> torch.dtype:
        return getattr(torch, self.dtype)

    @property
    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n

    @property
    def nbytes(self) -> int:
        return self.numel * self.torch_dtype.itemsize

    def open(self, device: torch.device | str | None = None,
             ledger: ConsumerLedger | None = None) -> torch.Tensor:
        """A new tensor with the rows (on ``device``; default: where they are, the CPU for
        shared memory and bytes), then the handle is released."""
        self._check_declared()  # before the declared rows take any memory
        dst = torch.empty(self.shape, dtype=self.torch_dtype, device=device or
                          self._default_device())
        return self.copy_into(dst, ledger)

    def copy_into(self, dst: torch.Tensor, ledger: ConsumerLedger | None = None
                  ) -> torch.Tensor:
        """Copy the rows into ``dst`` (same shape and dtype; any device), wait for the copy,
        release the handle; returns ``dst``. Raises `HandleOpenedTwiceError` if this process
        opened or released it before, `HandleExpiredError` past the lease (the handle is
        released in both cases, so the producer frees it)."""
        if tuple(dst.shape) != tuple(self.shape) or dst.dtype != self.torch_dtype:
            raise ValueError(f"handle {self.handle_id}: rows {tuple(self.shape)} {self.dtype}, "
                             f"destination {tuple(dst.shape)} {dtype_name(dst.dtype)}")
        ledger = ledger or _consumer_ledger()
        ledger.begin(self)
        ok = False
        try:
            if time.time() > self.expires_at:
                raise HandleExpiredError(f"handle {self.handle_id}: its lease ran out "
                                         f"{time.time() - self.expires_at:.3f} s ago")
            self._read_into(dst)
            ok = True
        finally:
            ledger.finish(self, copied=ok)
        return dst

    def release(self, ledger: ConsumerLedger | None = None) -> None:
        """Give the handle up without reading it (the producer frees the rows)."""
        (ledger or _consumer_ledger()).discard(self)

    # ---- per transport ---------------------------------------------------------------------

    def _default_device(self) -> torch.device:
        return torch.device("cpu")

    def _check_declared(self) -> None:
        """`HandleError` if what the handle holds is not the rows it declares (where that
        can be seen without reading them)."""

    def _read_into(self, dst: torch.Tensor) -> None:
        raise NotImplementedError


def _consumer_ledger() -> ConsumerLedger:
    from vlmserve.transfer.consumer_ledger import consumer_ledger

    return consumer_ledger()


# ---- shared memory ---------------------------------------------------------------------------


@dataclass
class ShmHandle(EmbeddingHandle):
    """The rows in the POSIX shared-memory segment ``segment`` (``/dev/shm/<segment>``)."""

    segment: str = ""

    kind = "shm"

    def _check_declared(self) -> None:
        check_segment_name(self.segment)
        try:
            _map_segment(self.segment, self.nbytes).close()
        except HandleExpiredError:  # gone: the read says so, and tells its producer
            pass

    def _read_into(self, dst: torch.Tensor) -> None:
        check_segment_name(self.segment)
        buf = _map_segment(self.segment, self.nbytes)
        try:
            src = torch.frombuffer(buf, dtype=self.torch_dtype, count=self.numel)
            dst.copy_(src.view(self.shape))
            del src  # the buffer export must end before the mapping closes
        finally:
            buf.close()


def _map_segment(name: str, size: int) -> mmap.mmap:
    """Map an existing segment without registering it with this process's resource tracker
    (on Python < 3.13 ``SharedMemory(name)`` registers it, and the tracker of a consumer
    process would unlink the producer's segment, with a warning, when that process exits)."""
    import _posixshmem

    try:
        fd = _posixshmem.shm_open("/" + name, os.O_RDWR, mode=0o600)
    except FileNotFoundError:
        raise HandleExpiredError(f"shared-memory segment {name} is gone (released or "
                                 "reclaimed)") from None
    try:
        held = os.fstat(fd).st_size
        if held < size:
            raise HandleError(f"shared-memory segment {name} holds {held} bytes, fewer than "
                              f"the {size} its handle declares")
        return mmap.mmap(fd, size)
    finally:
        os.close(fd)


class ShmBacking:
    """The producer's side of a segment: unlinked exactly once, by `free`.

    The segment stays registered with the producer's resource tracker, so that if the producer
    dies the tracker unlinks what it left; `free` unlinks and unregisters it."""

    def __init__(self, shm: SharedMemory) -> None:
        self.shm: SharedMemory | None = shm

    def free(self, *, opened: bool, consumer_alive: bool) -> None:
        shm, self.shm = self.shm, None
        if shm is None:
            return
        try:
            shm.unlink()
        except FileNotFoundError:  # someone else unlinked it: unregister all the same
            resource_tracker.unregister(shm._name, "shared_memory")


def make_shm(rows: torch.Tensor, handle_id: str, address: str | None, expires_at: float,
             segment: str) -> tuple[ShmHandle, ShmBacking]:
    """Copy ``rows`` into a new segment named ``segment``."""
    rows = rows.detach()
    nbytes = rows.numel() * rows.element_size()
    assert nbytes > 0, "an empty embedding has nothing to share"
    shm = SharedMemory(name=segment, create=True, size=nbytes)
    try:
        dst = torch.frombuffer(shm.buf, dtype=rows.dtype, count=rows.numel())
        dst.view(rows.shape).copy_(rows)
        del dst
        shm.close()  # the producer needs no mapping; the segment lives until unlinked
    except BaseException:
        shm.close()
        shm.unlink()
        raise
    handle = ShmHandle(handle_id, tuple(rows.shape), dtype_name(rows.dtype), address,
                       expires_at, segment=shm.name)
    return handle, ShmBacking(shm)


# ---- CUDA IPC ------------------------------------------------------------------------------


@dataclass
class CudaIpcHandle(EmbeddingHandle):
    """``rebuild(*args)`` (from ``torch.multiprocessing.reductions.reduce_tensor``) maps the
    producer's block in the consumer. The consumer must see the producer's GPU under the same
    index. Opening it twice, or in the producer's own process, is not allowed."""

    rebuild: Callable[..., torch.Tensor] | None = None
    args: tuple[Any, ...] = ()
    # pooled: ``args`` share a whole pool block (uint8), shared once; the rows are at this
    # byte offset in it, and the consumer maps each block once (`_mapped_block`)
    block_offset: int | None = None

    kind = "cuda"

    def _default_device(self) -> torch.device:
        return self.args[6] if len(self.args) > 6 else torch.device("cuda")

    def open(self, device: torch.device | str | None = None,
             ledger: ConsumerLedger | None = None) -> torch.Tensor:
        """The rows in a new tensor on ``device`` (default: the producer's GPU). On a GPU the
        copy runs on a side stream of its own: a consumer whose current stream is busy (an
        engine step in flight) does not wait for it."""
        device = torch.device(device if device is not None else self._default_device())
        if device.type != "cuda":
            return super().open(device, ledger)
        side = _side_stream(device)
        with torch.cuda.stream(side):
            dst = torch.empty(self.shape, dtype=self.torch_dtype, device=device)
            self.copy_into(dst, ledger)
        dst.record_stream(torch.cuda.current_stream(device))  # used there from now on
        return dst

    def _read_into(self, dst: torch.Tensor) -> None:
        if self.block_offset is not None:
            block = _mapped_block(self.rebuild, self.args)
            src = block[self.block_offset:self.block_offset + self.nbytes].view(
                self.torch_dtype).view(self.shape)
        else:
            src = self.rebuild(*self.args)
        with torch.cuda.device(src.device):
            dst.copy_(src)
            # the rows must be read before the producer may reuse them (only this copy's
            # stream is waited for)
            torch.cuda.current_stream(src.device).synchronize()
        del src  # frees the mapping; PyTorch decrements the producer's ref counter


_side_streams: dict[torch.device, torch.cuda.Stream] = {}
_MAPPED_BLOCKS = 256  # pool blocks a consumer keeps mapped (least recently used dropped)
_mapped: OrderedDict[tuple[bytes, int], torch.Tensor] = OrderedDict()
_mapped_lock = threading.Lock()


def _mapped_block(rebuild: Callable[..., torch.Tensor], args: tuple[Any, ...]) -> torch.Tensor:
    """A producer's pool block, mapped into this process once and kept: opening a CUDA IPC
    allocation costs about a millisecond, a slice of a mapped one nothing."""
    key = (args[7], args[9])  # the allocation's IPC handle and the block's offset in it
    with _mapped_lock:
        block = _mapped.get(key)
        if block is not None:
            _mapped.move_to_end(key)
            return block
    block = rebuild(*args)
    with _mapped_lock:
        _mapped[key] = block
        while len(_mapped) > _MAPPED_BLOCKS:
            _mapped.popitem(last=False)
    return block


def _side_stream(device: torch.device) -> torch.cuda.Stream:
    if device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    if device not in _side_streams:
        _side_streams[device] = torch.cuda.Stream(device)
    return _side_streams[device]


class CudaBacking:
    """The producer's tensor, kept alive until the handle is released or reclaimed."""

    def __init__(self, tensor: torch.Tensor, ref_counter_handle: bytes,
                 ref_counter_offset: int) -> None:
        self.tensor: torch.Tensor | None = tensor
        self.device = tensor.device
        self.ref_counter = (ref_counter_handle, ref_counter_offset)

    def free(self, *, opened: bool, consumer_alive: bool) -> None:
        """Drop the tensor and collect the IPC blocks whose consumers are done.

        PyTorch frees an exported block once its consumer count (1 per export) reaches 0; the
        consumer decrements it when its rebuilt tensor dies. A consumer that never opened the
        handle, or died after opening it, never will: the producer decrements it then (a
        live consumer that opened and is still reading keeps its block, in PyTorch's limbo
        list, until it lets go)."""
        tensor, self.tensor = self.tensor, None
        if tensor is None:
            return
        if not opened or not consumer_alive:
            handle, offset = self.ref_counter
            torch.UntypedStorage._release_ipc_counter(handle, offset, device=self.device)
        del tensor
        with torch.cuda.device(self.device):
            torch.cuda.ipc_collect()


def make_cuda(rows: torch.Tensor, handle_id: str, address: str | None, expires_at: float
              ) -> tuple[CudaIpcHandle, CudaBacking]:
    """Export ``rows`` (a CUDA tensor) as a CUDA IPC handle of a block of its own (a view into
    a batch would keep the whole batch's block alive until every image is released)."""
    from torch.multiprocessing.reductions import reduce_tensor

    assert rows.is_cuda, "CUDA IPC needs a CUDA tensor"
    own = rows.detach().clone(memory_format=torch.contiguous_format)
    rebuild, args = reduce_tensor(own)
    # (tensor_cls, size, stride, offset, storage_cls, dtype, device, handle, size_bytes,
    #  offset_bytes, requires_grad, ref_counter_handle, ref_counter_offset, event, sync)
    handle = CudaIpcHandle(handle_id, tuple(own.shape), dtype_name(own.dtype), address,
                           expires_at, rebuild=rebuild, args=tuple(args))
    return handle, CudaBacking(own, args[11], args[12])


def rebuild_cuda() -> Callable[..., torch.Tensor]:
    from torch.multiprocessing.reductions import rebuild_cuda_tensor

    return rebuild_cuda_tensor


# ---- bytes -------------------------------------------------------------------------------


@dataclass
class BytesHandle(EmbeddingHandle):
    """The rows inline as safetensors bytes (tensor ``rows``): for a consumer on another
    host. The producer holds nothing for it; the ledger still records its release."""

    data: bytes = b""

    kind = "bytes"

    def _check_declared(self) -> None:
        """The safetensors header (read alone) must hold the tensor ``rows`` of the declared
        shape and dtype, and the data its bytes."""
        data = self.data
        size = int.from_bytes(data[:8], "little") if len(data) >= 8 else -1
        try:
            if not 0 < size <= min(len(data) - 8, 1 << 20):
                raise ValueError("no header")
            header = json.loads(bytes(data[8:8 + size]))
            rows = header.get("rows") if isinstance(header, dict) else None
        except (ValueError, RecursionError) as e:
            raise HandleError(f"handle {self.handle_id}: its data is not safetensors "
                              f"({e})") from None
        if not isinstance(rows, dict):
            names = (sorted(str(k) for k in header if k != "__metadata__")[:4]
                     if isinstance(header, dict) else [])
            raise HandleError(f"handle {self.handle_id}: its safetensors hold no tensor "
                              f"'rows' (only {names})")
        offsets = rows.get("data_offsets")
        if (rows.get("shape") != list(self.shape)
                or _SAFETENSORS_DTYPES.get(rows.get("dtype")) != self.dtype
                or not isinstance(offsets, list) or len(offsets) != 2
                or not all(isinstance(x, int) for x in offsets)
                or offsets[1] - offsets[0] != self.nbytes or 8 + size + offsets[1] > len(data)):
            raise HandleError(f"handle {self.handle_id}: its data holds rows of shape "
                              f"{rows.get('shape')} {rows.get('dtype')}, its handle declares "
                              f"shape {list(self.shape)} {self.dtype}")

    def _read_into(self, dst: torch.Tensor) -> None:
        from safetensors.torch import load

        try:
            tensors = load(bytes(self.data))
        except Exception as e:  # noqa: BLE001 - safetensors' errors have no common base
            raise HandleError(f"handle {self.handle_id}: its data is not safetensors "
                              f"({type(e).__name__}: {e})") from None
        rows = tensors.get("rows")
        if rows is None:
            raise HandleError(f"handle {self.handle_id}: its safetensors hold no tensor "
                              f"'rows' (only {sorted(tensors)[:4]})")
        if tuple(rows.shape) != tuple(self.shape) or rows.dtype != self.torch_dtype:
            # never broadcast: rows of another shape are not the rows declared
            raise HandleError(f"handle {self.handle_id}: its data holds rows of shape "
                              f"{list(rows.shape)} {dtype_name(rows.dtype)}, its handle "
                              f"declares shape {list(self.shape)} {self.dtype}")
        dst.copy_(rows)


_SAFETENSORS_DTYPES = {"F32": "float32", "F16": "float16", "BF16": "bfloat16",
                       "F64": "float64"}


class BytesBacking:
    def free(self, *, opened: bool, consumer_alive: bool) -> None:
        pass


def make_bytes(rows: torch.Tensor, handle_id: str, address: str | None, expires_at: float
               ) -> tuple[BytesHandle, BytesBacking]:
    from safetensors.torch import save

    rows = rows.detach().to("cpu").clone()  # its own storage, not the batch's
    handle = BytesHandle(handle_id, tuple(rows.shape), dtype_name(rows.dtype), address,
                         expires_at, data=save({"rows": rows}))
    return handle, BytesBacking()
