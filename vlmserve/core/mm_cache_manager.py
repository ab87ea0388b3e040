"""Logical encoder cache: which image embeddings exist, keyed by content hash.

An entry is created when the scheduler decides to encode an image and is held by every
request that still has rows of it to consume. Entries are shared: a second request with the
same image (same hash) references the existing entry instead of encoding it again. When the
last reference goes, the entry is freed and its hash is reported so the worker drops the
tensor. Capacity is counted in embedding rows.
"""

from __future__ import annotations


class EncoderCacheManager:
    def __init__(self, capacity_rows: int) -> None:
        self.capacity_rows = capacity_rows
        self.used_rows = 0
        self._rows: dict[str, int] = {}  # hash -> rows
        self._refs: dict[str, set[str]] = {}  # hash -> request ids
        self._to_free: list[str] = []
        self.num_encoded = 0
        self.num_hits = 0

    def __contains__(self, mm_hash: str) -> bool:
        return mm_hash in self._rows

    def has_ref(self, mm_hash: str, request_id: str) -> bool:
        return request_id in self._refs.get(mm_hash, ())

    def can_allocate(self, rows: int) -> bool:
        return self.used_rows + rows <= self.capacity_rows

    def allocate(self, mm_hash: str, rows: int, request_id: str) -> None:
        """Reserve rows for an image about to be encoded this step."""
        assert mm_hash not in self._rows and self.can_allocate(rows)
        self._rows[mm_hash] = rows
        self._refs[mm_hash] = {request_id}
        self.used_rows += rows
        self.num_encoded += 1

    def add_ref(self, mm_hash: str, request_id: str) -> None:
        """Share an existing entry (encoded earlier or scheduled this step)."""
        refs = self._refs[mm_hash]
        if request_id not in refs:
            refs.add(request_id)
            self.num_hits += 1

    def release(self, mm_hash: str, request_id: str) -> None:
        refs = self._refs.get(mm_hash)
        if refs is None or request_id not in refs:
            return
        refs.discard(request_id)
        if not refs:
            self.used_rows -= self._rows.pop(mm_hash)
            del self._refs[mm_hash]
            self._to_free.append(mm_hash)

    def release_all(self, request_id: str, hashes: list[str]) -> None:
        for h in hashes:
            self.release(h, request_id)

    def take_freed(self) -> list[str]:
        """Hashes freed since the last call; the worker drops their tensors."""
        freed, self._to_free = self._to_free, []
        return freed

    @property
    def num_entries(self) -> int:
        return len(self._rows)
