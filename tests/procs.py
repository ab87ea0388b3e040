"""Processes the tests start (servers, torchrun jobs): each in a session of its own (a
terminal's Ctrl-C does not reach it, so that a test decides how it stops), and killed with its
whole process group however the test ends.

Three layers: `start` registers every such process; the pytest hooks below kill those a test
body started when the body ends (passed, failed or interrupted) and those a fixture started
when its setup fails (a fixture's own teardown stops the ones it yields); `atexit` kills any
still registered when the interpreter exits (after a KeyboardInterrupt too)."""

from __future__ import annotations

import atexit
import contextlib
import os
import signal
import subprocess
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest

_LIVE: dict[int, subprocess.Popen] = {}  # pid (its own process group's id) -> process


def start(args: Sequence[str], **popen: Any) -> subprocess.Popen:
    """`subprocess.Popen(args, **popen)` in a new session, registered until `kill_group`."""
    proc = subprocess.Popen(list(args), start_new_session=True, **popen)
    _LIVE[proc.pid] = proc
    return proc


def kill_group(proc: subprocess.Popen) -> None:
    """SIGKILL ``proc``'s process group (its children too, also when ``proc`` itself has
    exited already) and reap ``proc``."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(10)
    _LIVE.pop(proc.pid, None)


def group_size(pgid: int) -> int:
    """How many processes of group ``pgid`` run (zombies aside)."""
    n = 0
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (FileNotFoundError, ProcessLookupError):
            continue
        n += fields[2] == str(pgid) and fields[0] != "Z"
    return n


def group_alive(pgid: int) -> bool:
    """Whether a process of group ``pgid`` still runs (zombies aside)."""
    return group_size(pgid) > 0


def live() -> set[int]:
    """The pids of the processes started and not killed yet."""
    return set(_LIVE)


def kill_started_since(before: set[int]) -> None:
    for pid in live() - before:
        kill_group(_LIVE[pid])


@contextlib.contextmanager
def killed_at_exit() -> Iterator[None]:
    """Kills, when the block ends however it ends, what the block started."""
    before = live()
    try:
        yield
    finally:
        kill_started_since(before)


def kill_all() -> None:
    for proc in list(_LIVE.values()):
        kill_group(proc)


atexit.register(kill_all)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item: pytest.Item) -> Any:
    with killed_at_exit():
        return (yield)


@pytest.hookimpl(wrapper=True)
def pytest_fixture_setup(fixturedef: pytest.FixtureDef, request: pytest.FixtureRequest) -> Any:
    before = live()
    try:
        return (yield)
    except BaseException:
        kill_started_since(before)
        raise
