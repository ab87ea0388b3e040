"""Physical storage of image embeddings (encoder outputs), keyed by content hash.

The scheduler's `EncoderCacheManager` decides which entries exist; this store holds their
tensors and hands the model runner exactly the rows a chunk needs.
"""

from __future__ import annotations

import torch


class MMEmbeddingStore:
    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._entries: dict[str, torch.Tensor] = {}
        self.peak_bytes = 0

    def put(self, mm_hash: str, rows: torch.Tensor) -> None:
        """rows: [num_rows, hidden] fresh from the vision tower."""
        self._entries[mm_hash] = rows
        self.peak_bytes = max(self.peak_bytes, self.bytes_on_device)

    def __contains__(self, mm_hash: str) -> bool:
        return mm_hash in self._entries

    def rows(self, mm_hash: str, start: int, end: int) -> torch.Tensor:
        """Rows [start, end) of an image's embedding, on the compute device."""
        return self._entries[mm_hash][start:end]

    def free(self, hashes: list[str]) -> None:
        for h in hashes:
            self._entries.pop(h, None)

    @property
    def num_entries(self) -> int:
        return len(self._entries)

    @property
    def bytes_on_device(self) -> int:
        return sum(t.numel() * t.element_size() for t in self._entries.values())
