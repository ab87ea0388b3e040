"""Logical paged KV cache: which blocks each request owns. The tensors live in the worker."""

from __future__ import annotations

from collections import deque


class KVCacheManager:
    """Hands out fixed-size blocks from a free list; a request grows one block at a time."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        assert num_blocks > 0 and block_size > 0
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._free: deque[int] = deque(range(num_blocks))
        self._blocks: dict[str, list[int]] = {}

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def usage(self) -> float:
        return 1.0 - len(self._free) / self.num_blocks

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def block_ids(self, request_id: str) -> list[int]:
        return self._blocks.get(request_id, [])

    def can_fit(self, num_tokens: int) -> bool:
        """Whether a request of this many tokens could ever be held (the whole cache)."""
        return self.blocks_needed(num_tokens) <= self.num_blocks

    def allocate_slots(self, request_id: str, num_tokens: int) -> bool:
        """Grow the request's blocks to hold `num_tokens` tokens; False if blocks ran out."""
        owned = self._blocks.get(request_id, [])
        extra = self.blocks_needed(num_tokens) - len(owned)
        if extra <= 0:  # most decode steps: the last block still has room
            return True
        if extra > len(self._free):
            return False
        owned.extend(self._free.popleft() for _ in range(extra))
        self._blocks[request_id] = owned
        return True

    def free(self, request_id: str) -> None:
        self._free.extend(self._blocks.pop(request_id, []))
