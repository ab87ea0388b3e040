"""Tensor-parallel ranks of `MultimodalEncoder`: rank 0 in the caller's process, ranks 1..N-1
spawned here (multiprocessing "spawn"), on a process group of the encoder's own (not
torch.distributed's default one, so an engine or a second encoder in the same process keeps
theirs).

Each `encode` call: rank 0 preprocesses and broadcasts the processed requests (one object
broadcast on the gloo group); every rank takes its share of the call's distinct images
(`split_by_rows`: largest first, each to the rank with the fewest rows so far), runs it
through its tower, and the rows are all-gathered (a buffer padded to the largest share, gloo
on the CPU, nccl on CUDA) so that every rank holds every image's rows, as TensorRT-LLM's
encoder ranks each held full results. Only rank 0's outputs reach the caller, so only rank 0
exports handles; a follower exports only with ``export_only_delivered=False`` (the negative
control: its handles sit in its own ledger, unopened, until their lease).

Rank 0 bounds every wait on the followers (``tp_timeout_s``) and checks that they live before
each call; a follower that died or stopped answering makes the call raise `EncoderRankError`
and every later call raise it again (the group is broken; `shutdown` still cleans up).
"""

from __future__ import annotations

import contextlib
import datetime
import multiprocessing as mp
import os
import pickle
import signal
import sys
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from vlmserve.distributed.parallel_state import gather_rows

_FOLLOWER_TIMEOUT = datetime.timedelta(days=365)  # a follower waits for rank 0 as long as it
# lives (rank 0 gone closes the connections, which ends the wait at once)


class EncoderRankError(RuntimeError):
    """A tensor-parallel rank of the encoder died, stopped answering or failed a call."""


@dataclass
class EncoderGroup:
    """The encoder's ranks: a gloo group for objects and flags, a device group for rows (the
    same gloo group on the CPU, nccl on CUDA). ``timeout`` bounds rank 0's waits (None on a
    follower: the group's own, long, timeout). A collective that fails raises
    `EncoderRankError`: the group is broken from then on."""

    rank: int
    world_size: int
    cpu: Any  # ProcessGroupGloo
    device: Any  # ProcessGroupGloo or ProcessGroupNCCL
    store: Any  # the TCPStore (rank 0 hosts it)
    timeout: datetime.timedelta | None = None

    def _wait(self, work) -> None:
        try:
            work.wait()
        except RuntimeError as e:  # a rank gone (connection closed) or the timeout
            raise EncoderRankError(str(e)) from e

    def _kw(self) -> dict:
        return {} if self.timeout is None else {"timeout": self.timeout}

    def broadcast_object(self, obj: Any = None) -> Any:
        """Rank 0 sends ``obj`` (pickled: its size, then its bytes); every rank returns it."""
        if self.rank == 0:
            data = torch.frombuffer(bytearray(pickle.dumps(obj, protocol=5)), dtype=torch.uint8)
            size = torch.tensor([data.numel()], dtype=torch.int64)
        else:
            size = torch.zeros(1, dtype=torch.int64)
        self._wait(self.cpu.broadcast(size, 0, **self._kw()))
        if self.rank != 0:
            data = torch.empty(int(size.item()), dtype=torch.uint8)
        self._wait(self.cpu.broadcast(data, 0, **self._kw()))
        return obj if self.rank == 0 else pickle.loads(data.numpy().tobytes())

    def all_gather_objects(self, obj: Any) -> list[Any]:
        """Every rank's ``obj``, index = rank, on every rank."""
        data = torch.frombuffer(bytearray(pickle.dumps(obj, protocol=5)), dtype=torch.uint8)
        sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(self.world_size)]
        self._wait(self.cpu.allgather(sizes, torch.tensor([data.numel()]), **self._kw()))
        n = max(int(s.item()) for s in sizes)
        buf = torch.zeros(n, dtype=torch.uint8)
        buf[:data.numel()] = data
        outs = [torch.empty(n, dtype=torch.uint8) for _ in range(self.world_size)]
        self._wait(self.cpu.allgather(outs, buf, **self._kw()))
        return [pickle.loads(o[:int(s.item())].numpy().tobytes())
                for o, s in zip(outs, sizes, strict=True)]

    def all_true(self, flag: bool) -> bool:
        """Whether ``flag`` holds on every rank."""
        t = torch.tensor([int(flag)], dtype=torch.int64)
        self._wait(self.cpu.allreduce(t, dist.ReduceOp.MIN, **self._kw()))
        return bool(t.item())

    def gather_rows(self, lengths: Sequence[int], shares: list[list[int]],
                    own: torch.Tensor) -> list[torch.Tensor]:
        """Every image's rows on every rank, from each rank's ``own`` (`gather_rows`)."""
        return gather_rows(
            lambda outs, buf: self._wait(self.device.allgather(outs, buf, **self._kw())),
            self.rank, self.world_size, lengths, shares, own)

    def close(self, abort: bool = False) -> None:
        """Drop the group (``abort``: a broken one; its pending collectives fail)."""
        if self.cpu is None:
            return
        for pg in {id(self.device): self.device, id(self.cpu): self.cpu}.values():
            try:
                pg.abort() if abort else pg.shutdown()
            except Exception:  # noqa: BLE001 - a broken group may refuse; it is dropped anyway
                pass
        self.cpu = self.device = self.store = None


def make_group(rank: int, world: int, store, device: torch.device,
               timeout: datetime.timedelta | None) -> EncoderGroup:
    """This rank's `EncoderGroup` on ``store``; returns once every rank has joined."""
    pg_timeout = timeout or _FOLLOWER_TIMEOUT
    cpu = dist.ProcessGroupGloo(dist.PrefixStore("cpu", store), rank, world, pg_timeout)
    dev = cpu
    if device.type == "cuda":
        torch.cuda.set_device(device)
        opts = dist.ProcessGroupNCCL.Options()
        opts._timeout = pg_timeout
        dev = dist.ProcessGroupNCCL(dist.PrefixStore("dev", store), rank, world, opts)
    return EncoderGroup(rank, world, cpu, dev, store, timeout)


# ---- followers -----------------------------------------------------------------------------


def follower_main(rank: int, world: int, port: int, model: str, options: dict) -> None:
    """A follower rank: builds its encoder, reports ready (or why not) in the store, joins
    the group, then serves rank 0's broadcasts until ``None`` (stop) or until the group
    breaks; its ledger is closed on the way out (shared-memory segments unlinked)."""
    from vlmserve.config import EngineConfig
    from vlmserve.encoder.encoder import MultimodalEncoder
    from vlmserve.utils import resolve_device

    store = dist.TCPStore("127.0.0.1", port, world, False, timeout=_FOLLOWER_TIMEOUT)
    try:
        config = EngineConfig.from_kwargs(model=model, **options["engine"])
        device = resolve_device(config.model_config.device, rank)
        group = EncoderGroup(rank, world, None, None, store)  # joined below, once loaded
        enc = MultimodalEncoder(model, rank=rank, _group=group, **options["encoder"],
                                **options["engine"])
    except Exception as e:  # noqa: BLE001 - reported to rank 0
        store.set(f"ready/{rank}", f"{type(e).__name__}: {e}")
        raise
    try:
        store.set(f"ready/{rank}", "")
        joined = make_group(rank, world, store, device, None)
        group.cpu, group.device = joined.cpu, joined.device
        serve(enc, group)
    except EncoderRankError:
        pass  # rank 0 is gone or gave up on the group
    finally:
        enc.ledger.close()
        group.close()


def serve(enc, group: EncoderGroup) -> None:
    """A follower's loop: ``("encode", processed, transport)`` runs the call's share and
    builds this rank's outputs (dropped: they reach nobody); ``("stats",)`` all-gathers the
    stats; ``None`` stops."""
    while (msg := group.broadcast_object()) is not None:
        if msg[0] == "encode":
            try:
                enc._encode_processed(msg[1], msg[2], export=None)
            except EncoderRankError:
                raise
            except Exception:  # noqa: BLE001 - failed here alone (the ranks agreed on it,
                traceback.print_exc(file=sys.stderr)  # or an export): still in step
        elif msg[0] == "stats":
            group.all_gather_objects(enc._own_stats())


class Followers:
    """Rank 0's view of ranks 1..N-1: their processes and the group.

    The constructor spawns them (before rank 0 loads its own tower, so the loads overlap);
    `connect` waits until every follower has built its encoder, then joins the group."""

    def __init__(self, world: int, model: str, options: dict, device: torch.device,
                 timeout_s: float, start_timeout_s: float = 300.0) -> None:
        self.world_size = world
        self.device = device
        self.timeout = datetime.timedelta(seconds=timeout_s)
        self.start_timeout_s = max(start_timeout_s, timeout_s)
        self.store = dist.TCPStore("127.0.0.1", 0, world, True, timeout=self.timeout,
                                   wait_for_workers=False)
        ctx = mp.get_context("spawn")
        self.procs = [ctx.Process(target=follower_main, daemon=True,
                                  name=f"vlmserve-encoder-tp{rank}",
                                  args=(rank, world, self.store.port, model, options))
                      for rank in range(1, world)]
        for p in self.procs:
            p.start()
        self.group: EncoderGroup | None = None
        self.broken: str | None = None
        self._closed = False

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.procs]

    def connect(self) -> EncoderGroup:
        """Wait until every follower has built its encoder (at most ``start_timeout_s``; one
        that fails or dies is reported at once), then join the group."""
        keys = [f"ready/{r}" for r in range(1, self.world_size)]
        deadline = time.monotonic() + self.start_timeout_s
        while not self.store.check(keys):
            self.check()
            if time.monotonic() > deadline:
                self.broken = f"not ready within {self.start_timeout_s:g} s"
                self.check()
            time.sleep(0.02)
        failed = [(r, e) for r, k in enumerate(keys, start=1)
                  if (e := self.store.get(k).decode())]
        if failed:
            self.broken = "; ".join(f"rank {r}: {e}" for r, e in failed)
            raise EncoderRankError(f"encoder rank(s) failed to start: {self.broken}")
        self.group = make_group(0, self.world_size, self.store, self.device, self.timeout)
        return self.group

    def _dead(self) -> list[str]:
        return [f"rank {r} (pid {p.pid}) exited with code {p.exitcode}"
                for r, p in enumerate(self.procs, start=1) if not p.is_alive()]

    def check(self) -> None:
        """Raise `EncoderRankError` if the group is broken or a follower is gone."""
        if self._closed:
            raise EncoderRankError("the encoder was shut down")
        if self.broken is None and (dead := self._dead()):
            self.broken = "; ".join(dead)
        if self.broken is not None:
            raise EncoderRankError(f"a tensor-parallel encoder rank failed ({self.broken}); "
                                   "shut this encoder down and start a new one")

    def run(self, fn: Callable[[], Any]) -> Any:
        """``fn()`` (collectives with the followers), after checking that they live; a
        collective error (a follower died: connection closed; or the timeout) breaks the
        group and raises `EncoderRankError` saying which rank."""
        self.check()
        try:
            return fn()
        except EncoderRankError as e:
            for p in self.procs:  # a dying follower's exit code, if it is on its way out
                p.join(0.5 if p.is_alive() else 0)
            dead = self._dead()
            timed_out = "Timed out" in str(e) or "timeout" in str(e).lower()
            why = "; ".join(dead) if dead else (
                f"no answer within tp_timeout_s={self.timeout.total_seconds():g}"
                if timed_out else "collective failed")
            self.broken = why
            raise EncoderRankError(f"a tensor-parallel encoder rank failed during the call "
                                   f"({why}): {str(e)[:300]}") from e

    def stop(self, join_s: float = 30.0) -> None:
        """Stop the followers: ``None`` broadcast (each closes its ledger and exits); with a
        broken group, the group aborted first (a follower waiting in a collective then fails
        out of it and exits the same way); any follower still there after ``join_s`` (2 s if
        broken) is terminated, then killed."""
        if self._closed:
            return
        self._closed = True
        if self.broken is None and self.group is not None:
            try:
                self.group.broadcast_object(None)
            except RuntimeError:
                self.broken = "stop not delivered"
        if self.broken is not None and self.group is not None:
            self.group.close(abort=True)
        for p in self.procs:
            p.join(join_s if self.broken is None else 2.0)
        for p in self.procs:
            if p.is_alive():
                p.terminate()
                with contextlib.suppress(OSError):  # a stopped process takes it once resumed
                    os.kill(p.pid, signal.SIGCONT)
                p.join(2)
            if p.is_alive():
                p.kill()
                p.join(5)
        if self.group is not None:
            self.group.close()
        self.group = None
        self.store = None
