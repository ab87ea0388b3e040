"""Logical paged KV cache: which blocks each request owns in each cache group, the linear
group's state slots, and the prefix cache over them. The tensors live in the worker.

Cache groups (`kv_cache_groups.py`): a model declares each decoder layer's kind (full,
sliding window, chunked local, linear attention); layers of one kind share a group. Each KV
group has its own pool of blocks and its own block table per request (the worker gives each
group's layers tensors of that group's blocks, plus one extra block, `null_block`, which
padded rows write and freed places point at). A full-attention model has one full group and
behaves as it always did. A request's blocks in a sliding group are freed once the window
has passed them (at most `window / block_size + 1` stay live while it decodes), in a chunked
group once its chunk is done; their places in the table hold `null_block`, so block `i` of
a table always holds positions `i * block_size ...`. Allocation is all or nothing across
groups, so admission, preemption and the scheduler's budgets account for every group.

Prefix caching: a full block is keyed by a hash chained over the blocks before it, its token
ids and, for each image placeholder run inside it, the image's content hash and where in the
image the block starts (`block_keys`): two different images of one size never share a key,
and a block cut through an image is keyed by the part it holds. A block is registered under
its key, in every group that still holds it, once a step has written it (`register_filled`).
A request admitted later takes the longest prefix every group can serve
(`admit_cached_prefix`): a full group all its blocks, a windowed group the blocks its window
reads from the hit point on, the linear group a state snapshot at the hit point; and computes
from there. Blocks are refcounted; a block whose last owner lets it go returns to its group's
free list with its key, and is evicted (its key forgotten) only when the free list hands it
out again, least recently freed first.

The linear group (what the worker does): the worker holds `states.num_slots` states (each
linear layer's recurrent and convolution state) per slot. A request has one running slot,
`NewRequestData.state_slot`, for as long as it runs (slots 0 .. max_num_seqs - 1; a slot is
reused once its request finishes or is preempted). When a request arrives in
`new_requests`, before the step's forward the worker sets its running state: zeros if
`restore_slot` is None (then `num_computed_tokens` is 0), else a copy of snapshot slot
`restore_slot` (the state after exactly `num_computed_tokens` tokens, a block boundary).
Chunks carry the running state from step to step. With prefix caching, each of a step's
`SchedulerOutput.snapshots` entries `(request_id, position, slot)` asks the worker to leave
in snapshot `slot`, after the step, the request's state as it stood after its first
`position` tokens (`position` a multiple of the block size inside the request's chunk of the
step: start < position <= start + scheduled tokens; a chunk asks for up to a few: see
`reserve_snapshots`; every decode step that completes a block asks for one, at its end;
a prefill chunk may ask for positions inside it, so the worker splits its recurrence
there). A step's restores happen
before its snapshot copies (a slot may be read by one and written by the other). Snapshots
are keyed once the step's blocks are (`register_filled`) and evicted least recently used
first when a new one needs a slot.
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Sequence
from typing import TYPE_CHECKING

from vlmserve.core.kv_cache_groups import (
    FULL,
    BlockGroup,
    CacheGroupSpec,
    StatePool,
    window_start,
)

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
    """Hands out each group's blocks (and the linear group's state slots); a request grows
    one block at a time. With `enable_prefix_caching`, full blocks are shared by key (see
    the module's docstring). Without `groups`: one full-attention group of `num_blocks`.
    `max_num_seqs` sizes the linear group's running slots, `num_snapshot_slots` its
    snapshots; `chunk_tokens` (the step budget) bounds a windowed group's blocks per
    request."""

    def __init__(self, num_blocks: int, block_size: int,
                 enable_prefix_caching: bool = False, *,
                 groups: Sequence[CacheGroupSpec] | None = None, max_num_seqs: int = 0,
                 num_snapshot_slots: int = 0, chunk_tokens: int = 0) -> None:
        assert block_size > 0
        if groups is None:
            groups = [CacheGroupSpec(FULL, (), num_blocks)]
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.chunk_tokens = chunk_tokens
        self.groups = [BlockGroup(g.kind, g.num_blocks, block_size, g.layers)
                       for g in groups if g.kind.kind != "linear"]
        assert self.groups, "a model needs at least one attention group"
        linear = [g for g in groups if g.kind.kind == "linear"]
        assert len(linear) <= 1
        self.states = (StatePool(max_num_seqs, num_snapshot_slots, linear[0].layers)
                       if linear else None)
        self._restore: dict[str, int] = {}  # request -> snapshot slot to start from
        self.num_queried_tokens = 0  # prompt tokens looked up at admission
        self.num_hit_tokens = 0  # of which found cached

    # the first group's tables and cache (a full-attention model's only group)

    @property
    def _blocks(self) -> dict[str, list[int]]:
        return self.groups[0]._blocks

    @property
    def _cached(self) -> dict[bytes, int]:
        return self.groups[0]._cached

    @property
    def _key(self) -> dict[int, bytes]:
        return self.groups[0]._key

    @property
    def num_blocks(self) -> int:
        return sum(g.num_blocks for g in self.groups)

    @property
    def num_free_blocks(self) -> int:
        return sum(g.num_free_blocks for g in self.groups)

    @property
    def num_cached_blocks(self) -> int:
        return sum(len(g._cached) for g in self.groups)

    @property
    def num_evicted_blocks(self) -> int:
        return sum(g.num_evicted_blocks for g in self.groups)

    @property
    def usage(self) -> float:
        return 1.0 - self.num_free_blocks / self.num_blocks

    @property
    def max_kv_tokens(self) -> int:
        """Tokens one request alone can reach in every group."""
        return min(g.max_tokens(self.chunk_tokens) for g in self.groups)

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def block_ids(self, request_id: str) -> list[int]:
        """The request's block table in the first group."""
        return self.groups[0].block_ids(request_id)

    def group_block_ids(self, request_id: str) -> list[list[int]]:
        """The request's block table in each KV group."""
        return [g.block_ids(request_id) for g in self.groups]

    def state_slot(self, request_id: str) -> int | None:
        return self.states.slot(request_id) if self.states is not None else None

    def pop_restore(self, request_id: str) -> int | None:
        """The snapshot slot the request's running state starts from (once)."""
        return self._restore.pop(request_id, None)

    # ---- the first group's prefix cache, by hand ------------------------------------------

    def cached_prefix(self, keys: Sequence[bytes]) -> list[int]:
        """The first group's blocks registered under the leading `keys`, as far as they go."""
        return self.groups[0].cached_prefix(keys)

    def take_cached_prefix(self, request_id: str, blocks: list[int]) -> None:
        """Give a request without blocks these cached blocks of the first group (from
        `cached_prefix`), shared with their other owners."""
        self.groups[0].take(request_id, blocks)

    def cache_blocks(self, request_id: str, keys: Sequence[bytes], first: int) -> None:
        """Register the request's blocks `first`, `first + 1`, ... of the first group."""
        self.groups[0].cache_blocks(request_id, keys, first)

    def reset_prefix_cache(self) -> None:
        """Forget every key and snapshot (blocks in use stay with their owners)."""
        for g in self.groups:
            g.reset_prefix_cache()
        if self.states is not None:
            self.states.reset_prefix_cache()

    # ---- allocation ------------------------------------------------------------------------

    def allocate_slots(self, request_id: str, num_tokens: int, num_computed: int = 0,
                       images: Sequence = ()) -> bool:
        """Grow the request's tables to hold `num_tokens` tokens, in every group or none;
        False if blocks ran out. `num_computed`: where the chunk starts (windowed groups
        first free what its queries no longer read; `images`: the request's, see
        `window_start`). A request's first allocation takes its linear state slot."""
        for g in self.groups:
            if g.kind.windowed:
                g.skip_to(request_id, window_start(g.kind, num_computed, images))
        if any(g.extra_needed(request_id, num_tokens) > g.num_free_blocks
               for g in self.groups):
            return False
        for g in self.groups:
            g.allocate(request_id, num_tokens)
        if self.states is not None:
            self.states.take(request_id)
        return True

    def free(self, request_id: str) -> None:
        for g in self.groups:
            g.free(request_id)
        if self.states is not None:
            self.states.free(request_id)
        self._restore.pop(request_id, None)

    def num_live_blocks(self, request_id: str) -> list[int]:
        """Blocks the request holds in each KV group."""
        return [g.num_live_blocks(request_id) for g in self.groups]

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

    def _servable(self, keys: Sequence[bytes], num_blocks: int, images: Sequence) -> bool:
        """Whether every windowed group and the linear group can resume after the first
        `num_blocks` blocks."""
        pos = num_blocks * self.block_size
        for g in self.groups:
            if g.kind.windowed:
                first = window_start(g.kind, pos, images) // self.block_size
                if not g.has_all(keys[first:num_blocks]):
                    return False
        return self.states is None or self.states.lookup(keys[num_blocks - 1]) is not None

    def admit_cached_prefix(self, req: Request) -> int:
        """A request being admitted with nothing computed takes the longest cached prefix of
        its tokens that every group can serve (never all of them: the last is computed for
        its logits); returns the tokens it covers, now counted as computed."""
        if (not self.enable_prefix_caching or req.num_computed_tokens
                or req.sampling_params.prompt_logprobs is not None):  # it scores every token
            return 0
        req.num_registered_blocks = 0
        known = req.num_prompt_tokens + len(req.output_token_ids)
        limit = (min(known, req.num_tokens - 1)) // self.block_size
        keys = self.request_keys(req, limit)[:limit]
        hit = limit
        for g in self.groups:
            if not g.kind.windowed:
                hit = min(hit, len(g.cached_prefix(keys[:hit])))
        while hit and not self._servable(keys, hit, req.mm_features):
            hit -= 1
        if not hit:
            return 0
        pos = hit * self.block_size
        for g in self.groups:
            first = (window_start(g.kind, pos, req.mm_features) // self.block_size
                     if g.kind.windowed else 0)
            g.take(req.request_id, [g._cached[k] for k in keys[first:hit]], first)
        if self.states is not None:
            self._restore[req.request_id] = self.states.lookup(keys[hit - 1], touch=True)
        req.num_computed_tokens = pos
        req.num_registered_blocks = hit
        return pos

    def reserve_snapshots(self, req: Request, start: int, end: int) -> list[tuple[int, int]]:
        """With prefix caching and a linear group: snapshot slots for the request's state at
        the block boundaries worth keeping that its chunk [start, end) crosses, as
        (position, slot): the last one (every decode step that completes a block), the last
        before the end of its known tokens (a prompt replayed later resumes there: its last
        token is always computed) and the last at or before each image's end (a prompt that
        shares an image and asks something else); none past a pending slot shortage."""
        if self.states is None or not self.enable_prefix_caching:
            return []
        bs = self.block_size
        ends = {end}
        if end == req.num_tokens:
            ends.add(end - 1)
        ends.update(img.offset + img.length for img in req.mm_features
                    if start < img.offset + img.length <= end)
        out = []
        for blocks in sorted({e // bs for e in ends if e // bs * bs > start}):
            slot = self.states.reserve(req.request_id, blocks)
            if slot is None:
                break
            out.append((blocks * bs, slot))
        return out

    def register_filled(self, req: Request, end: int) -> None:
        """Key the request's blocks that a finished step has filled (up to position
        `end`), in every group still holding them, and its snapshots within them, so later
        requests can share them."""
        full = end // self.block_size
        first = req.num_registered_blocks
        if self.states is not None and full:
            self.states.register(req.request_id, self.request_keys(req, full)[:full])
        if full <= first:
            return
        keys = self.request_keys(req, full)
        for g in self.groups:
            g.cache_blocks(req.request_id, keys[first:full], first)
        req.num_registered_blocks = full
