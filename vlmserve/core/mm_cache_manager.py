"""Logical encoder cache: which image embeddings exist, keyed by content hash.

An entry is created when the scheduler decides to encode an image and is referenced by every
request that still has rows of it to consume; a request with an image already present (same
hash) shares the entry instead of encoding it again. When the last reference goes, the entry
is either freed at once (`retain=False`) or kept, unreferenced, in LRU order so that a later
request with the same image skips the encoder; unreferenced entries are evicted, oldest
first, when room is needed. Capacity is in embedding rows (the engine converts its byte
budget). Freed and evicted hashes are reported so the worker drops their tensors.
"""

from __future__ import annotations

from collections import OrderedDict


class EncoderCacheManager:
    def __init__(self, capacity_rows: int, retain: bool = False) -> None:
        self.capacity_rows = capacity_rows
        self.retain = retain
        self.used_rows = 0
        self._rows: dict[str, int] = {}  # hash -> rows, every entry
        self._refs: dict[str, set[str]] = {}  # hash -> request ids, referenced entries only
        self._lru: OrderedDict[str, None] = OrderedDict()  # unreferenced entries, oldest first
        self._lru_rows = 0  # rows held by them
        self._to_free: list[str] = []
        self.num_encoded = 0  # misses: images sent to the encoder
        self.num_hits = 0  # a request found its image already present
        self.num_evictions = 0

    def __contains__(self, mm_hash: str) -> bool:
        return mm_hash in self._rows

    def can_allocate(self, rows: int, keep: set[str] = frozenset()) -> bool:
        """Whether `rows` more fit, counting unreferenced entries (other than `keep`, which
        are about to be reused) as evictable."""
        evictable = self._lru_rows - sum(self._rows[h] for h in keep if h in self._lru)
        return self.used_rows - evictable + rows <= self.capacity_rows

    def allocate(self, mm_hash: str, rows: int, request_id: str) -> None:
        """Reserve rows for an image about to be encoded this step (evicting LRU entries)."""
        assert mm_hash not in self._rows and self.can_allocate(rows)
        while self.used_rows + rows > self.capacity_rows:
            victim, _ = self._lru.popitem(last=False)
            self._lru_rows -= self._rows[victim]
            self._drop(victim)
            self.num_evictions += 1
        self._rows[mm_hash] = rows
        self._refs[mm_hash] = {request_id}
        self.used_rows += rows
        self.num_encoded += 1

    def add_ref(self, mm_hash: str, request_id: str) -> None:
        """Share an existing entry (encoded earlier, retained, or scheduled this step)."""
        refs = self._refs.get(mm_hash)
        if refs is None:  # a retained entry comes back into use
            self._lru.pop(mm_hash)
            self._lru_rows -= self._rows[mm_hash]
            refs = self._refs[mm_hash] = set()
        if request_id not in refs:
            refs.add(request_id)
            self.num_hits += 1

    def release(self, mm_hash: str, request_id: str) -> None:
        refs = self._refs.get(mm_hash)
        if refs is None or request_id not in refs:
            return
        refs.discard(request_id)
        if refs:
            return
        del self._refs[mm_hash]
        if self.retain:
            self._lru[mm_hash] = None
            self._lru_rows += self._rows[mm_hash]
        else:
            self._drop(mm_hash)

    def release_all(self, request_id: str, hashes: list[str]) -> None:
        for h in hashes:
            self.release(h, request_id)

    def forget(self, hashes: list[str]) -> None:
        """Drop these entries however referenced (their encoding failed)."""
        for h in hashes:
            if h not in self._rows:
                continue
            self._refs.pop(h, None)
            if self._lru.pop(h, 0) is None:
                self._lru_rows -= self._rows[h]
            self._drop(h)

    def _drop(self, mm_hash: str) -> None:
        self.used_rows -= self._rows.pop(mm_hash)
        self._to_free.append(mm_hash)

    def take_freed(self) -> list[str]:
        """Hashes freed or evicted since the last call; the worker drops their tensors."""
        freed, self._to_free = self._to_free, []
        return freed

    @property
    def num_entries(self) -> int:
        return len(self._rows)

    @property
    def num_referenced(self) -> int:
        return len(self._refs)
