"""One tensor-parallel group: ranks, the collectives the sharded layers need, and a CPU
(gloo) group for control messages (the scheduler's output) on any device."""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist


@dataclass
class TensorParallel:
    rank: int
    world_size: int
    local_rank: int  # this host's GPU index (cuda:local_rank)
    device_group: Any  # collectives on the model's tensors (nccl on CUDA, gloo on CPU)
    cpu_group: Any  # gloo: control messages
    # the ranks on this rank's host: their device group (None when this rank is alone on its
    # host) and the lowest of them, the host's leader (see `broadcast_in_host`)
    host_group: Any = None
    host_leader: int = 0

    @property
    def is_host_leader(self) -> bool:
        return self.rank == self.host_leader

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        dist.all_reduce(x, group=self.device_group)
        return x

    def all_gather(self, parts: list[torch.Tensor], x: torch.Tensor) -> list[torch.Tensor]:
        """Every rank's `x` into `parts` (rank order)."""
        dist.all_gather(parts, x, group=self.device_group)
        return parts

    def broadcast_tensor(self, x: torch.Tensor) -> torch.Tensor:
        """Rank 0's `x` into every rank's `x` (in place, on the model's device)."""
        dist.broadcast(x, src=0, group=self.device_group)
        return x

    def broadcast_in_host(self, x: torch.Tensor) -> torch.Tensor:
        """The host leader's `x` into `x` of every rank on its host (in place)."""
        if self.host_group is not None:
            dist.broadcast(x, src=self.host_leader, group=self.host_group)
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

    def gather_object(self, obj: Any) -> list[Any] | None:
        """Every rank's `obj`, in rank order, on rank 0 (None elsewhere)."""
        out = [None] * self.world_size if self.rank == 0 else None
        dist.gather_object(obj, out, dst=0, group=self.cpu_group)
        return out


    def gather_rows(self, lengths: Sequence[int], shares: list[list[int]],
                    own: torch.Tensor) -> list[torch.Tensor]:
        """Every image's rows on every rank, from each rank's `own` (see `gather_rows`)."""
        return gather_rows(self.all_gather, self.rank, self.world_size, lengths, shares, own)

    def scatter_from_first(self, parts: list[list[torch.Tensor]]) -> list[torch.Tensor]:
        """Rank 0's host tensors ``parts[r]`` to rank r, point to point on the CPU group, in
        one order on both sides; returns this rank's (rank 0: ``parts[0]`` as given). Every
        rank passes the same shapes and dtypes; elsewhere than on rank 0 ``parts`` need hold
        no data (meta tensors), and what this rank receives is allocated here."""
        if self.rank == 0:
            for r in range(1, self.world_size):
                for t in parts[r]:
                    dist.send(t.contiguous(), dst=r, group=self.cpu_group)
            return parts[0]
        out = [torch.empty(t.shape, dtype=t.dtype) for t in parts[self.rank]]
        for t in out:
            dist.recv(t, src=0, group=self.cpu_group)
        return out


def split_by_rows(lengths: Sequence[int], world: int) -> list[list[int]]:
    """Indices of each rank's share of images whose row counts are ``lengths`` (given largest
    first): each image goes to the rank with the fewest rows so far, the lowest such rank on a
    tie. Deterministic, so every rank computes the same split; each share keeps the given
    order (equal sizes stay together for the tower's batches)."""
    loads = [0] * world
    shares: list[list[int]] = [[] for _ in range(world)]
    for i, n in enumerate(lengths):
        r = min(range(world), key=lambda k: (loads[k], k))
        shares[r].append(i)
        loads[r] += n
    return shares


def gather_rows(all_gather: Callable[[list[torch.Tensor], torch.Tensor], Any], rank: int,
                world: int, lengths: Sequence[int], shares: list[list[int]],
                own: torch.Tensor) -> list[torch.Tensor]:
    """Rows of every image (``lengths[i]`` rows each) on every rank, from each rank's ``own``
    rows (its share's images, in share order): one `all_gather(outs, buf)` of a buffer
    padded to the largest share."""
    counts = [sum(lengths[i] for i in share) for share in shares]
    n = max(counts)
    assert own.shape[0] == counts[rank], (own.shape, counts)
    buf = own
    if own.shape[0] < n:
        buf = own.new_zeros((n, own.shape[1]))
        buf[:own.shape[0]] = own
    outs = [torch.empty_like(buf) for _ in range(world)]
    all_gather(outs, buf.contiguous())
    rows: list[torch.Tensor | None] = [None] * len(lengths)
    for r, share in enumerate(shares):
        for i, part in zip(share, outs[r][:counts[r]].split([lengths[i] for i in share]),
                           strict=True):
            rows[i] = part
    return rows  # type: ignore[return-value]


class RankFailedError(RuntimeError):
    """A tensor-parallel rank died or stopped answering: the engine cannot go on (no
    request is to blame, so none is retried alone)."""

    fatal = True


@dataclass(frozen=True)
class TorchrunEnv:
    """This process's place in a group that torchrun started (on one host or several)."""

    rank: int
    world_size: int
    local_rank: int


_TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


def torchrun_env() -> TorchrunEnv | None:
    """The torchrun variables of this process (and of the processes it spawns, which inherit
    them), when it is one of more than one rank; None otherwise."""
    if not all(v in os.environ for v in _TORCHRUN_VARS) or int(os.environ["WORLD_SIZE"]) < 2:
        return None
    return TorchrunEnv(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]),
                       int(os.environ["LOCAL_RANK"]))


def init_tensor_parallel(rank: int, world_size: int, init_method: str, device: torch.device,
                         timeout_s: float = 300.0, local_rank: int | None = None
                         ) -> TensorParallel:
    """Join the group at `init_method` (`tcp://host:port`, or `env://`: MASTER_ADDR and
    MASTER_PORT, as torchrun sets them); a collective that waits `timeout_s` for a rank
    raises."""
    backend = "nccl" if device.type == "cuda" else "gloo"
    if device.type == "cuda":
        torch.cuda.set_device(device)
    timeout = timedelta(seconds=timeout_s)
    dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=world_size,
                            timeout=timeout)
    cpu_group = (dist.new_group(backend="gloo", timeout=timeout) if backend != "gloo"
                 else dist.group.WORLD)
    tp = TensorParallel(rank, world_size, rank if local_rank is None else local_rank,
                        dist.group.WORLD, cpu_group)
    tp.host_group, tp.host_leader = _host_group(rank, world_size, cpu_group, timeout)
    return tp


def _host_group(rank: int, world_size: int, cpu_group: Any, timeout: timedelta
                ) -> tuple[Any, int]:
    """This rank's host group (None if it is alone on its host) and host leader. A host is a
    torchrun node (`GROUP_RANK`); ranks spawned by the engine share rank 0's host. Every rank
    creates every group, in the same order, as `new_group` requires."""
    nodes: list[Any] = [None] * world_size
    dist.all_gather_object(nodes, int(os.environ.get("GROUP_RANK", 0)), group=cpu_group)
    mine: tuple[Any, int] = (None, rank)
    for node in sorted(set(nodes)):
        members = [r for r, n in enumerate(nodes) if n == node]
        if len(members) == world_size:
            group = dist.group.WORLD
        else:
            group = dist.new_group(members, timeout=timeout) if len(members) > 1 else None
        if rank in members:
            mine = (group, members[0])
    return mine
