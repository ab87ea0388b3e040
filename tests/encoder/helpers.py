"""Shared pieces of the encoder tests."""

from __future__ import annotations

import os
import time
from collections.abc import Callable


def wait_until(pred: Callable[[], bool], timeout_s: float, step_s: float = 0.02) -> bool:
    """Poll ``pred`` until it holds or ``timeout_s`` passes; returns its last value."""
    end = time.monotonic() + timeout_s
    while not pred():
        if time.monotonic() > end:
            return pred()
        time.sleep(step_s)
    return True


def segments(prefix: str) -> list[str]:
    """Shared-memory segments whose names start with ``prefix``."""
    return sorted(n for n in os.listdir("/dev/shm") if n.startswith(prefix))
