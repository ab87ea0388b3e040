"""The offloading worker's prefetch plan: which cached image rows the next step will probably
read, so that they are copied to the device while this step runs. A wrong guess costs a
synchronous copy in the worker, never correctness."""

from __future__ import annotations

import itertools
from collections.abc import Container, Iterable

from vlmserve.request import Request


def predict_next_rows(running: Iterable[Request], waiting: Iterable[Request], free_slots: int,
                      budget: int, prefill_budget: int, cached: Container[str]
                      ) -> list[tuple[str, int, int]]:
    """(content hash, first row, end row) of the image rows the next step would read if it
    continued the running requests in order, then admitted up to `free_slots` waiting ones,
    within `budget` tokens of which at most `prefill_budget` are prompt tokens (decodes take
    one token each); only images in `cached` (the encoder cache) count."""
    spans = []
    for req in itertools.chain(running, itertools.islice(waiting, max(free_slots, 0))):
        start = req.num_computed_tokens  # already past this step's chunk
        decode = req.decodes_next
        n = min(req.num_tokens - start, budget if decode else min(budget, prefill_budget))
        if n <= 0:
            continue
        budget -= n
        if not decode:
            prefill_budget -= n
        if start < req.images_end:  # else it has no image rows left to read
            for img in req.mm_features:
                lo, hi = max(start, img.offset), min(start + n, img.offset + img.length)
                if lo < hi and img.mm_hash in cached:
                    spans.append((img.mm_hash, lo - img.offset, hi - img.offset))
        if budget <= 0:
            break
    return spans
