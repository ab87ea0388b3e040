"""Cache groups: one accounting per attention kind of a model's decoder layers.

A model declares each decoder layer's `LayerKind`: full attention, a sliding window of
`size` keys, chunked local attention (chunks of `size` positions, Llama 4's), or linear
attention (a recurrent state per sequence, Gated DeltaNet's). Layers of one kind (and one
size) share a group (`layer_groups`). A KV group (`BlockGroup`) hands out paged blocks from
its own pool, with its own prefix cache; the linear group (`StatePool`) hands out state
slots. `kv_cache_manager.KVCacheManager` coordinates them.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Sequence
from dataclasses import dataclass

KINDS = ("full", "sliding", "chunked", "linear")


@dataclass(frozen=True)
class LayerKind:
    """What a decoder layer keeps per sequence: ``full`` attention, ``sliding`` (a query
    reads the last `size` positions up to its own), ``chunked`` (a query reads its own chunk
    of `size` positions up to itself) or ``linear`` (a fixed-size recurrent state)."""

    kind: str = "full"
    size: int = 0

    def __post_init__(self) -> None:
        assert self.kind in KINDS, self.kind
        assert (self.size > 0) == (self.kind in ("sliding", "chunked")), self

    @property
    def windowed(self) -> bool:
        return self.kind in ("sliding", "chunked")

    def first_needed(self, pos: int) -> int:
        """The first key position a query at `pos`, or any later one, reads."""
        if self.kind == "sliding":
            return max(pos - self.size + 1, 0)
        if self.kind == "chunked":
            return pos // self.size * self.size
        return 0

    def max_blocks(self, block_size: int, chunk_tokens: int) -> int | None:
        """Most blocks a request holds at once in a group of this kind while computing
        chunks of up to `chunk_tokens` tokens; None: no bound but its length."""
        if self.kind == "sliding":
            return -(-(self.size - 1 + chunk_tokens) // block_size) + 1
        if self.kind == "chunked":
            return -(-(self.size + chunk_tokens) // block_size) + 1
        return None


FULL = LayerKind()


def layer_groups(kinds: Sequence[LayerKind]) -> list[tuple[LayerKind, tuple[int, ...]]]:
    """Decoder layers grouped by kind: the full group first, then the other KV groups in the
    order their kind first appears, the linear group last."""
    order = {"full": 0, "sliding": 1, "chunked": 1, "linear": 2}
    groups: dict[LayerKind, list[int]] = {}
    for i, kind in enumerate(kinds):
        groups.setdefault(kind, []).append(i)
    ranked = sorted(groups.items(), key=lambda kv: (order[kv[0].kind], kv[1][0]))
    return [(kind, tuple(layers)) for kind, layers in ranked]


@dataclass(frozen=True)
class CacheGroupSpec:
    """A group as the engine sizes it: its kind, its decoder layers, its blocks (KV groups;
    0 for the linear group, whose slots the manager sizes from `max_num_seqs`)."""

    kind: LayerKind
    layers: tuple[int, ...] = ()
    num_blocks: int = 0


def group_max_tokens(kind: LayerKind, num_blocks: int, block_size: int,
                     chunk_tokens: int) -> int:
    """Tokens one request can reach in a KV group of `num_blocks` alone (a windowed group
    holding a request's most: any length)."""
    bound = kind.max_blocks(block_size, chunk_tokens)
    if bound is not None and bound <= num_blocks:
        return 1 << 62
    return num_blocks * block_size


def size_cache_groups(kinds: Sequence[LayerKind], blocks_per_layer: int, *, block_size: int,
                      max_num_seqs: int, max_model_len: int, chunk_tokens: int,
                      layer_bytes: Sequence[int] | None = None) -> list[CacheGroupSpec]:
    """Each group's blocks from the memory of `blocks_per_layer` blocks for every KV layer
    (what a full-attention model of these layers would get): a windowed group takes what
    `max_num_seqs` requests can hold at once (their windows, one step's chunk, a block each
    to spare; no more than every request at full length), the full groups share the rest
    evenly per layer. The linear group is listed with no blocks. ``layer_bytes``: what one
    block costs in each layer, where layers differ (0 for a layer that reads another's cache
    and holds none); the budget is then the memory of `blocks_per_layer` blocks of every
    layer."""
    grouped = layer_groups(kinds)
    cost = list(layer_bytes) if layer_bytes is not None else [1] * len(kinds)

    def weight(layers: tuple[int, ...]) -> int:
        return sum(cost[i] for i in layers)

    most = max_num_seqs * -(-max_model_len // block_size)
    budget = blocks_per_layer * sum(weight(ls) for k, ls in grouped if k.kind != "linear")
    sized: dict[LayerKind, int] = {}
    for kind, layers in grouped:
        if kind.windowed:
            need = (max_num_seqs * kind.max_blocks(block_size, 0)
                    + -(-chunk_tokens // block_size) + max_num_seqs)
            sized[kind] = max(min(need, blocks_per_layer, most), 1)
            budget -= sized[kind] * weight(layers)
    full = max(sum(weight(layers) for kind, layers in grouped if kind.kind == "full"), 1)
    for kind, _ in grouped:
        if kind.kind == "full":
            sized[kind] = max(budget // full, 1)
    return [CacheGroupSpec(kind, layers, sized.get(kind, 0)) for kind, layers in grouped]


def window_start(kind: LayerKind, pos: int, images: Sequence = ()) -> int:
    """The first key position a query at `pos` or later reads in a layer of `kind`; a `pos`
    inside an image reaches back to the image's start (models that read images both ways
    compute each image whole, and its queries read all of it)."""
    first = kind.first_needed(pos)
    if first:
        for img in images:
            if img.offset < pos < img.offset + img.length:
                first = min(first, img.offset)
    return first


class BlockGroup:
    """Paged blocks of one KV group: a free list, refcounts, each request's block table and
    the prefix cache (block key -> block). A windowed group's table keeps its positions:
    blocks the window has passed are freed and their places hold `null_block` (the worker's
    extra block, never read unmasked)."""

    def __init__(self, kind: LayerKind, num_blocks: int, block_size: int,
                 layers: tuple[int, ...] = ()) -> None:
        assert num_blocks > 0 and block_size > 0 and kind.kind != "linear"
        self.kind = kind
        self.layers = layers
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.null_block = num_blocks
        # free blocks, the next to hand out first; a freed block goes to the end, so cached
        # blocks are evicted least recently freed first
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self._blocks: dict[str, list[int]] = {}
        self._skipped: dict[str, int] = {}  # leading places of a table holding null_block
        self._refs = [0] * num_blocks
        self._cached: dict[bytes, int] = {}  # key -> block
        self._key: dict[int, bytes] = {}  # block -> its key, while registered
        self.num_evicted_blocks = 0

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def block_ids(self, request_id: str) -> list[int]:
        return self._blocks.get(request_id, [])

    def num_live_blocks(self, request_id: str) -> int:
        """Blocks the request holds in this group (its table less the freed places)."""
        return len(self.block_ids(request_id)) - self._skipped.get(request_id, 0)

    def max_tokens(self, chunk_tokens: int) -> int:
        """Tokens one request can reach in this group alone."""
        return group_max_tokens(self.kind, self.num_blocks, self.block_size, chunk_tokens)

    # ---- allocation ------------------------------------------------------------------------

    def skip_to(self, request_id: str, first: int) -> None:
        """Free the request's blocks that end at or before position `first` (windowed groups:
        no later query reads them)."""
        upto = first // self.block_size
        done = self._skipped.get(request_id, 0)
        if upto <= done:
            return
        owned = self._blocks.setdefault(request_id, [])
        for i in range(done, min(upto, len(owned))):
            self._release(owned[i])
            owned[i] = self.null_block
        owned += [self.null_block] * (upto - len(owned))  # never needed at all
        if upto > done:
            self._skipped[request_id] = upto

    def extra_needed(self, request_id: str, num_tokens: int) -> int:
        return max(self.blocks_needed(num_tokens) - len(self.block_ids(request_id)), 0)

    def allocate(self, request_id: str, num_tokens: int) -> None:
        """Grow the request's table to hold `num_tokens` (the caller checked the room)."""
        owned = self._blocks.setdefault(request_id, [])
        extra = self.blocks_needed(num_tokens) - len(owned)
        assert extra <= len(self._free)
        for _ in range(extra):
            block, _ = self._free.popitem(last=False)
            key = self._key.pop(block, None)
            if key is not None:  # evict: its contents are about to be overwritten
                del self._cached[key]
                self.num_evicted_blocks += 1
            self._refs[block] = 1
            owned.append(block)

    def _release(self, block: int) -> None:
        self._refs[block] -= 1
        if self._refs[block] == 0:
            self._free[block] = None

    def free(self, request_id: str) -> None:
        # the tail first: a request's last blocks are the least likely to be shared
        skipped = self._skipped.pop(request_id, 0)
        owned = self._blocks.pop(request_id, [])
        for block in reversed(owned[skipped:]):
            self._release(block)

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

    def has_all(self, keys: Sequence[bytes]) -> bool:
        return all(key in self._cached for key in keys)

    def take(self, request_id: str, blocks: list[int], skipped: int = 0) -> None:
        """Give a request without blocks these cached blocks, shared with their other
        owners, after `skipped` places the window has already passed."""
        assert request_id not in self._blocks
        for block in blocks:
            if self._refs[block] == 0:
                del self._free[block]
            self._refs[block] += 1
        if blocks or skipped:
            self._blocks[request_id] = [self.null_block] * skipped + list(blocks)
            if skipped:
                self._skipped[request_id] = skipped

    def cache_blocks(self, request_id: str, keys: Sequence[bytes], first: int) -> None:
        """Register the request's blocks `first`, `first + 1`, ... (written by a finished
        step) under `keys`. A key already held by another block keeps that block; a place
        the window has passed is skipped."""
        owned = self._blocks.get(request_id, [])
        for i, key in enumerate(keys, first):
            block = owned[i]
            if block == self.null_block or key in self._cached or block in self._key:
                continue
            self._cached[key] = block
            self._key[block] = key

    def reset_prefix_cache(self) -> None:
        self._cached.clear()
        self._key.clear()


class StatePool:
    """The linear group's state slots (see `KVCacheManager` for what the worker does with
    them). Slots 0 .. max_num_seqs - 1 are running states, one per running request, taken
    at its first allocation and freed with it; slots max_num_seqs .. max_num_seqs +
    num_snapshot_slots - 1 are snapshots, each the state of some request after a block
    boundary, keyed by that block's key, least recently used evicted first."""

    def __init__(self, max_num_seqs: int, num_snapshot_slots: int = 0,
                 layers: tuple[int, ...] = ()) -> None:
        assert max_num_seqs > 0 and num_snapshot_slots >= 0
        self.layers = layers
        self.max_num_seqs = max_num_seqs
        self.num_snapshot_slots = num_snapshot_slots
        self._free_running: deque[int] = deque(range(max_num_seqs))
        self._slot: dict[str, int] = {}
        self._free_snapshots: deque[int] = deque(
            range(max_num_seqs, max_num_seqs + num_snapshot_slots))
        self._snapshots: OrderedDict[bytes, int] = OrderedDict()  # least recently used first
        self._pending: dict[str, list[tuple[int, int]]] = {}  # request -> (blocks, slot)
        self.num_evicted_snapshots = 0

    @property
    def num_slots(self) -> int:
        """State slots the worker holds: running plus snapshot slots."""
        return self.max_num_seqs + self.num_snapshot_slots

    @property
    def num_free_slots(self) -> int:
        return len(self._free_running)

    @property
    def num_snapshots(self) -> int:
        return len(self._snapshots)

    def slot(self, request_id: str) -> int | None:
        return self._slot.get(request_id)

    def take(self, request_id: str) -> int:
        if request_id not in self._slot:
            assert self._free_running, "more running requests than max_num_seqs"
            self._slot[request_id] = self._free_running.popleft()
        return self._slot[request_id]

    def free(self, request_id: str) -> None:
        slot = self._slot.pop(request_id, None)
        if slot is not None:
            self._free_running.append(slot)
        for _, snap in self._pending.pop(request_id, ()):
            self._free_snapshots.append(snap)

    # ---- snapshots -------------------------------------------------------------------------

    def lookup(self, key: bytes, touch: bool = False) -> int | None:
        slot = self._snapshots.get(key)
        if slot is not None and touch:
            self._snapshots.move_to_end(key)
        return slot

    def reserve(self, request_id: str, num_blocks: int) -> int | None:
        """A snapshot slot for the request's state after its first `num_blocks` blocks
        (keyed once those blocks are: `register`); None if every slot is pending."""
        if self._free_snapshots:
            slot = self._free_snapshots.popleft()
        elif self._snapshots:
            _, slot = self._snapshots.popitem(last=False)
            self.num_evicted_snapshots += 1
        else:
            return None
        self._pending.setdefault(request_id, []).append((num_blocks, slot))
        return slot

    def register(self, request_id: str, keys: Sequence[bytes]) -> None:
        """Key the request's pending snapshots whose blocks are now all keyed (`keys`: its
        block keys so far). A key that has a snapshot keeps it; the new slot goes back."""
        pending = self._pending.get(request_id)
        if not pending:
            return
        left = []
        for num_blocks, slot in pending:
            if num_blocks > len(keys):
                left.append((num_blocks, slot))
            elif keys[num_blocks - 1] in self._snapshots:
                self._free_snapshots.append(slot)
            else:
                self._snapshots[keys[num_blocks - 1]] = slot
        if left:
            self._pending[request_id] = left
        else:
            del self._pending[request_id]

    def reset_prefix_cache(self) -> None:
        self._free_snapshots.extend(self._snapshots.values())
        self._snapshots.clear()
