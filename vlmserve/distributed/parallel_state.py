"""One tensor-parallel group, used alike by the LLM's ranks (executor/multiproc.py) and the
encoder's (encoder/encoder.py); ranks spawned on this host are started and watched by ranks.py.

A group is its user's own (an engine and encoders may share a process): gloo for control
messages and objects, and for the model's tensors nccl on CUDA (that gloo group on the CPU),
made on a store: rank 0's for ranks it spawned, torchrun's (`env://`) for ranks on several hosts.
Every wait gives up after ``timeout`` (``--tp-timeout``), but a follower's wait for rank 0's
next message, which lasts while rank 0 lives (its death closes the connections), so an idle
engine keeps its ranks. A failed collective raises `RankFailedError` and breaks the group
(`check` raises it again); on rank 0 of spawned ranks it names the rank, its exit code and the
error it reported.

Objects (the engine config and each step's `SchedulerOutput`; an encoder call's processed
requests, stats, errors) travel pickled. Unpickling runs what its bytes name, so what matters
is who writes them: only our ranks, each pickling objects our code built; what a client sent
(token ids, pixels, sampling parameters; an encoder request's prompt text and claimed
`mm_hash`, which are `str` fields) is data inside them, never bytes unpickled as they came.
And only our ranks reach the connections: spawned on one host, the store listens on
127.0.0.1 alone (a socket we bind and hand it) and gloo binds 127.0.0.1 whatever
GLOO_SOCKET_IFNAME says (tests/distributed/test_ranks.py checks every socket the ranks
listen on); under torchrun the
store is torchrun's (MASTER_ADDR) and gloo binds GLOO_SOCKET_IFNAME's interface or the host
name's address, a network to trust as for any torch.distributed job. (msgspec would need wire
types for a `SchedulerOutput`'s sampling parameters, image transforms and tensors.)
"""

from __future__ import annotations

import os
import pickle
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import AllgatherOptions  # torch.distributed lacks the name

_FOREVER = timedelta(days=365)  # a follower's wait for rank 0's next message


class RankFailedError(RuntimeError):
    """A tensor-parallel rank died, stopped answering or failed: the group cannot go on (no
    request is to blame, so none is retried alone)."""

    fatal = True


@dataclass
class TensorParallel:
    rank: int
    world_size: int
    local_rank: int  # this host's GPU index (cuda:local_rank)
    cpu_group: Any  # gloo: control messages and objects
    device_group: Any  # the model's tensors: nccl on CUDA, the gloo group on the CPU
    timeout: timedelta  # every wait's bound, but a follower's for rank 0's next message
    start_timeout: timedelta  # `barrier`'s bound (ranks may still be loading)
    # the ranks on this rank's host: their device group (None when this rank is alone on its
    # host) and the lowest of them, the host's leader (see `broadcast_in_host`)
    host_group: Any = None
    host_leader: int = 0
    followers: Any = None  # rank 0 of ranks spawned here: their processes (ranks.Followers)
    broken: str | None = None  # why the group cannot go on

    @property
    def is_host_leader(self) -> bool:
        return self.rank == self.host_leader

    # ---- failures --------------------------------------------------------------------------

    def _opts(self, cls: type, timeout: timedelta | None = None, **fields: Any) -> Any:
        """A collective's options: blocking (as torch's own functions make them) and bounded
        by ``timeout`` (default: the group's; the groups' own bound only their forming)."""
        opts = cls()
        if hasattr(opts, "asyncOp"):
            opts.asyncOp = False
        opts.timeout = timeout or self.timeout
        for name, value in fields.items():
            setattr(opts, name, value)
        return opts

    def _wait(self, work: Any, timeout: timedelta | None = None) -> None:
        try:
            work.wait() if timeout is None else work.wait(timeout)
        except RuntimeError as e:  # a rank gone (connection closed) or the timeout
            raise self._failed(e) from e

    def _failed(self, e: Exception) -> RankFailedError:
        dead = self.followers.dead(wait_s=0.5) if self.followers is not None else []
        text = str(e)
        timed_out = "timed out" in text.lower() or "timeout" in text.lower()
        # this rank's own timeout first (whoever noticed a stopped rank first), then the ranks
        # found gone (one that gave up says why)
        waited = [f"no answer within {self.timeout.total_seconds():g} s"] if timed_out else []
        self.broken = "; ".join(waited + dead) or "a collective failed"
        return RankFailedError(f"a tensor-parallel rank failed ({self.broken}): {text[:300]}")

    def check(self) -> None:
        """Raise `RankFailedError` if the group is broken or a spawned rank has exited."""
        if self.broken is None and self.followers is not None and (
                dead := self.followers.dead()):
            self.broken = "; ".join(dead)
        if self.broken is not None:
            raise RankFailedError(f"the tensor-parallel group cannot go on ({self.broken}); "
                                  "shut it down and start a new one")

    # ---- tensors ---------------------------------------------------------------------------

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        self._wait(self.device_group.allreduce([x], self._opts(dist.AllreduceOptions)))
        return x

    def all_gather(self, parts: list[torch.Tensor], x: torch.Tensor) -> list[torch.Tensor]:
        """Every rank's `x` into `parts` (rank order)."""
        self._wait(self.device_group.allgather([parts], [x], self._opts(AllgatherOptions)))
        return parts

    def broadcast_tensor(self, x: torch.Tensor) -> torch.Tensor:
        """Rank 0's `x` into every rank's `x` (in place, on the model's device)."""
        self._wait(self.device_group.broadcast([x], self._opts(dist.BroadcastOptions)))
        return x

    def broadcast_in_host(self, x: torch.Tensor) -> torch.Tensor:
        """The host leader's `x` into `x` of every rank on its host (in place)."""
        if self.host_group is not None:  # the leader is the host group's first rank
            self._wait(self.host_group.broadcast([x], self._opts(dist.BroadcastOptions)))
        return x

    def min_int(self, value: int, timeout: timedelta | None = None) -> int:
        t = torch.tensor([value], dtype=torch.int64)
        self._wait(self.cpu_group.allreduce(
            [t], self._opts(dist.AllreduceOptions, timeout, reduceOp=dist.ReduceOp.MIN)))
        return int(t.item())

    def all_true(self, flag: bool) -> bool:
        """Whether ``flag`` holds on every rank."""
        return bool(self.min_int(int(flag)))

    def barrier(self) -> None:
        """Every rank got here; waits up to the start timeout (a rank may still be loading)."""
        self.min_int(1, self.start_timeout)

    def gather_rows(self, lengths: list[int], shares: list[list[int]],
                    own: torch.Tensor) -> list[torch.Tensor]:
        """Rows of every image (``lengths[i]`` rows each) on every rank, from each rank's
        ``own`` rows (its share's images, in share order; see `split_by_rows`): one
        all-gather of a buffer padded to the largest share."""
        counts = [sum(lengths[i] for i in share) for share in shares]
        n = max(counts)
        assert own.shape[0] == counts[self.rank], (own.shape, counts)
        buf = own
        if own.shape[0] < n:
            buf = own.new_zeros((n, own.shape[1]))
            buf[:own.shape[0]] = own
        outs = self.all_gather([torch.empty_like(buf) for _ in range(self.world_size)],
                               buf.contiguous())
        rows: list[torch.Tensor | None] = [None] * len(lengths)
        for r, share in enumerate(shares):
            for i, part in zip(share, outs[r][:counts[r]].split([lengths[i] for i in share]),
                               strict=True):
                rows[i] = part
        return rows  # type: ignore[return-value]

    def scatter_from_first(self, parts: list[list[torch.Tensor]]) -> list[torch.Tensor]:
        """Rank 0's host tensors ``parts[r]`` to rank r, point to point on the CPU group, in
        one order on both sides; returns this rank's (rank 0: ``parts[0]`` as given). Every
        rank passes the same shapes and dtypes; elsewhere than on rank 0 ``parts`` need hold
        no data (meta tensors), and what this rank receives is allocated here."""
        if self.rank == 0:
            for r in range(1, self.world_size):
                for t in parts[r]:
                    self._wait(self.cpu_group.send([t.contiguous()], r, 0), self.timeout)
            return parts[0]
        out = [torch.empty(t.shape, dtype=t.dtype) for t in parts[self.rank]]
        for t in out:
            self._wait(self.cpu_group.recv([t], 0, 0), self.timeout)
        return out

    # ---- objects (pickled: see the module's docstring) -------------------------------------

    def broadcast_object(self, obj: Any = None) -> Any:
        """Rank 0 sends `obj`; every rank returns it. Elsewhere than on rank 0 this is the
        wait for rank 0's next message: it lasts as long as rank 0 lives."""
        if self.rank == 0:
            data = _to_tensor(obj)
            size = torch.tensor([data.numel()], dtype=torch.int64)
        else:
            size = torch.zeros(1, dtype=torch.int64)
        self._wait(self.cpu_group.broadcast(
            [size], self._opts(dist.BroadcastOptions, None if self.rank == 0 else _FOREVER)))
        if self.rank != 0:
            data = torch.empty(int(size.item()), dtype=torch.uint8)
        self._wait(self.cpu_group.broadcast([data], self._opts(dist.BroadcastOptions)))
        return obj if self.rank == 0 else pickle.loads(memoryview(data.numpy()))

    def all_gather_object(self, obj: Any) -> list[Any]:
        """Every rank's `obj`, index = rank, on every rank."""
        data = _to_tensor(obj)
        sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(self.world_size)]
        self._wait(self.cpu_group.allgather([sizes], [torch.tensor([data.numel()])],
                                            self._opts(AllgatherOptions)))
        n = max(int(s.item()) for s in sizes)
        buf = torch.zeros(n, dtype=torch.uint8)
        buf[:data.numel()] = data
        outs = [torch.empty(n, dtype=torch.uint8) for _ in range(self.world_size)]
        self._wait(self.cpu_group.allgather([outs], [buf], self._opts(AllgatherOptions)))
        return [pickle.loads(memoryview(o[:int(s.item())].numpy()))
                for o, s in zip(outs, sizes, strict=True)]

    # ---- the end ---------------------------------------------------------------------------

    def shutdown(self, abort: bool = False) -> bool:
        """Close the group; rank 0 first tells the other ranks to stop (None, which ends
        their loops) unless the group is broken or ``abort`` (rank 0 gives up amid a
        protocol): then it is aborted (a rank waiting in a collective fails out). Whether the
        stop was sent."""
        if self.cpu_group is None:
            return False
        if abort and self.broken is None:
            self.broken = "rank 0 gave up"
        if self.rank == 0 and self.broken is None:
            try:
                self.broadcast_object(None)
            except RankFailedError:  # a rank went meanwhile
                pass
        sent = self.broken is None
        self.close(abort=not sent)
        return sent

    def close(self, abort: bool = False) -> None:
        groups = {id(g): g for g in (self.host_group, self.device_group, self.cpu_group)
                  if g is not None}
        for group in groups.values():
            try:
                group.abort() if abort else group.shutdown()
            except Exception:  # noqa: BLE001 - a broken group may refuse; it is dropped anyway
                pass
        self.cpu_group = self.device_group = self.host_group = None
        self.broken = self.broken or "the group was shut down"


def _to_tensor(obj: Any) -> torch.Tensor:
    return torch.frombuffer(bytearray(pickle.dumps(obj, protocol=5)), dtype=torch.uint8)


def split_by_rows(lengths: list[int], world: int) -> list[list[int]]:
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


# ---- joining a group -------------------------------------------------------------------------


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
    """Join the group at `init_method`: `env://` (torchrun's MASTER_ADDR and MASTER_PORT) or
    `tcp://host:port` (rank 0 hosts the store there)."""
    start = timedelta(seconds=max(timeout_s, 300.0))
    store, _, _ = next(dist.rendezvous(init_method, rank, world_size, timeout=start))
    return join_group(rank, world_size, store, device, timeout_s, local_rank=local_rank)


def join_group(rank: int, world_size: int, store: Any, device: torch.device,
               timeout_s: float, start_timeout_s: float = 300.0, local_rank: int | None = None,
               loopback: bool = False) -> TensorParallel:
    """This rank's group on `store`; every rank calls it, and it returns once all have joined.
    `loopback`: every rank is on this host, and gloo binds 127.0.0.1. Each rank waits up to the
    start timeout for the others to join; their collectives then wait up to `timeout_s`."""
    timeout = timedelta(seconds=timeout_s)
    start = timedelta(seconds=max(start_timeout_s, timeout_s))  # the ranks may start apart
    store = dist.PrefixStore("vlmserve-tp/", store)
    cpu = _gloo(dist.PrefixStore("cpu", store), rank, world_size, start, loopback)
    dev = cpu if device.type != "cuda" else _device_group(
        dist.PrefixStore("dev", store), rank, world_size, device, timeout, start, loopback)
    tp = TensorParallel(rank, world_size, rank if local_rank is None else local_rank, cpu, dev,
                        timeout, start)
    # this rank's host: a torchrun node (`GROUP_RANK`); ranks spawned here share rank 0's
    nodes = tp.all_gather_object(int(os.environ.get("GROUP_RANK", 0)))
    members = [r for r, node in enumerate(nodes) if node == nodes[rank]]
    tp.host_leader = members[0]
    if len(members) == world_size:
        tp.host_group = dev
    elif len(members) > 1:
        tp.host_group = _device_group(dist.PrefixStore(f"host{nodes[rank]}", store),
                                      members.index(rank), len(members), device, timeout,
                                      start, loopback)
    return tp


def _gloo(store: Any, rank: int, size: int, timeout: timedelta, loopback: bool) -> Any:
    """A gloo group whose forming waits up to `timeout` (its collectives pass their own)."""
    if not loopback:  # GLOO_SOCKET_IFNAME's interface, else the host name's address
        return dist.ProcessGroupGloo(store, rank, size, timeout)
    opts = dist.ProcessGroupGloo._Options()
    opts._devices = [dist.ProcessGroupGloo.create_device(hostname="127.0.0.1")]
    opts._timeout = timeout
    return dist.ProcessGroupGloo(store, rank, size, opts)


def _device_group(store: Any, rank: int, size: int, device: torch.device, timeout: timedelta,
                  start: timedelta, loopback: bool) -> Any:
    """nccl on CUDA (its communicator forms at the first collective, the ranks already met),
    else gloo (formed now: its ranks wait up to `start` for each other)."""
    if device.type != "cuda":
        return _gloo(store, rank, size, start, loopback)
    torch.cuda.set_device(device)
    opts = dist.ProcessGroupNCCL.Options()
    opts._timeout = timeout
    return dist.ProcessGroupNCCL(store, rank, size, opts)
