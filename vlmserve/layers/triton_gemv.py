"""Matrix-vector products for decode steps of a few tokens (Triton, CUDA).

At one to four tokens a projection is a pass over its weight; the library GEMM kernels pick
tile shapes for larger problems and reach 25-75% of the memory bandwidth on the small
projections of a 2B model (measured on the H200, docs/benchmarks.md). `gemv` streams the weight
once with enough programs to fill the GPU, each owning a few output rows.

Nothing is assumed faster: `tune_linears` times the candidates against `F.linear` for every
weight shape and token count of a model once at start-up (before CUDA-graph capture) and
`linear` uses a Triton configuration only where it won.
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

logger = logging.getLogger(__name__)

MAX_TOKENS = 4  # rows of x up to which a GEMV is considered
# (BLOCK_N, BLOCK_K, num_warps) candidates
CONFIGS = [(4, 512, 4), (8, 256, 4), (8, 512, 4), (16, 256, 4), (16, 128, 4), (32, 128, 4),
           (4, 1024, 8)]

# (tokens, out_features, in_features, dtype) -> winning config, or None for F.linear
_choice: dict[tuple[int, int, int, torch.dtype], tuple[int, int, int] | None] = {}


@triton.jit
def _gemv_kernel(x_ptr, w_ptr, b_ptr, y_ptr, M, N, K, stride_xm, stride_wn, stride_ym,
                 HAS_BIAS: tl.constexpr, M_PAD: tl.constexpr, BLOCK_N: tl.constexpr,
                 BLOCK_K: tl.constexpr):
    """y[m, n] = sum_k x[m, k] w[n, k] (+ b[n]); one program per BLOCK_N output features."""
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = tl.arange(0, M_PAD)
    n_ok = offs_n < N
    m_ok = offs_m < M
    acc = tl.zeros([M_PAD, BLOCK_N], tl.float32)
    w_rows = w_ptr + offs_n.to(tl.int64)[:, None] * stride_wn
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_ok = offs_k < K
        w = tl.load(w_rows + offs_k[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0.0)
        x = tl.load(x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :],
                    mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        acc += tl.sum(x.to(tl.float32)[:, None, :] * w.to(tl.float32)[None, :, :], axis=2)
    if HAS_BIAS:
        acc += tl.load(b_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    tl.store(y_ptr + offs_m[:, None] * stride_ym + offs_n[None, :],
             acc.to(y_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


def gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
         config: tuple[int, int, int]) -> torch.Tensor:
    """x [M <= MAX_TOKENS, K] (rows contiguous) @ weight[N, K].T (+ bias) -> [M, N]."""
    M, K = x.shape
    N = weight.shape[0]
    assert M <= MAX_TOKENS and x.stride(-1) == 1 and weight.stride(-1) == 1
    block_n, block_k, warps = config
    y = torch.empty(M, N, dtype=x.dtype, device=x.device)
    _gemv_kernel[(triton.cdiv(N, block_n),)](
        x, weight, bias if bias is not None else weight, y, M, N, K, x.stride(0),
        weight.stride(0), y.stride(0), HAS_BIAS=bias is not None,
        M_PAD=triton.next_power_of_2(M), BLOCK_N=block_n, BLOCK_K=block_k, num_warps=warps)
    return y


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
           ) -> torch.Tensor:
    """`F.linear`, or the tuned GEMV for a decode step of a few tokens."""
    if x.dim() == 2 and x.shape[0] <= MAX_TOKENS and x.stride(-1) == 1:
        config = _choice.get((x.shape[0], weight.shape[0], weight.shape[1], x.dtype))
        if config is not None:
            return gemv(x, weight, bias, config)
    return F.linear(x, weight, bias)


def _time_ms(fn, iters: int = 30) -> float:
    for _ in range(3):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / iters


def _fastest(x, w, b) -> tuple[tuple[int, int, int] | None, float]:
    """The GEMV config at least 3% faster than F.linear (or None), and its speed-up."""
    base = _time_ms(lambda: F.linear(x, w, b))
    best, best_ms = None, base
    for cfg in CONFIGS:
        ms = _time_ms(lambda cfg=cfg: gemv(x, w, b, cfg))
        if ms < best_ms * 0.97:
            best, best_ms = cfg, ms
    return best, base / best_ms


@torch.inference_mode()
def tune_linears(module: torch.nn.Module, token_counts=(1, 2, 4)) -> dict:
    """Choose, per (tokens, weight shape), the fastest of `F.linear` and the GEMV configs
    for the weight of every layer of `module` that computes through `ops.linear`.
    Returns {(tokens, out, in): (config or None, speed-up over F.linear)}."""
    report = {}
    seen = set()
    for layer in module.modules():
        w = getattr(layer, "weight", None)
        if not hasattr(layer, "ops") or w is None or w.dim() != 2 or not w.is_cuda:
            continue
        b = getattr(layer, "bias", None)
        for m in token_counts:
            key = (m, w.shape[0], w.shape[1], w.dtype)
            if key in seen:
                continue
            seen.add(key)
            x = torch.randn(m, w.shape[1], device=w.device, dtype=w.dtype)
            _choice[key], speedup = _fastest(x, w, b)
            report[key[:3]] = (_choice[key], speedup)
    logger.info("decode GEMV choices (tokens, out, in) -> (config, speed-up vs F.linear): %s",
                report)
    return report


__all__ = ["MAX_TOKENS", "gemv", "linear", "tune_linears"]
