"""Waiting on a condition, never on the clock: poll until it holds, with a deadline generous
enough for a loaded 2-core CI machine (the deadline only turns a hang into a failure)."""

from __future__ import annotations

import time
from collections.abc import Callable


def wait_until(pred: Callable[[], object], timeout_s: float = 60.0,
               step_s: float = 0.02) -> bool:
    """Poll ``pred`` until it is true or ``timeout_s`` passes; returns whether it held."""
    end = time.monotonic() + timeout_s
    while not pred():
        if time.monotonic() > end:
            return bool(pred())
        time.sleep(step_s)
    return True


def exited(pid: int) -> bool:
    """Whether process `pid` has exited (an exited child nobody has reaped yet counts; this
    reads /proc and reaps nothing, so the child's owner still sees it exit)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except FileNotFoundError:
        return True
