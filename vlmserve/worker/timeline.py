"""`DeviceTimeline`: how long the device was busy with the engine's steps, and idle between
them (CUDA timing events; the engine's stats)."""

from __future__ import annotations

from collections import deque

import torch


class DeviceTimeline:
    """Device time of the steps, from timing events around each on the compute stream: busy
    (from a step's first operation to its last) and idle (from the end of one step to the
    start of the next: the device waited for the host, or had nothing to do). CUDA only;
    seconds, counted once a step has run on the device."""

    def __init__(self) -> None:
        self.busy_s = 0.0
        self.idle_s = 0.0
        self._pending: deque[tuple[torch.cuda.Event, torch.cuda.Event]] = deque()
        self._last_end: torch.cuda.Event | None = None

    @staticmethod
    def mark() -> torch.cuda.Event:
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def add(self, start: torch.cuda.Event) -> torch.cuda.Event:
        """The step that began at `start` has been queued up to here; returns the event that
        marks its end."""
        end = self.mark()
        self._pending.append((start, end))
        self.collect()
        return end

    def restart_idle(self) -> None:
        """Do not count the gap before the next step as idle (the caller was busy elsewhere,
        e.g. preparing a benchmark); steps still running are counted as usual."""
        self.collect()
        if not self._pending:
            self._last_end = None

    def collect(self) -> None:
        """Count the steps the device has finished."""
        while self._pending and self._pending[0][1].query():
            start, end = self._pending.popleft()
            self.busy_s += start.elapsed_time(end) / 1e3
            if self._last_end is not None:
                self.idle_s += max(self._last_end.elapsed_time(start), 0.0) / 1e3
            self._last_end = end
