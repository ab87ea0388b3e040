"""The experts of a sparse MoE layer as two grouped GEMMs in Triton.

Each (token, pick) pair goes to one expert. `align_to_blocks` sorts the pairs by expert and
pads each expert's run to a multiple of BLOCK_M, all with device ops of fixed shapes (no
host sync, so CUDA graphs can capture it); a program of `_moe_gemm_kernel` then multiplies one
block of one expert's rows by a column tile of that expert's weight, reading each expert's
weight once per block of its tokens. The first GEMM gathers the tokens' rows (gate and up
columns together), SiLU-and-mul follows, the second multiplies by the down projection and by
the pair's routing weight; the k picks of a token are summed last.

A step of few pairs (decode at small batches: at most `FEW_PAIRS`) skips the sorting, a dozen
small kernels that cost more than the GEMMs there: `_moe_few_kernel` has a program per pair
and column tile, and the program of an expert's first pair multiplies all of that expert's
pairs (their rows picked by a mask over the step's ids), so each picked expert's weight tile is
still read once.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
import triton
import triton.language as tl


@triton.jit
def _rows_times_tile(a_rows, w_cols, c_ptr, scale_ptr, pair, valid, rn, n_ok, K, stride_cm,
                     MUL_SCALE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                     BLOCK_K: tl.constexpr, PRECISION: tl.constexpr):
    """c[pair, rn] = (the ``valid`` rows of ``a_rows``) @ (the column tile ``w_cols``)^T,
    times scale[pair] with MUL_SCALE: the shared body of both kernels."""
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        rk = k0 + tl.arange(0, BLOCK_K)
        k_ok = rk < K
        a = tl.load(a_rows + rk[None, :], mask=valid[:, None] & k_ok[None, :], other=0.0)
        w = tl.load(w_cols + rk[:, None], mask=k_ok[:, None] & n_ok[None, :], other=0.0)
        acc += tl.dot(a, w, input_precision=PRECISION)
    if MUL_SCALE:
        acc *= tl.load(scale_ptr + pair, mask=valid, other=0.0).to(tl.float32)[:, None]
    out = c_ptr + pair.to(tl.int64)[:, None] * stride_cm + rn[None, :]
    tl.store(out, acc.to(c_ptr.dtype.element_ty), mask=valid[:, None] & n_ok[None, :])


@triton.jit
def _moe_gemm_kernel(a_ptr, w_ptr, c_ptr, pairs_ptr, block_expert_ptr, total_ptr, scale_ptr,
                     N, K, num_pairs, num_experts, rows_per_a, stride_am, stride_we, stride_wn,
                     stride_cm,
                     MUL_SCALE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                     BLOCK_K: tl.constexpr, PRECISION: tl.constexpr):
    """c[pair, n] = a[pair // rows_per_a] @ w[expert(pair)][n, :]^T (times scale[pair]) for
    the pairs of block `program_id(0)` (padding pairs, `num_pairs`, skipped; a block of
    expert `num_experts`, the picks of experts held elsewhere, skipped whole)."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    if pid_m * BLOCK_M >= tl.load(total_ptr):
        return
    expert = tl.load(block_expert_ptr + pid_m).to(tl.int64)
    if expert >= num_experts:
        return
    pair = tl.load(pairs_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
    valid = pair < num_pairs
    row = (pair // rows_per_a).to(tl.int64)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = rn < N
    a_rows = a_ptr + row[:, None] * stride_am
    w_cols = w_ptr + expert * stride_we + rn.to(tl.int64)[None, :] * stride_wn
    _rows_times_tile(a_rows, w_cols, c_ptr, scale_ptr, pair, valid, rn, n_ok, K, stride_cm,
                     MUL_SCALE, BLOCK_M, BLOCK_N, BLOCK_K, PRECISION)


# at most this many (token, pick) pairs take `_moe_few_kernel` (8 tokens at top-8)
FEW_PAIRS = 64


@triton.jit
def _moe_few_kernel(a_ptr, w_ptr, c_ptr, ids_ptr, scale_ptr, N, K, num_pairs, num_experts,
                    rows_per_a, stride_am, stride_we, stride_wn, stride_cm,
                    MUL_SCALE: tl.constexpr, P_PAD: tl.constexpr, BLOCK_N: tl.constexpr,
                    BLOCK_K: tl.constexpr, PRECISION: tl.constexpr):
    """c[pair, n] = a[pair // rows_per_a] @ w[ids[pair]][n, :]^T (times scale[pair]) for the
    column tile `program_id(1)` of every pair whose expert is that of pair `program_id(0)`,
    where that pair is the expert's first (the others' programs return at once); a pick of
    expert `num_experts` (held elsewhere) is skipped."""
    pid = tl.program_id(0)
    pid_n = tl.program_id(1)
    expert = tl.load(ids_ptr + pid)
    if expert >= num_experts:
        return
    p = tl.arange(0, P_PAD)
    ids = tl.load(ids_ptr + p, mask=p < num_pairs, other=num_experts)
    mine = ids == expert
    if tl.min(tl.where(mine, p, P_PAD), axis=0) != pid:
        return
    row = (p // rows_per_a).to(tl.int64)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = rn < N
    a_rows = a_ptr + row[:, None] * stride_am
    w_cols = w_ptr + expert.to(tl.int64) * stride_we + rn.to(tl.int64)[None, :] * stride_wn
    _rows_times_tile(a_rows, w_cols, c_ptr, scale_ptr, p, mine, rn, n_ok, K, stride_cm,
                     MUL_SCALE, P_PAD, BLOCK_N, BLOCK_K, PRECISION)


def align_to_blocks(ids: torch.Tensor, num_experts: int, block_m: int
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(pairs [P + E * (block_m - 1), rounded up to block_m]: the pair indices (token * k +
    pick) sorted by expert, each expert's run padded to a multiple of block_m with `P`;
    the expert of each block; the padded total [1]). Fixed shapes for a given number of
    pairs P, computed on the device."""
    flat = ids.reshape(-1).long()
    p = flat.numel()
    counts = torch.zeros(num_experts, dtype=torch.long, device=flat.device)
    counts.scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts + block_m - 1) // block_m * block_m
    ends = torch.cumsum(padded, 0)
    order = torch.sort(flat, stable=True).indices
    expert = flat[order]
    first = torch.cumsum(counts, 0) - counts  # where each expert's pairs start, unpadded
    dest = (ends - padded)[expert] + torch.arange(p, device=flat.device) - first[expert]
    size = -(-(p + num_experts * (block_m - 1)) // block_m) * block_m
    pairs = torch.full((size,), p, dtype=torch.long, device=flat.device)
    pairs.scatter_(0, dest, order)
    starts = torch.arange(0, size, block_m, device=flat.device)
    block_expert = torch.searchsorted(ends, starts, right=True).clamp_(max=num_experts - 1)
    return pairs, block_expert, ends[-1:]


def _tiles(pairs: int, num_experts: int) -> tuple[int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K): small row blocks while experts see a few tokens each
    (decode), larger ones for prefill. Untuned."""
    if pairs <= 4 * num_experts:
        return 16, 64, 64
    return 64, 128, 64


def _grouped_gemm(a: torch.Tensor, w: torch.Tensor, pairs: torch.Tensor,
                  block_expert: torch.Tensor, total: torch.Tensor, num_pairs: int,
                  rows_per_a: int, tiles: tuple[int, int, int],
                  scale: torch.Tensor | None = None, zeroed: bool = False) -> torch.Tensor:
    bm, bn, bk = tiles
    n, k = w.shape[1], w.shape[2]
    c = (torch.zeros if zeroed else torch.empty)(num_pairs, n, dtype=a.dtype, device=a.device)
    grid = (pairs.numel() // bm, triton.cdiv(n, bn))
    precision = "ieee" if a.dtype == torch.float32 else "tf32"
    _moe_gemm_kernel[grid](a, w, c, pairs, block_expert, total,
                           scale if scale is not None else c, n, k, num_pairs, w.shape[0],
                           rows_per_a,
                           a.stride(0), w.stride(0), w.stride(1), c.stride(0),
                           MUL_SCALE=scale is not None, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk,
                           PRECISION=precision)
    return c


def _few_gemm(a: torch.Tensor, w: torch.Tensor, ids: torch.Tensor, rows_per_a: int,
              scale: torch.Tensor | None = None, zeroed: bool = False,
              block_n: int = 64, block_k: int = 128) -> torch.Tensor:
    """`_moe_few_kernel` over the pairs of ``ids`` [P] (at most `FEW_PAIRS`). Untuned tiles."""
    p, n, k = ids.numel(), w.shape[1], w.shape[2]
    c = (torch.zeros if zeroed else torch.empty)(p, n, dtype=a.dtype, device=a.device)
    precision = "ieee" if a.dtype == torch.float32 else "tf32"
    _moe_few_kernel[(p, triton.cdiv(n, block_n))](
        a, w, c, ids, scale if scale is not None else c, n, k, p, w.shape[0], rows_per_a,
        a.stride(0), w.stride(0), w.stride(1), c.stride(0), MUL_SCALE=scale is not None,
        P_PAD=max(16, triton.next_power_of_2(p)), BLOCK_N=block_n, BLOCK_K=block_k,
        PRECISION=precision)
    return c


def fused_moe(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor,
              weights: torch.Tensor, ids: torch.Tensor,
              silu_mul: Callable[[torch.Tensor], torch.Tensor], elsewhere: bool = False
              ) -> torch.Tensor:
    """The experts' weighted sum [T, hidden] for tokens `x` [T, hidden] routed to `ids`
    [T, k] with `weights` [T, k]; `gate_up` [E, 2I, hidden], `down` [E, hidden, I]. With
    `elsewhere`, an id of E is a pick of an expert held elsewhere: it adds nothing."""
    t, top_k = ids.shape
    if t == 0:
        return torch.zeros_like(x)
    num_experts, p = gate_up.shape[0], t * top_k
    if p <= FEW_PAIRS:
        gemm = functools.partial(_few_gemm, ids=ids.reshape(-1).contiguous())
    else:
        tiles = _tiles(p, num_experts)
        pairs, block_expert, total = align_to_blocks(ids, num_experts + elsewhere, tiles[0])
        gemm = functools.partial(_grouped_gemm, pairs=pairs, block_expert=block_expert,
                                 total=total, num_pairs=p, tiles=tiles)
    h = gemm(x.contiguous(), gate_up.contiguous(), rows_per_a=top_k)
    y = gemm(silu_mul(h).contiguous(), down.contiguous(), rows_per_a=1,
             scale=weights.reshape(-1).contiguous(), zeroed=elsewhere)
    return y.view(t, top_k, -1).sum(dim=1, dtype=torch.float32).to(x.dtype)
