"""Children that die with their parent (`die_with_parent`, PR_SET_PDEATHSIG) outlive the thread
that asked for them when started through `start_children`: the kernel's "parent" is the thread
that forked, so a child started from a pool's worker thread (Ray Serve runs a replica's
constructor on one, and retires it once idle) would be killed with that thread."""

from __future__ import annotations

import os
import subprocess
import sys
import threading

import pytest

from tests.wait import exited, wait_until
from vlmserve.process import start_core
from vlmserve.utils import die_with_parent, start_children

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"),
                                reason="PR_SET_PDEATHSIG is Linux's")

# the child says "up" once it has asked to die with its parent, then echoes each line
_ECHO = ("import sys; from vlmserve.utils import die_with_parent; die_with_parent(); "
         "print('up', flush=True); [print(line.strip(), flush=True) for line in sys.stdin]")


def _popen() -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", _ECHO], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)


def _up(proc: subprocess.Popen) -> subprocess.Popen:
    """`proc` once it has asked to die with its parent (before its starter's thread ends)."""
    assert proc.stdout.readline().strip() == "up"
    return proc


def _from_a_thread_that_ends(start) -> subprocess.Popen:
    """`start()` called on a thread that then ends, and is gone from the kernel's tasks."""
    out: list = []
    t = threading.Thread(target=lambda: out.append(start()))
    t.start()
    t.join()
    tid = t.native_id
    assert wait_until(lambda: not os.path.exists(f"/proc/self/task/{tid}"), 30)
    return out[0]


def test_a_child_started_from_a_short_thread_dies_with_it() -> None:
    """What `start_children` prevents: the kernel kills the child when its thread ends."""
    proc = _from_a_thread_that_ends(lambda: _up(_popen()))
    try:
        assert wait_until(lambda: proc.poll() is not None, 60)
        assert proc.returncode == -9
    finally:
        proc.kill()
        proc.wait()


def test_start_children_keeps_the_child_after_its_callers_thread_ends() -> None:
    proc = _from_a_thread_that_ends(lambda: _up(start_children(_popen)))
    try:
        proc.stdin.write("still here?\n")
        proc.stdin.flush()
        assert proc.stdout.readline().strip() == "still here?"
        assert proc.poll() is None
    finally:
        proc.kill()
        proc.wait()


def test_start_children_raises_what_the_start_raised() -> None:
    def fails() -> None:
        raise OSError("no such program")

    out: list = []

    def call() -> None:
        try:
            start_children(fails)
        except OSError as e:
            out.append(str(e))

    t = threading.Thread(target=call)
    t.start()
    t.join()
    assert out == ["no such program"]


def test_an_engine_core_started_from_a_short_thread_lives_on() -> None:
    """`start_core` (engine and encoder cores) starts its child through `start_children`."""
    def start() -> tuple:
        proc, handle = start_core("tests.core.test_child_processes:_idle_core", "vlmserve-core")
        # bound, so it asked to die with its parent before this thread ends
        assert wait_until(lambda: os.path.exists(handle.address.removeprefix("ipc://")), 60)
        return proc, handle

    proc, handle = _from_a_thread_that_ends(start)
    import zmq

    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    try:
        sock.connect(handle.address)
        sock.send(b"still here?")
        assert sock.poll(60_000) and sock.recv() == b"still here?"
    finally:
        sock.close(0)
        ctx.term()
        proc.kill()
        proc.join(30)
    assert exited(handle.pid)


def _idle_core(address: str, parent_pid: int) -> None:
    """A core's life without a model: it dies with its parent, binds its socket, echoes."""
    import zmq

    die_with_parent()
    sock = zmq.Context().socket(zmq.ROUTER)
    sock.bind(address)
    while True:
        sock.send_multipart(sock.recv_multipart())
