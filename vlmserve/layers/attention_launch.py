"""Launch configurations of the Triton attention kernels (`layers/triton_attention.py`).

Pure Python, no triton import: the kernels' wrappers call these functions for every launch,
and the start-up warm-up (`worker/warmup.py`) calls the same functions to list every compiled
variant a step can need. A variant is what Triton compiles separately: the constexpr
arguments and the launch options (`num_warps`, `num_stages`), given tensors of fixed dtypes
and strides. `variant` fields hold exactly those that change from step to step.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache

import torch

MIN_SPLIT_TOKENS = 128  # each flash-decoding split covers at least this many keys
MAX_SPLITS = 64


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def next_power_of_2(n: int) -> int:
    return 1 if n <= 1 else 1 << (n - 1).bit_length()


@cache
def num_sms(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 132  # interpreter runs: behave like an H200


def search_iters(num_seqs: int) -> int:
    """Binary-search steps for num_seqs; rounded up to a multiple of 4 to bound recompiles
    (extra steps are no-ops once the range is a single sequence)."""
    return max(4, -(-(num_seqs - 1).bit_length() // 4) * 4)


def tile_grid(total: int, num_seqs: int, max_len: int, block: int) -> tuple[int, int, int]:
    """(programs, tiles_per_seq, SEARCH_ITERS): the smaller of the direct and searched grids."""
    tiles_per_seq = cdiv(max(max_len, 1), block)
    direct = num_seqs * tiles_per_seq
    searched = total // block + num_seqs
    if direct <= searched:
        return direct, tiles_per_seq, 0
    return searched, 1, search_iters(num_seqs)


def default_num_splits(batch: int, kv_heads: int, max_seq_len: int, sms: int,
                       min_split_tokens: int = MIN_SPLIT_TOKENS) -> int:
    """Flash-decoding splits for a decode-only step: when fewer (request, KV head) programs
    than half the SMs would run, enough splits for ~2 waves of programs. (From half a wave
    up, splitting costs more in merging than it gains: measured on an H200 at batch 64.)"""
    programs = batch * kv_heads
    target = 2 * sms
    if 4 * programs >= target:
        return 1
    splits = min(cdiv(target, programs), max_seq_len // min_split_tokens, MAX_SPLITS)
    return max(1, splits)


@dataclass(frozen=True)
class PagedLaunch:
    """One launch of the paged attention kernel (and of the split merge, if splits > 1)."""

    block_m: int
    block_q: int
    block_n: int
    warps: int
    stages: int
    programs: int
    tiles_per_seq: int
    search_iters: int
    splits: int
    merge_pad: int  # SPLITS_PAD of the merge kernel
    merge_warps: int

    @property
    def variant(self) -> tuple:
        """What selects the attention kernel's compiled variant (its other constexprs and
        argument types are fixed by the model, the KV cache and the dtype)."""
        return (self.block_m, self.block_n, self.warps, self.stages, self.search_iters,
                self.splits > 1)

    @property
    def merge_variant(self) -> tuple | None:
        """The merge kernel's variant, None when there is no merge."""
        return (self.merge_pad, self.merge_warps) if self.splits > 1 else None


def paged_launch(num_tokens: int, batch: int, max_query_len: int, max_seq_len: int,
                 heads: int, kv_heads: int, head_dim: int, fp32: bool, sms: int, *,
                 num_splits: int | None = None, decode_tile: tuple | None = None,
                 min_split_tokens: int = MIN_SPLIT_TOKENS) -> PagedLaunch:
    """The tiles, warps, grid and split count of `paged_attention_triton` for a step of
    `num_tokens` query tokens over `batch` requests."""
    G = heads // kv_heads
    d_pad = max(16, next_power_of_2(head_dim))
    decode = max_query_len == 1
    if decode:
        block_m = max(16, next_power_of_2(G))
        block_n, warps, stages = 0, 0, 3  # 16-bit: set with the split count, below
    else:
        # 128-row tiles for long chunks unless that leaves the GPU under two waves of programs.
        big = max_query_len * G > 64 and num_tokens * heads >= 2 * 128 * sms
        block_m = max(128 if big else 64, next_power_of_2(G))
        block_n, warps, stages = (32 if fp32 else 64), (4 if block_m <= 64 else 8), 2
    if fp32:  # exact fp32 dots run on FMA units: small tiles keep them in registers
        block_m, block_n, warps = max(32, next_power_of_2(G)), 32, 8
    block_q = block_m // G
    programs, tiles_per_seq, iters = tile_grid(num_tokens, batch, max_query_len, block_q)
    if not decode:
        splits = 1
    elif num_splits is not None:
        splits = max(1, min(num_splits, MAX_SPLITS))
    else:
        splits = default_num_splits(batch, kv_heads, max_seq_len, sms, min_split_tokens)
    if decode and not fp32:
        # two waves of programs or more take 64-key tiles on 2 warps, fewer take 128-key
        # tiles on 4 (an H200 sweep: benchmarks/sweep_decode_attention.py)
        many = programs * kv_heads * splits >= 2 * sms
        block_n, warps, stages = decode_tile or ((64, 2, 2) if many else (128, 4, 2))
    return PagedLaunch(block_m, block_q, block_n, warps, stages, programs, tiles_per_seq,
                       iters, splits, next_power_of_2(splits),
                       4 if d_pad * splits >= 2048 else 2)


@dataclass(frozen=True)
class VarlenLaunch:
    block_m: int
    block_n: int
    warps: int
    programs: int
    tiles_per_seq: int
    search_iters: int

    @property
    def variant(self) -> tuple:
        return (self.block_m, self.block_n, self.warps, self.search_iters)


def varlen_launch(total: int, num_seqs: int, max_seqlen: int, fp32: bool) -> VarlenLaunch:
    """The tiles, warps and grid of `varlen_attention_triton`."""
    if max_seqlen <= 64:
        block_m = max(16, next_power_of_2(max_seqlen))
        block_n, warps = block_m, 4
    else:
        block_m, block_n, warps = 128, 64, 8
    if fp32:  # see paged_launch
        block_m, block_n, warps = 32, 32, 8
    programs, tiles_per_seq, iters = tile_grid(total, num_seqs, max_seqlen, block_m)
    return VarlenLaunch(block_m, block_n, warps, programs, tiles_per_seq, iters)
