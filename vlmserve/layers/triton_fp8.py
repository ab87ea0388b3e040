"""The product with a block-wise FP8 weight (`fp8.Fp8Weight`) on the GPU.

Up to `_DEQUANT_MIN_ROWS` input rows (decode steps, small prefill chunks) one Triton GEMM
reads the FP8 tiles (half the bytes of bfloat16), converts them to the activations' dtype in
registers and scales each block's partial product by its scale: a weight-bound step reads
half as much. Larger inputs are compute-bound: the weight is read back to the activations'
dtype once (one kernel) and cuBLAS multiplies. Both equal `Fp8Weight.dequantize` then
`F.linear` up to the order of the float sums.
"""

from __future__ import annotations

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
                       stride_sn, stride_ym, BR: tl.constexpr, BC: tl.constexpr,
                       HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                       BLOCK_K: tl.constexpr, PRECISION: tl.constexpr):
    """y[M, N] = x[M, K] @ (w[N, K] * scale)^T (+ bias): BLOCK_K divides the scale block's
    columns BC, so each step's tile has one scale per output column."""
    dt = x_ptr.dtype.element_ty
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_ok = rm < M
    n_ok = rn < N
    x_rows = x_ptr + rm.to(tl.int64)[:, None] * stride_xm
    w_cols = w_ptr + rn.to(tl.int64)[None, :] * stride_wn
    s_rows = s_ptr + (rn // BR) * stride_sn
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        rk = k0 + tl.arange(0, BLOCK_K)
        k_ok = rk < K
        x = tl.load(x_rows + rk[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        w = tl.load(w_cols + rk[:, None], mask=k_ok[:, None] & n_ok[None, :], other=0.0)
        s = tl.load(s_rows + k0 // BC, mask=n_ok, other=0.0)
        acc += tl.dot(x, w.to(dt), input_precision=PRECISION) * s[None, :]
    if HAS_BIAS:
        acc += tl.load(b_ptr + rn, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    tl.store(y_ptr + rm.to(tl.int64)[:, None] * stride_ym + rn[None, :], acc.to(dt),
             mask=m_ok[:, None] & n_ok[None, :])


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


def _config(M: int, BC: int) -> tuple[int, int, int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K, warps, stages) for ``M`` input rows; BLOCK_K divides BC."""
    bk = 128 if BC % 128 == 0 else 64 if BC % 64 == 0 else 32 if BC % 32 == 0 else 16
    if M <= 16:
        return 16, 64, bk, 4, 4
    if M <= 64:
        return 64, 64, bk, 4, 4
    return 128, 128, min(bk, 64), 8, 3


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
    bm, bn, bk, warps, stages = _config(M, BC)
    _fp8_matmul_kernel[(triton.cdiv(M, bm), triton.cdiv(N, bn))](
        x2, q, s, bias if bias is not None else s, y, M, N, K, x2.stride(0), q.stride(0),
        s.stride(0), y.stride(0), BR=BR, BC=BC, HAS_BIAS=bias is not None, BLOCK_M=bm,
        BLOCK_N=bn, BLOCK_K=bk, PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
        num_warps=warps, num_stages=stages)
    return y.view(*x.shape[:-1], N)
