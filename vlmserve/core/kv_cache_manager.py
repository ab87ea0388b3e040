"""Logical paged KV cache: which blocks each request owns, and the prefix cache over them.
The tensors live in the worker.

Prefix caching: a full block is keyed by a hash chained over the blocks before it, its token
ids and, for each image placeholder run inside it, the image's content hash and where in the
image the block starts (`block_keys`): two different images of one size never share a key,
and a block cut through an image is keyed by the part it holds. A block is registered under
its key once a step has written it (`cache_blocks`); a request admitted later takes the
longest run of registered blocks at the start of its prompt (`take_cached_prefix`) and
computes from there. Blocks are refcounted; a block whose last owner finishes goes back to
the free list with its key, and is evicted (its key forgotten) only when the free list
hands it out again, least recently freed first.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from vlmserve.request import Request


def block_keys(token_ids: Sequence[int], images: Sequence, block_size: int,
               parent: bytes, first_block: int, num_blocks: int) -> list[bytes]:
    """Keys of blocks `first_block` .. `first_block + num_blocks - 1` (all full), chained
    from `parent` (the key of the block before, b"" for none). `images`: objects with
    `mm_hash`, `offset` and `length` (placeholder runs in `token_ids`)."""
    keys = []
    for b in range(first_block, first_block + num_blocks):
        lo, hi = b * block_size, (b + 1) * block_size
        h = hashlib.sha256(parent)
        h.update(array("q", token_ids[lo:hi]).tobytes())
        for img in images:
            if img.offset < hi and img.offset + img.length > lo:
                start = max(lo, img.offset)
                h.update(f"|{img.mm_hash}@{start - img.offset}:{start - lo}".encode())
        parent = h.digest()
        keys.append(parent)
    return keys


class KVCacheManager:
    """Hands out fixed-size blocks; a request grows one block at a time. With
    `enable_prefix_caching`, full blocks are shared by key (see the module's docstring)."""

    def __init__(self, num_blocks: int, block_size: int,
                 enable_prefix_caching: bool = False) -> None:
        assert num_blocks > 0 and block_size > 0
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        # free blocks, the next to hand out first; a freed block goes to the end, so cached
        # blocks are evicted least recently freed first
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self._blocks: dict[str, list[int]] = {}
        self._refs = [0] * num_blocks
        self._cached: dict[bytes, int] = {}  # key -> block
        self._key: dict[int, bytes] = {}  # block -> its key, while registered
        self.num_queried_tokens = 0  # prompt tokens looked up at admission
        self.num_hit_tokens = 0  # of which found cached
        self.num_evicted_blocks = 0

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def num_cached_blocks(self) -> int:
        return len(self._cached)

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

    # ---- the prefix cache ------------------------------------------------------------------

    def cached_prefix(self, keys: Sequence[bytes]) -> list[int]:
        """The blocks registered under the leading `keys`, as far as they go."""
        blocks = []
        for key in keys:
            block = self._cached.get(key)
            if block is None:
                break
            blocks.append(block)
        return blocks

    def take_cached_prefix(self, request_id: str, blocks: list[int]) -> None:
        """Give a request without blocks these cached blocks (from `cached_prefix`), shared
        with their other owners."""
        assert request_id not in self._blocks
        for block in blocks:
            if self._refs[block] == 0:
                del self._free[block]
            self._refs[block] += 1
        if blocks:
            self._blocks[request_id] = list(blocks)

    def cache_blocks(self, request_id: str, keys: Sequence[bytes], first: int) -> None:
        """Register the request's blocks `first`, `first + 1`, ... (written by a finished
        step) under `keys`. A key already held by another block keeps that block."""
        owned = self._blocks.get(request_id, [])
        for i, key in enumerate(keys, first):
            block = owned[i]
            if key in self._cached or block in self._key:
                continue
            self._cached[key] = block
            self._key[block] = key

    def reset_prefix_cache(self) -> None:
        """Forget every key (blocks in use stay with their owners)."""
        self._cached.clear()
        self._key.clear()

    # ---- allocation ------------------------------------------------------------------------

    def allocate_slots(self, request_id: str, num_tokens: int) -> bool:
        """Grow the request's blocks to hold `num_tokens` tokens; False if blocks ran out."""
        owned = self._blocks.get(request_id, [])
        extra = self.blocks_needed(num_tokens) - len(owned)
        if extra <= 0:  # most decode steps: the last block still has room
            return True
        if extra > len(self._free):
            return False
        for _ in range(extra):
            block, _ = self._free.popitem(last=False)
            key = self._key.pop(block, None)
            if key is not None:  # evict: its contents are about to be overwritten
                del self._cached[key]
                self.num_evicted_blocks += 1
            self._refs[block] = 1
            owned.append(block)
        self._blocks[request_id] = owned
        return True

    def free(self, request_id: str) -> None:
        # the tail first: a request's last blocks are the least likely to be shared
        for block in reversed(self._blocks.pop(request_id, [])):
            self._refs[block] -= 1
            if self._refs[block] == 0:
                self._free[block] = None

    # ---- a request's blocks in the prefix cache ------------------------------------------

    def request_keys(self, req: Request, num_blocks: int) -> list[bytes]:
        """The request's block keys, computed up to `num_blocks` full blocks of known
        tokens."""
        have = len(req.block_keys)
        if num_blocks > have:
            req.block_keys += block_keys(
                req.all_token_ids, req.mm_features, self.block_size,
                req.block_keys[-1] if have else b"", have, num_blocks - have)
        return req.block_keys

    def admit_cached_prefix(self, req: Request) -> int:
        """A request being admitted with nothing computed takes the longest cached prefix of
        its tokens (never all of them: the last is computed for its logits); returns the
        tokens it covers, now counted as computed."""
        if (not self.enable_prefix_caching or req.num_computed_tokens
                or req.sampling_params.prompt_logprobs is not None):  # it scores every token
            return 0
        req.num_registered_blocks = 0
        known = req.num_prompt_tokens + len(req.output_token_ids)
        limit = (min(known, req.num_tokens - 1)) // self.block_size
        blocks = self.cached_prefix(self.request_keys(req, limit)[:limit])
        if not blocks:
            return 0
        self.take_cached_prefix(req.request_id, blocks)
        req.num_computed_tokens = len(blocks) * self.block_size
        req.num_registered_blocks = len(blocks)
        return req.num_computed_tokens

    def register_filled(self, req: Request, end: int) -> None:
        """Key the request's blocks that a finished step has filled (up to position
        `end`), so later requests can share them."""
        full = end // self.block_size
        first = req.num_registered_blocks
        if full <= first:
            return
        keys = self.request_keys(req, full)
        self.cache_blocks(req.request_id, keys[first:full], first)
        req.num_registered_blocks = full
