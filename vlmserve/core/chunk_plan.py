"""One request's chunk of a step (the scheduler's planning, kept pure): how many of its
tokens to compute, which of its images to encode for them, within the step's token and
encoder budgets."""

from __future__ import annotations

from vlmserve.core.mm_cache_manager import EncoderCacheManager
from vlmserve.request import Request


def plan_chunk(req: Request, budget: int, enc_budget: int, enc_first: int,
               encoder_cache: EncoderCacheManager, *, whole_images: bool, chunked: bool
               ) -> tuple[int, list[int], int]:
    """How many tokens of `req` to compute now (at most `budget`), the indices of the
    images to encode for them, and the encoder rows that costs (at most `enc_budget`, or
    `enc_first` for the chunk's first image). A chunk stops before an image it cannot encode
    this step (over budget, or no room in `encoder_cache`), with `whole_images` before an
    image it would cut, and without `chunked` (prefill) it is the rest of the request or
    nothing. Images already in `encoder_cache`, or twice in the chunk, cost nothing."""
    start = req.num_computed_tokens
    num_new = min(req.num_tokens - start, budget)
    if whole_images:
        end = start + num_new
        for img in req.mm_features:
            if img.offset < end < img.offset + img.length:
                num_new = max(img.offset - start, 0)
                break
    enc_ids: list[int] = []
    enc_cost = 0
    pending: set[str] = set()
    reused: set[str] = set()
    for idx, img in enumerate(req.mm_features):
        if img.offset >= start + num_new:
            break
        if img.offset + img.length <= start:
            continue
        if img.mm_hash in encoder_cache:
            reused.add(img.mm_hash)
            continue
        if img.mm_hash in pending:
            continue
        if (enc_cost + img.length > (enc_budget if enc_ids else max(enc_budget, enc_first))
                or not encoder_cache.can_allocate(enc_cost + img.length, reused)):
            num_new = img.offset - start
            break
        enc_ids.append(idx)
        enc_cost += img.length
        pending.add(img.mm_hash)
    num_new = max(num_new, 0)
    if not chunked and 0 < num_new < req.num_tokens - start:
        num_new = 0
    if num_new == 0:
        return 0, [], 0
    return num_new, enc_ids, enc_cost
