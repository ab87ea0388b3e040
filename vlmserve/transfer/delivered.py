"""What each consumer of an encoder server already holds: `DeliveredImages`.

A consumer (an LLM server, named by the id its front ends send: `client.consumer_id`) copies
the rows of every handle it opens into its engine core's encoder cache. The encoder server
remembers, per consumer, the content hashes of the images whose handles that consumer opened
and released (the ledger's ``on_free``), the most recent first, up to the rows of the
consumer's encoder cache, for the `max_consumers` consumers heard from last. Such an image is
answered "known" instead of being encoded and exported again: the consumer sends its pixels
to the engine core, which finds its rows in its cache (or encodes it itself if it evicted
them). A handle reclaimed at its lease, or released unread, teaches nothing.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass, field


@dataclass
class _Held:
    """One consumer's images: rows by content hash, least recently used first."""

    budget: int  # rows of the consumer's encoder cache
    rows: OrderedDict[str, int] = field(default_factory=OrderedDict)
    total: int = 0

    def add(self, mm_hash: str, length: int) -> None:
        if mm_hash in self.rows:
            self.rows.move_to_end(mm_hash)
            return
        self.rows[mm_hash] = length
        self.total += length
        self.trim()

    def trim(self) -> None:
        while self.total > self.budget:
            self.total -= self.rows.popitem(last=False)[1]


class DeliveredImages:
    """Thread-safe. ``max_rows``: the most rows remembered for one consumer (whatever it
    says its cache holds); ``max_pending``: exported handles awaiting their fate."""

    def __init__(self, max_consumers: int = 64, max_rows: int = 1 << 22,
                 max_pending: int = 1 << 16) -> None:
        self.max_consumers, self.max_rows, self.max_pending = max_consumers, max_rows, max_pending
        self._lock = threading.Lock()
        self._consumers: OrderedDict[str, _Held] = OrderedDict()
        self._pending: OrderedDict[str, tuple[str, str, int]] = OrderedDict()
        self.known_images = 0  # hashes answered as known

    def known(self, consumer: str, rows: int | None, hashes: Iterable[str]) -> set[str]:
        """Those of ``hashes`` delivered to ``consumer`` (now its most recent), counted in
        `known_images`. ``rows``: its encoder cache's capacity (None: `max_rows`)."""
        budget = min(rows or self.max_rows, self.max_rows)
        with self._lock:
            held = self._consumers.get(consumer)
            if held is None:
                held = self._consumers[consumer] = _Held(budget)
                if len(self._consumers) > self.max_consumers:
                    self._consumers.popitem(last=False)
            self._consumers.move_to_end(consumer)
            if held.budget != budget:
                held.budget = budget
                held.trim()
            found = set()
            for h in hashes:
                if h in held.rows:
                    held.rows.move_to_end(h)
                    found.add(h)
            self.known_images += len(found)
            return found

    def exported(self, consumer: str, handles: Iterable[tuple[str, str, int]]) -> None:
        """Handles (id, content hash, rows) exported for ``consumer`` after it asked
        `known`: their images count as delivered once it releases them opened."""
        with self._lock:
            for handle_id, mm_hash, length in handles:
                self._pending[handle_id] = (consumer, mm_hash, length)
            while len(self._pending) > self.max_pending:  # fates never told (a race lost)
                self._pending.popitem(last=False)

    def freed(self, handle_id: str, delivered: bool) -> None:
        """The ledger's ``on_free``: a handle's fate."""
        with self._lock:
            entry = self._pending.pop(handle_id, None)
            if entry is None or not delivered:
                return
            consumer, mm_hash, length = entry
            held = self._consumers.get(consumer)
            if held is not None:  # else forgotten meanwhile
                held.add(mm_hash, length)
