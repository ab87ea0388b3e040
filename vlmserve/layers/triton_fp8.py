"""The product with a block-wise FP8 weight (`fp8.Fp8Weight`) on the GPU.

Up to `_DEQUANT_MIN_ROWS` input rows (decode steps, small prefill chunks) one Triton GEMM
reads the FP8 tiles (half the bytes of bfloat16), converts them to the activations' dtype in
registers and scales each block's partial product by its scale: a weight-bound step reads
half as much. Up to 64 rows it splits K over programs when the column tiles alone would
leave SMs idle (its first GPU run, without splits, decoded 1.8x slower than bfloat16).
Larger inputs are compute-bound: the weight is read back to the activations' dtype once
(one kernel) and cuBLAS multiplies. Both equal `Fp8Weight.dequantize` then `F.linear` up to
the order of the float sums.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from vlmserve.layers.fp8 import Fp8Weight

# from this many input rows on, read the weight back once and let cuBLAS multiply: the
# read-back costs 3 bytes a weight, against ~2 * rows flops a weight of compute (an estimate
# from the H200's bandwidth and bf16 rate, not yet measured)
_DEQUANT_MIN_ROWS = 1024


@triton.jit
def _fp8_matmul_kernel(x_ptr, w_ptr, s_ptr, b_ptr, y_ptr, M, N, K, stride_xm, stride_wn,
                       stride_sn, stride_ym, K_PER_SPLIT, BR: tl.constexpr, BC: tl.constexpr,
                       HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                       BLOCK_K: tl.constexpr, PRECISION: tl.constexpr, SPLIT: tl.constexpr):
    """y[M, N] = x[M, K] @ (w[N, K] * scale)^T (+ bias): BLOCK_K divides the scale block's
    columns BC, so each step's tile has one scale per output column. With SPLIT > 1 program
    (m, n, k) sums the columns [k * K_PER_SPLIT, (k + 1) * K_PER_SPLIT) into its float32 slice
    of y ([SPLIT, M, N]; `_split_sum_kernel` adds them up)."""
    dt = x_ptr.dtype.element_ty
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_k = tl.program_id(2)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_ok = rm < M
    n_ok = rn < N
    x_rows = x_ptr + rm.to(tl.int64)[:, None] * stride_xm
    w_cols = w_ptr + rn.to(tl.int64)[None, :] * stride_wn
    s_rows = s_ptr + (rn // BR) * stride_sn
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    k_start = pid_k * K_PER_SPLIT
    for k0 in range(k_start, tl.minimum(k_start + K_PER_SPLIT, K), BLOCK_K):
        rk = k0 + tl.arange(0, BLOCK_K)
        k_ok = rk < K
        x = tl.load(x_rows + rk[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        w = tl.load(w_cols + rk[:, None], mask=k_ok[:, None] & n_ok[None, :], other=0.0)
        s = tl.load(s_rows + k0 // BC, mask=n_ok, other=0.0)
        acc += tl.dot(x, w.to(dt), input_precision=PRECISION) * s[None, :]
    out = rm.to(tl.int64)[:, None] * stride_ym + rn[None, :]
    if SPLIT == 1:
        if HAS_BIAS:
            acc += tl.load(b_ptr + rn, mask=n_ok, other=0.0).to(tl.float32)[None, :]
        tl.store(y_ptr + out, acc.to(dt), mask=m_ok[:, None] & n_ok[None, :])
    else:
        tl.store(y_ptr + pid_k.to(tl.int64) * M * N + out, acc,
                 mask=m_ok[:, None] & n_ok[None, :])


@triton.jit
def _split_sum_kernel(ws_ptr, b_ptr, y_ptr, MN, N, SPLIT: tl.constexpr,
                      HAS_BIAS: tl.constexpr, BLOCK: tl.constexpr):
    """y[i] = sum over the SPLIT slices of ws[:, i] (+ bias), in y's dtype."""
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = i < MN
    acc = tl.zeros([BLOCK], tl.float32)
    for k in range(SPLIT):
        acc += tl.load(ws_ptr + k * MN + i, mask=ok, other=0.0)
    if HAS_BIAS:
        acc += tl.load(b_ptr + i % N, mask=ok, other=0.0).to(tl.float32)
    tl.store(y_ptr + i, acc.to(y_ptr.dtype.element_ty), mask=ok)


@triton.jit
def _fp8_dequant_kernel(w_ptr, s_ptr, y_ptr, N, K, stride_wn, stride_sn,
                        BR: tl.constexpr, BC: tl.constexpr, BLOCK: tl.constexpr):
    """y[N, K] = w * scale in y's dtype (the product in float32): row n, a BLOCK of columns."""
    n = tl.program_id(0)
    rk = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = rk < K
    w = tl.load(w_ptr + n.to(tl.int64) * stride_wn + rk, mask=ok, other=0.0).to(tl.float32)
    s = tl.load(s_ptr + (n // BR) * stride_sn + rk // BC, mask=ok, other=0.0)
    tl.store(y_ptr + n.to(tl.int64) * K + rk, (w * s).to(y_ptr.dtype.element_ty), mask=ok)


def _config(M: int, N: int, K: int, BC: int, sms: int
            ) -> tuple[int, int, int, int, int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K, warps, stages, splits, columns a split) for ``M`` input
    rows; BLOCK_K divides BC. Up to 64 rows the product is bound by the weight's bytes, so
    narrow column tiles and splits over K give every SM programs (about two each) to read
    with: the qkv, o and down projections of a 2B have only 24-64 column tiles."""
    bk = 128 if BC % 128 == 0 else 64 if BC % 64 == 0 else 32 if BC % 32 == 0 else 16
    if M <= 16:
        bm, bn, warps, stages = 16, 32, 4, 4
    elif M <= 64:
        bm, bn, warps, stages = 64, 64, 4, 4
    else:
        return 128, 128, min(bk, 64), 8, 3, 1, K
    programs = triton.cdiv(M, bm) * triton.cdiv(N, bn)
    k_tiles = triton.cdiv(K, bk)
    split = max(1, min(k_tiles, _MAX_SPLITS, 2 * sms // programs))
    per_split = triton.cdiv(k_tiles, split) * bk
    return bm, bn, bk, warps, stages, triton.cdiv(K, per_split), per_split


_MAX_SPLITS = 16


@functools.cache
def _sm_count(device: torch.device) -> int:
    """The device's SMs; elsewhere (Triton's interpreter) an H100's 132, so the CPU tests
    take the same splits."""
    if device.type != "cuda":
        return 132
    return torch.cuda.get_device_properties(device).multi_processor_count


def dequantize(weight: Fp8Weight, dtype: torch.dtype) -> torch.Tensor:
    """`Fp8Weight.dequantize` in one kernel."""
    q, s = weight.q, weight.scale
    N, K = q.shape
    y = torch.empty(N, K, dtype=dtype, device=q.device)
    block = 1024
    _fp8_dequant_kernel[(N, triton.cdiv(K, block))](
        q, s, y, N, K, q.stride(0), s.stride(0), BR=weight.block[0], BC=weight.block[1],
        BLOCK=block)
    return y


def fp8_linear(x: torch.Tensor, weight: Fp8Weight, bias: torch.Tensor | None = None
               ) -> torch.Tensor:
    """`F.linear(x, weight.dequantize(x.dtype), bias)` without a weight in ``x``'s dtype
    for inputs of up to `_DEQUANT_MIN_ROWS` rows."""
    q, s = weight.q, weight.scale
    N, K = q.shape
    BR, BC = weight.block
    x2 = x.reshape(-1, K)
    M = x2.shape[0]
    if M >= _DEQUANT_MIN_ROWS or BC % 16:
        return F.linear(x, dequantize(weight, x.dtype), bias)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    y = torch.empty(M, N, dtype=x.dtype, device=x.device)
    bm, bn, bk, warps, stages, split, per_split = _config(M, N, K, BC, _sm_count(x.device))
    out = y if split == 1 else torch.empty(split, M, N, dtype=torch.float32, device=x.device)
    has_bias = bias is not None
    _fp8_matmul_kernel[(triton.cdiv(M, bm), triton.cdiv(N, bn), split)](
        x2, q, s, bias if has_bias else s, out, M, N, K, x2.stride(0), q.stride(0),
        s.stride(0), y.stride(0), per_split, BR=BR, BC=BC, HAS_BIAS=has_bias, BLOCK_M=bm,
        BLOCK_N=bn, BLOCK_K=bk, PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
        SPLIT=split, num_warps=warps, num_stages=stages)
    if split > 1:
        block = 1024
        _split_sum_kernel[(triton.cdiv(M * N, block),)](
            out, bias if has_bias else out, y, M * N, N, SPLIT=split, HAS_BIAS=has_bias,
            BLOCK=block)
    return y.view(*x.shape[:-1], N)
