"""One tensor-parallel group: ranks, the collectives the sharded layers need, and a CPU
(gloo) group for control messages (the scheduler's output) on any device."""

from __future__ import annotations

import os
from dataclasses import dataclass
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

    def min_int(self, value: int) -> int:
        t = torch.tensor([value], dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.cpu_group)
        return int(t.item())

    def broadcast_object(self, obj: Any = None) -> Any:
        """Rank 0 sends `obj`; every rank returns it."""
        box = [obj]
        dist.broadcast_object_list(box, src=0, group=self.cpu_group)
        return box[0]


def init_tensor_parallel(rank: int, world_size: int, port: int, device: torch.device
                         ) -> TensorParallel:
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ["MASTER_PORT"] = str(port)
    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(backend, rank=rank, world_size=world_size)
    cpu_group = dist.new_group(backend="gloo") if backend != "gloo" else dist.group.WORLD
    return TensorParallel(rank, world_size, dist.group.WORLD, cpu_group)
