"""One tensor-parallel group: ranks, the collectives the sharded layers need, and a CPU
(gloo) group for control messages (the scheduler's output) on any device."""

from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist


@dataclass
class TensorParallel:
    rank: int
    world_size: int
    device_group: Any  # collectives on the model's tensors (nccl on CUDA, gloo on CPU)
    cpu_group: Any  # gloo: control messages

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        dist.all_reduce(x, group=self.device_group)
        return x

    def broadcast_tensor(self, x: torch.Tensor) -> torch.Tensor:
        """Rank 0's `x` into every rank's `x` (in place, on the model's device)."""
        dist.broadcast(x, src=0, group=self.device_group)
        return x

    def min_int(self, value: int) -> int:
        t = torch.tensor([value], dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.cpu_group)
        return int(t.item())

    def broadcast_object(self, obj: Any = None) -> Any:
        """Rank 0 sends `obj`; every rank returns it."""
        box = [obj]
        dist.broadcast_object_list(box, src=0, group=self.cpu_group)
        return box[0]


class RankFailedError(RuntimeError):
    """A tensor-parallel rank died or stopped answering: the engine cannot go on (no
    request is to blame, so none is retried alone)."""

    fatal = True


def init_tensor_parallel(rank: int, world_size: int, port: int, device: torch.device,
                         timeout_s: float = 300.0) -> TensorParallel:
    """Join the group; a collective that waits `timeout_s` for a rank raises."""
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ["MASTER_PORT"] = str(port)
    backend = "nccl" if device.type == "cuda" else "gloo"
    timeout = timedelta(seconds=timeout_s)
    dist.init_process_group(backend, rank=rank, world_size=world_size, timeout=timeout)
    cpu_group = (dist.new_group(backend="gloo", timeout=timeout) if backend != "gloo"
                 else dist.group.WORLD)
    return TensorParallel(rank, world_size, dist.group.WORLD, cpu_group)
