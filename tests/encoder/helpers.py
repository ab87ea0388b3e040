"""Shared pieces of the encoder tests."""

from __future__ import annotations

import os

from tests.wait import wait_until

__all__ = ["segments", "wait_until"]


def segments(prefix: str) -> list[str]:
    """Shared-memory segments whose names start with ``prefix``."""
    return sorted(n for n in os.listdir("/dev/shm") if n.startswith(prefix))
