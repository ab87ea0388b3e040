"""Pooled CUDA memory for embedding handles (the encoder server's CUDA IPC transport): slots
carved from blocks shared over CUDA IPC once each, so a consumer maps a block once instead of a
new allocation per handle (`CudaPool`, `make_cuda_pooled`)."""

from __future__ import annotations

import threading
from typing import Any

import torch

from vlmserve.transfer.handles import CudaIpcHandle, dtype_name, rebuild_cuda


class CudaPool:
    """The producer's pooled CUDA memory for handles: slots of a power-of-two size (64 KiB and
    up) carved from blocks of at least ``block_bytes``, each block shared over CUDA IPC once
    when it is made. A handle is a slot; releasing it returns the slot for the next one, so
    the pool grows to the most bytes ever live at once and stays there, and a consumer maps
    each block once instead of a new allocation per handle."""

    MIN_SLOT = 64 << 10

    def __init__(self, device: torch.device, block_bytes: int = 64 << 20) -> None:
        self.device, self.block_bytes = device, block_bytes
        self._blocks: list[tuple[torch.Tensor, tuple[Any, ...]]] = []
        self._free: dict[int, list[tuple[int, int]]] = {}  # slot size -> [(block, offset)]
        self._lock = threading.Lock()

    @property
    def reserved_bytes(self) -> int:
        return sum(b.numel() for b, _ in self._blocks)

    def alloc(self, nbytes: int) -> tuple[int, int, int]:
        """(block index, byte offset, slot size) of a free slot of at least ``nbytes``."""
        size = max(self.MIN_SLOT, 1 << (nbytes - 1).bit_length())
        with self._lock:
            free = self._free.setdefault(size, [])
            if not free:
                from torch.multiprocessing.reductions import reduce_tensor

                block = torch.empty(max(size, self.block_bytes), dtype=torch.uint8,
                                    device=self.device)
                _, args = reduce_tensor(block)
                self._blocks.append((block, tuple(args)))
                index = len(self._blocks) - 1
                free.extend((index, off) for off in range(block.numel() - size, -1, -size))
            index, offset = free.pop()
        return index, offset, size

    def release(self, index: int, offset: int, size: int) -> None:
        with self._lock:
            self._free[size].append((index, offset))

    def block(self, index: int) -> tuple[torch.Tensor, tuple[Any, ...]]:
        return self._blocks[index]

    def close(self) -> None:
        """Drop the blocks (PyTorch frees each once its consumers have unmapped it)."""
        with self._lock:
            self._blocks.clear()
            self._free.clear()
        with torch.cuda.device(self.device):
            torch.cuda.ipc_collect()


class PooledBacking:
    def __init__(self, pool: CudaPool, index: int, offset: int, size: int) -> None:
        self.pool, self.slot = pool, (index, offset, size)

    def free(self, *, opened: bool, consumer_alive: bool) -> None:
        slot, self.slot = self.slot, None
        if slot is not None:
            self.pool.release(*slot)


def make_cuda_pooled(rows: torch.Tensor, pool: CudaPool, handle_id: str, address: str | None,
                     expires_at: float) -> tuple[CudaIpcHandle, PooledBacking]:
    """Copy ``rows`` (a CUDA tensor) into a slot of ``pool``; the copy is complete when this
    returns (a consumer reads the slot without an event of its own)."""
    rows = rows.detach().contiguous()
    nbytes = rows.numel() * rows.element_size()
    index, offset, size = pool.alloc(nbytes)
    block, args = pool.block(index)
    block[offset:offset + nbytes].view(rows.dtype).view(rows.shape).copy_(rows)
    torch.cuda.current_stream(rows.device).synchronize()
    handle = CudaIpcHandle(handle_id, tuple(rows.shape), dtype_name(rows.dtype), address,
                           expires_at, rebuild=rebuild_cuda(), args=args, block_offset=offset)
    return handle, PooledBacking(pool, index, offset, size)
