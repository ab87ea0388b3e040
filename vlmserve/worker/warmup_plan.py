"""Which attention launches the warm-up replays: one step shape for every compiled variant of
the Triton attention kernels that an engine with these limits can launch.

Pure Python (no torch device work, no triton): the variants come from the same functions the
kernel wrappers call (`layers/attention_launch.py`), evaluated over the step shapes the
engine can produce, so a new tile rule there is planned for here without a change.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from vlmserve.layers.attention_launch import MIN_SPLIT_TOKENS, cdiv, paged_launch, varlen_launch


@dataclass(frozen=True)
class Limits:
    """What bounds a step: requests, tokens, context, vision segments and patches."""

    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int
    max_encoder_rows: int  # image-embedding rows one step may encode
    patches_per_row: int = 4  # vision tokens per embedding row (spatial merge squared)


@dataclass
class PagedPlan:
    """Step shapes (query lengths, context lengths) covering every attention variant and
    every split-merge variant; `variants` / `merge_variants` map each to its shape."""

    variants: dict[tuple, tuple[tuple[int, ...], tuple[int, ...]]] = field(default_factory=dict)
    merge_variants: dict[tuple, tuple[tuple[int, ...], tuple[int, ...]]] = field(
        default_factory=dict)

    def shapes(self) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
        """Each shape once, fewest tokens first."""
        seen = dict.fromkeys(list(self.variants.values()) + list(self.merge_variants.values()))
        return sorted(seen, key=lambda s: (sum(s[0]), sum(s[1])))


def _batch_sizes(max_batch: int) -> list[int]:
    """Every batch size up to 64, then the edges of the binary-search classes (powers of 2
    and 16, one either side) and the largest: the grid choice changes only there."""
    sizes = set(range(1, min(max_batch, 64) + 1)) | {max_batch}
    p = 64
    while p <= max_batch:
        sizes |= {p - 1, p, p + 1}
        p *= 2
    return sorted(s for s in sizes if 1 <= s <= max_batch)


def _lengths(limit: int, extra: set[int]) -> list[int]:
    """2..130, powers of two and their neighbours, and `extra`, up to `limit`."""
    out = set(range(2, 131)) | extra
    p = 128
    while p <= limit:
        out |= {p - 1, p, p + 1}
        p *= 2
    return sorted(n for n in out if 2 <= n <= limit)


def plan_paged(limits: Limits, heads: int, kv_heads: int, head_dim: int, fp32: bool,
               sms: int, *, decode_tile: tuple | None = None,
               min_split_tokens: int = MIN_SPLIT_TOKENS) -> PagedPlan:
    """Shapes for `paged_attention_triton` launched eagerly (CUDA graphs are compiled when
    captured): decode-shaped steps (every query one token) and steps with a longer chunk."""
    plan = PagedPlan()
    max_b = min(limits.max_num_seqs, limits.max_num_batched_tokens)
    max_t = limits.max_num_batched_tokens

    def add(long: int, count: int, ctx: int) -> None:
        """`count` requests: one with a chunk of `long` tokens and a context of `ctx`, the
        rest one token each."""
        tokens = long + count - 1
        cfg = paged_launch(tokens, count, long, ctx, heads, kv_heads, head_dim, fp32, sms,
                           decode_tile=decode_tile, min_split_tokens=min_split_tokens)
        new_variant = cfg.variant not in plan.variants
        new_merge = cfg.merge_variant is not None and cfg.merge_variant not in plan.merge_variants
        if not (new_variant or new_merge):
            return
        shape = ((long,) + (1,) * (count - 1), (ctx,) + (1,) * (count - 1))
        if new_variant:
            plan.variants[cfg.variant] = shape
        if new_merge:
            plan.merge_variants[cfg.merge_variant] = shape

    # decode-shaped: the split count follows the longest context in steps of min_split_tokens
    contexts = [1] + [min_split_tokens * k for k in range(1, 65)
                      if min_split_tokens * k <= limits.max_model_len]
    for b in range(1, max_b + 1):
        for ctx in contexts:
            add(1, b, ctx)
            if 4 * b * kv_heads >= 2 * sms:  # no splits at any context length
                break
    # a longer chunk among one-token ones (direct grid for one request, else searched once
    # the chunk spans two tiles), at lengths around the tile sizes, the two-wave threshold of
    # 128-row tiles and the budget
    wave = cdiv(2 * 128 * sms, heads)  # tokens for two waves of 128-row tiles
    for b in _batch_sizes(max_b):
        extra = {64 * kv_heads // heads + 1, wave, wave - b + 1, max_t - b + 1}
        for n in _lengths(min(max_t - b + 1, limits.max_model_len), extra):
            add(n, b, n)
    return plan


def plan_varlen(limits: Limits, fp32: bool) -> dict[tuple, tuple[int, ...]]:
    """Segment lengths for `varlen_attention_triton` (vision towers), one per variant.

    A step packs at most `max_encoder_rows * patches_per_row` patches; a segment (an image's
    frame or an attention window) holds at least one merged unit (`patches_per_row`)."""
    unit = limits.patches_per_row
    max_total = limits.max_encoder_rows * unit
    max_segs = max(limits.max_encoder_rows, 1)
    plan: dict[tuple, tuple[int, ...]] = {}
    counts = _batch_sizes(min(max_segs, 1 << 20))
    longest = sorted({unit, 8, 16, 17, 32, 33, 64, 65, 128, 129, 256, 257, 1024, 4096})
    for n in counts:
        for m in longest:
            for lens in ((m,) + (unit,) * (n - 1), (m,) * n):
                if m < unit or sum(lens) > max_total:
                    continue
                cfg = varlen_launch(sum(lens), n, m, fp32)
                plan.setdefault(cfg.variant, lens)
    return plan
