"""The grammar compile processes (layers/grammar_compile.py drives them): a zygote that imports
xgrammar and reads the tokenizer once (a fresh interpreter: no module of the engine core's
loaded, nothing inherited but the environment), and compile processes forked from it in
milliseconds, each compiling one grammar spec at a time and answering its serialized
compiled grammar. The engine core talks to each over a socket of its own (msgpack, no
pickle: a compile process runs clients' grammars), reads its memory from /proc and kills it
when its compile must end."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from multiprocessing.connection import Connection
from typing import Any

from vlmserve.layers.grammar import _grammar, _xgrammar
from vlmserve.utils import pid_alive, start_children

START_TIMEOUT_S = 300.0  # the zygote's start (it imports xgrammar, which loads torch)

Spec = tuple[str, str, bool]  # StructuredOutputsParams.spec: (kind, text, any whitespace)


def compile_spec(compiler: Any, spec: Spec) -> str:
    """In a compile process: ``spec``'s grammar compiled, serialized."""
    return compiler.compile_grammar(_grammar(_xgrammar(), spec)).serialize_json()


def _zygote_main(fd: int, parent: int) -> None:
    """The compile processes' parent: imports xgrammar and reads the tokenizer (its first
    message) once, then forks a compile process for each connection the engine core sends
    it (a fork takes milliseconds; a fresh interpreter seconds), answering its pid."""
    from multiprocessing.reduction import recv_handle

    import msgspec

    from vlmserve.utils import die_with_parent

    die_with_parent()
    if os.getppid() != parent:  # it died before we asked to die with it
        return
    conn = Connection(fd)
    setup = msgspec.msgpack.decode(conn.recv_bytes())
    xgr = _xgrammar()
    info = xgr.TokenizerInfo.deserialize_json(setup["tokenizer_info"])
    conn.send_bytes(b"ready")
    while True:
        ready = conn.poll(1.0)
        while True:  # reap the compile processes that ended
            try:
                if os.waitpid(-1, os.WNOHANG)[0] == 0:
                    break
            except ChildProcessError:
                break
        if not ready:
            continue
        try:
            conn.recv_bytes()
            child_fd = recv_handle(conn)
        except (EOFError, OSError):
            return
        pid = os.fork()
        if pid == 0:
            try:
                conn.close()
                _compile_loop(Connection(child_fd), xgr, info, setup)
            finally:
                os._exit(0)
        os.close(child_fd)
        conn.send_bytes(msgspec.msgpack.encode(pid))


def _compile_loop(conn: Connection, xgr: Any, info: Any, setup: dict) -> None:
    """A compile process: one grammar spec (msgpack [kind, text, any whitespace]) after
    another, each answered [True, the compiled grammar's JSON] or [False, why]."""
    import msgspec

    from vlmserve.utils import die_with_parent

    die_with_parent()  # with the zygote, which dies with the engine core
    compiler = xgr.GrammarCompiler(info, max_threads=setup["threads"],
                                   cache_limit_bytes=setup["cache_bytes"])
    conn.send_bytes(b"ready")
    while True:
        try:
            kind, text, any_whitespace = msgspec.msgpack.decode(conn.recv_bytes())
        except EOFError:
            return
        try:
            reply = [True, compile_spec(compiler, (kind, text, any_whitespace))]
        except Exception as e:  # noqa: BLE001 - xgrammar's errors have no common base
            lines = str(e).strip().splitlines()
            reply = [False, lines[0] if lines else type(e).__name__]
        conn.send_bytes(msgspec.msgpack.encode(reply))


def _wait_message(conn: Connection, alive: Any, stop: threading.Event, what: str) -> bytes:
    deadline = time.monotonic() + START_TIMEOUT_S
    while not conn.poll(0.05):
        if stop.is_set():
            raise RuntimeError("shut down")
        if not alive() or time.monotonic() > deadline:
            raise RuntimeError(f"{what} did not start")
    try:
        return conn.recv_bytes()
    except (EOFError, OSError):
        raise RuntimeError(f"{what} did not start") from None


class Zygote:
    """The engine core's side of the process that forks compile processes."""

    def __init__(self, setup: bytes, stop: threading.Event) -> None:
        ours, theirs = socket.socketpair()
        fd = theirs.fileno()
        env = dict(os.environ)
        root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
        env["OMP_NUM_THREADS"] = "1"  # no thread before a fork (torch's pool, if it ran)
        try:
            self.proc = start_children(lambda: subprocess.Popen(
                [sys.executable, "-c", "from vlmserve.layers.grammar_processes import "
                 f"_zygote_main; _zygote_main({fd}, {os.getpid()})"],
                pass_fds=(fd,), env=env, stdin=subprocess.DEVNULL))
        finally:
            theirs.close()
        self.conn = Connection(ours.detach())
        self._lock = threading.Lock()
        try:
            self.conn.send_bytes(setup)
            if _wait_message(self.conn, lambda: self.proc.poll() is None, stop,
                             "the grammar compile processes' parent") != b"ready":
                raise RuntimeError("the grammar compile processes' parent did not start")
        except BaseException:
            self.close()
            raise

    def alive(self) -> bool:
        return self.proc.poll() is None

    def fork(self, stop: threading.Event) -> CompileProcess:
        """A new compile process, ready."""
        from multiprocessing.reduction import send_handle

        import msgspec

        ours, theirs = socket.socketpair()
        try:
            with self._lock:
                self.conn.send_bytes(b"fork")
                send_handle(self.conn, theirs.fileno(), self.proc.pid)
                pid = msgspec.msgpack.decode(_wait_message(
                    self.conn, self.alive, stop, "the grammar compile processes' parent"))
        finally:
            theirs.close()
        proc = CompileProcess(pid, Connection(ours.detach()))
        try:
            if _wait_message(proc.conn, proc.alive, stop, "a grammar compile process") != (
                    b"ready"):
                raise RuntimeError("a grammar compile process did not start")
        except BaseException:
            proc.kill()
            raise
        return proc

    def close(self) -> None:
        self.proc.kill()
        self.proc.wait()
        self.conn.close()


class CompileProcess:
    """The engine core's side of one compile process (a child of the zygote)."""

    def __init__(self, pid: int, conn: Connection) -> None:
        self.pid, self.conn = pid, conn

    def alive(self) -> bool:
        return pid_alive(self.pid)

    def rss(self) -> int | None:
        """Its resident memory in bytes (None where /proc cannot tell)."""
        try:
            with open(f"/proc/{self.pid}/statm") as f:
                return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
        except (OSError, ValueError, IndexError):
            return None

    def kill(self) -> None:
        try:
            os.kill(self.pid, signal.SIGKILL)  # the zygote reaps it
        except ProcessLookupError:
            pass
        self.conn.close()
