"""The tensor-parallel runtime that the LLM's ranks and the encoder's share
(`distributed/ranks.py`, `parallel_state.py`), with a stand-in loop on 3 real ranks over
gloo: a follower that fails is reported as `RankFailedError` naming it, its exit code and
its own error; a follower idles past the timeout while rank 0's waits are bounded by it; the
store listens on 127.0.0.1 alone; the stop leaves no process."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest
import torch

from vlmserve.distributed.parallel_state import RankFailedError, TensorParallel
from vlmserve.distributed.ranks import Followers

CPU = torch.device("cpu")


def _echo(tp: TensorParallel, tag: str) -> None:
    """A follower's loop: ("echo",) all-gathers (tag, rank); ("fail", rank) makes that rank
    raise; None stops."""
    while (msg := tp.broadcast_object()) is not None:
        if msg[0] == "fail" and msg[1] == tp.rank:
            raise ValueError(f"rank {tp.rank} was told to fail")
        tp.all_gather_object((tag, tp.rank))


def _listening_addresses(port: int) -> set[str]:
    """Local addresses (hex, as /proc/net shows them) that listen on TCP ``port``."""
    out = set()
    for name in ("tcp", "tcp6"):
        path = Path("/proc/net") / name
        if not path.exists():
            continue
        for line in path.read_text().splitlines()[1:]:
            local, state = line.split()[1], line.split()[3]
            addr, _, p = local.rpartition(":")
            if state == "0A" and int(p, 16) == port:  # LISTEN
                out.add(addr)
    return out


def _listening_in(pids: list[int]) -> set[str]:
    """Local addresses (hex, as /proc/net shows them) of every TCP socket that the processes
    ``pids`` hold and that listens."""
    inodes = set()
    for pid in pids:
        fds = Path(f"/proc/{pid}/fd")
        for fd in fds.iterdir():
            try:
                link = os.readlink(fd)
            except OSError:  # closed meanwhile
                continue
            if link.startswith("socket:["):
                inodes.add(link[8:-1])
    out = set()
    for name in ("tcp", "tcp6"):
        path = Path("/proc/net") / name
        if path.exists():
            for line in path.read_text().splitlines()[1:]:
                fields = line.split()
                if fields[3] == "0A" and fields[9] in inodes:  # LISTEN
                    out.add(fields[1].rpartition(":")[0])
    return out


@pytest.fixture
def three_ranks():
    started: list[Followers] = []

    def start(timeout_s: float) -> tuple[Followers, TensorParallel]:
        followers = Followers(3, _echo, ("hi",), "cpu", timeout_s)
        started.append(followers)
        return followers, followers.connect(CPU)

    yield start
    for followers in started:
        followers.stop()
        assert not any(p.is_alive() for p in followers.procs)


def test_a_failing_follower_is_one_error_naming_it(three_ranks):
    """Rank 2 raises in its loop: rank 0's next collective raises `RankFailedError` with
    rank 2's exit code and error; every later call raises it again; the stop still ends
    rank 1. The store is on loopback only."""
    followers, tp = three_ranks(30.0)
    if Path("/proc/net/tcp").exists():
        assert _listening_addresses(followers.store.port) == {"0100007F"}  # 127.0.0.1
    tp.broadcast_object(("echo",))
    assert tp.all_gather_object(("hi", 0)) == [("hi", 0), ("hi", 1), ("hi", 2)]
    tp.broadcast_object(("fail", 2))
    with pytest.raises(RankFailedError,
                       match=r"rank 2 \(pid \d+\) exited with code 1: ValueError: rank 2 was "
                             "told to fail"):
        tp.all_gather_object(("hi", 0))
    with pytest.raises(RankFailedError, match="cannot go on .*rank 2 .*shut it down"):
        tp.check()
    followers.stop()
    assert [p.exitcode for p in followers.procs] == [0, 1]  # rank 1: its group aborted


def _outside_interface() -> str | None:
    """A network interface of this host with an IPv4 address other than loopback's."""
    import fcntl
    import socket
    import struct

    for name in sorted(os.listdir("/sys/class/net")) if os.path.isdir("/sys/class/net") else ():
        if name == "lo":
            continue
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            try:  # SIOCGIFADDR
                fcntl.ioctl(s.fileno(), 0x8915, struct.pack("256s", name.encode()[:15]))
            except OSError:  # no IPv4 address
                continue
        return name
    return None


@pytest.mark.skipif(not Path("/proc/net/tcp").exists(), reason="reads /proc/net")
def test_the_pickled_messages_travel_on_loopback_alone(three_ranks, monkeypatch):
    """The objects the ranks exchange are pickled (`broadcast_object`, `all_gather_object`),
    so only our ranks may reach their sockets: once the group has exchanged messages, every
    TCP socket the followers listen on (gloo's pairs) and the store's is bound to 127.0.0.1,
    none to a wildcard or an outside address, even with GLOO_SOCKET_IFNAME naming an outside
    interface (gloo's own choice binds that one, or the host name's address)."""
    if (iface := _outside_interface()) is not None:
        monkeypatch.setenv("GLOO_SOCKET_IFNAME", iface)  # the followers inherit it
    followers, tp = three_ranks(30.0)
    tp.broadcast_object(("echo",))
    assert tp.all_gather_object(("hi", 0)) == [("hi", 0), ("hi", 1), ("hi", 2)]
    listening = _listening_in([p.pid for p in followers.procs])
    assert listening == {"0100007F"}  # 127.0.0.1, and at least one socket
    assert _listening_addresses(followers.store.port) == {"0100007F"}


def test_followers_idle_past_the_timeout_but_rank0_waits_are_bounded(three_ranks):
    """Timeout 1 s: the followers wait for rank 0's next message 2.5 s and still answer; a
    stopped follower (SIGSTOP) makes rank 0's next collective give up, saying it waited its 1 s
    (a wait that never ended would hang here)."""
    followers, tp = three_ranks(1.0)
    time.sleep(2.5)
    tp.check()
    tp.broadcast_object(("echo",))
    assert [r for _, r in tp.all_gather_object(("hi", 0))] == [0, 1, 2]
    os.kill(followers.pids[0], signal.SIGSTOP)
    with pytest.raises(RankFailedError, match="no answer within 1 s"):
        tp.broadcast_object(("echo",))
        tp.all_gather_object(("hi", 0))
    with pytest.raises(RankFailedError):
        tp.broadcast_object(("echo",))
