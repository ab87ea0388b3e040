"""Which engine replica serves a request, when several serve one endpoint (data parallelism:
`vlmserve serve --data-parallel-size N`, or replicas on a Ray cluster).

Cache affinity: a chat's next turn re-sends the previous turn's prompt (its text and images)
and adds to it, so its first KV blocks have the same prefix keys (`kv_cache_manager.block_keys`:
tokens and image content hashes, chained) as the previous turn's. The router keeps, per
replica, a bounded table of the prefix keys and image hashes of the requests it sent there
(about as many as that replica's KV and encoder caches hold, least recently used dropped), and
sends a request to the replica holding its longest prefix (plus the image rows it would find
encoded there), the most recent on a tie. When that replica is much busier than the least loaded
one, or nothing matches (or only a small share of the request: a system prompt all chats
share), the request goes to the replica that holds least of those not much busier than the least
loaded (ties in turn), as SGLang's cache-aware router: new chats spread by cache room, so each
replica's share of the chats fits its cache even when one replica answers faster.
`random` routing (`--dp-routing random`) is the baseline affinity is measured against.

Plain Python: the front end's router, the Ray ingress and a unit test drive it alike.
"""

from __future__ import annotations

import itertools
import random
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field

from vlmserve.core.kv_cache_manager import block_keys

ROUTING_MODES = ("affinity", "random")
REASONS = ("affinity", "busy", "balance", "random")  # why a request went where it did


@dataclass(frozen=True)
class RouteKey:
    """What routing reads of a request: its full blocks' prefix keys (chained, first block
    first), its images as (content hash, offset, rows) and its length in tokens."""

    blocks: tuple[bytes, ...]
    images: tuple[tuple[str, int, int], ...]
    num_tokens: int

    @classmethod
    def of(cls, token_ids: Sequence[int], images: Sequence, block_size: int) -> RouteKey:
        """The key of a prompt: `images` are objects with `mm_hash`, `offset` and `length`
        (the placeholders' runs in `token_ids`), as the prefix cache reads them."""
        n = len(token_ids) // block_size
        return cls(tuple(block_keys(token_ids, images, block_size, b"", 0, n)),
                   tuple((img.mm_hash, img.offset, img.length) for img in images),
                   len(token_ids))


@dataclass(frozen=True)
class Route:
    """A routing decision: the replica, why (affinity, busy: the affine replica was much busier
    than the least loaded, balance: nothing matched, random) and the tokens it matched."""

    replica: int
    reason: str
    matched_tokens: int = 0


@dataclass
class _Table:
    """What one replica probably holds: prefix keys and image hashes, least recently used
    first, each with the sequence number of its last use."""

    blocks: OrderedDict[bytes, int] = field(default_factory=OrderedDict)
    images: OrderedDict[str, int] = field(default_factory=OrderedDict)
    image_rows: dict[str, int] = field(default_factory=dict)
    rows: int = 0


class AffinityRouter:
    """The routing policy over `num_replicas` replicas (see the module's docstring).

    `block_size`: tokens per KV block (the engines'); `max_blocks` / `max_image_rows`: how much
    a replica's table holds (its KV blocks, its encoder cache's rows). A replica is `busy` when
    its load exceeds the least loaded one's by more than `balance_abs` requests and by more
    than `balance_rel` times. A match shorter than `min_match` of the request's tokens (a
    system prompt every chat shares) counts as none: the least loaded replica takes it.
    """

    def __init__(self, num_replicas: int, block_size: int, mode: str = "affinity",
                 max_blocks: int = 65536, max_image_rows: int = 1 << 20,
                 balance_abs: int = 16, balance_rel: float = 1.5, min_match: float = 0.5,
                 seed: int | None = None) -> None:
        if mode not in ROUTING_MODES:
            raise ValueError(f"routing must be one of {', '.join(ROUTING_MODES)}, not {mode!r}")
        assert num_replicas >= 0 and block_size >= 1
        self.num_replicas, self.block_size, self.mode = num_replicas, block_size, mode
        self.max_blocks, self.max_image_rows = max(1, max_blocks), max(1, max_image_rows)
        self.balance_abs, self.balance_rel, self.min_match = balance_abs, balance_rel, min_match
        self._tables = [_Table() for _ in range(num_replicas)]
        self._alive = [True] * num_replicas
        self._seq = itertools.count(1)
        self._turn = 0  # the next replica to take a tie
        self._random = random.Random(seed)
        # decisions so far: {replica: {reason: count}}; tokens matched by affinity
        self.counts = [dict.fromkeys(REASONS, 0) for _ in range(num_replicas)]
        self.matched_tokens = 0

    # ---- replicas --------------------------------------------------------------------------

    def add_replica(self) -> int:
        """A new replica (Ray's, as they come): its index."""
        self._tables.append(_Table())
        self._alive.append(True)
        self.counts.append(dict.fromkeys(REASONS, 0))
        self.num_replicas += 1
        return self.num_replicas - 1

    def alive(self, replica: int) -> bool:
        return self._alive[replica]

    def set_alive(self, replica: int, alive: bool) -> None:
        """A replica that died (or came back: empty) holds nothing it held."""
        self._alive[replica] = alive
        self._tables[replica] = _Table()

    def forget(self) -> None:
        """Every replica's table emptied (their prefix caches were reset)."""
        self._tables = [_Table() for _ in self._tables]

    # ---- routing ---------------------------------------------------------------------------

    def choose(self, key: RouteKey, loads: Sequence[int],
               among: Sequence[int] | None = None) -> Route:
        """The replica for a request with this key, given each replica's load now (requests
        in flight there), among those given (default: all); the request is then recorded in
        that replica's table. Raises `LookupError` when no replica is alive."""
        live = [i for i in (range(self.num_replicas) if among is None else among)
                if self._alive[i]]
        if not live:
            raise LookupError("no replica is alive")
        if self.mode == "random":
            route = Route(self._random.choice(live), "random")
        else:
            route = self._affine(key, live, loads)
        self.counts[route.replica][route.reason] += 1
        self.matched_tokens += route.matched_tokens
        self._record(route.replica, key)
        return route

    def _affine(self, key: RouteKey, live: list[int], loads: Sequence[int]) -> Route:
        scores = {i: self._score(i, key) for i in live}
        least = min(loads[i] for i in live)
        calm = [i for i in live if self._calm(loads[i], least)]
        best = max(live, key=lambda i: (scores[i], -loads[i]))
        matched = scores[best][0]
        if matched > 0 and matched >= self.min_match * key.num_tokens:
            if best in calm:
                return Route(best, "affinity", matched)
            reason = "busy"
        else:
            reason = "balance"
        # of the replicas not much busier than the least loaded, the one that holds least
        # (the most room left in its cache, as SGLang's router), the less loaded, in turn
        room = min((len(self._tables[i].blocks), loads[i]) for i in calm)
        idle = [i for i in calm if (len(self._tables[i].blocks), loads[i]) == room]
        pick = next((i for i in idle if i >= self._turn), idle[0])
        self._turn = pick + 1
        return Route(pick, reason)

    def _calm(self, load: int, least: int) -> bool:
        """Whether a replica with this load is not much busier than the least loaded."""
        return load - least <= self.balance_abs or load <= self.balance_rel * least

    def _score(self, replica: int, key: RouteKey) -> tuple[int, int]:
        """(tokens this replica probably holds of the request: its longest cached prefix plus
        the rows of the images after it that it encoded, the last use of that prefix)."""
        table = self._tables[replica]
        prefix, last = 0, 0
        for n in range(len(key.blocks), 0, -1):
            seq = table.blocks.get(key.blocks[n - 1])
            if seq is not None:
                prefix, last = n * self.block_size, seq
                break
        rows = sum(length for mm_hash, offset, length in key.images
                   if offset >= prefix and mm_hash in table.images)
        return prefix + rows, last

    def _record(self, replica: int, key: RouteKey) -> None:
        table, seq = self._tables[replica], next(self._seq)
        # the first blocks recorded last: a prefix many requests share outlives their tails
        for k in reversed(key.blocks):
            table.blocks[k] = seq
            table.blocks.move_to_end(k)
        while len(table.blocks) > self.max_blocks:
            table.blocks.popitem(last=False)
        for mm_hash, _, length in key.images:
            if mm_hash not in table.images:
                table.rows += length
                table.image_rows[mm_hash] = length
            table.images[mm_hash] = seq
            table.images.move_to_end(mm_hash)
        while table.rows > self.max_image_rows and len(table.images) > 1:
            gone, _ = table.images.popitem(last=False)
            table.rows -= table.image_rows.pop(gone)

    def stats(self) -> dict:
        """Decisions per replica and reason, tokens matched, each table's size."""
        return {"mode": self.mode, "matched_tokens": self.matched_tokens,
                "replicas": [{"alive": self._alive[i], **self.counts[i],
                              "table_blocks": len(t.blocks), "table_images": len(t.images)}
                             for i, t in enumerate(self._tables)]}
