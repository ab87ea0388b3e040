"""Triton kernels for the decoder's elementwise pieces: one launch each instead of ~8.

Same contracts as the eager functions in `layers/fused.py` (which they replace through
`FusedOps("triton")`): RMSNorm computed in float32, cast to the activation dtype, then scaled
by the weight; the residual sum stored in the activation dtype; SiLU(gate) cast before the
product with `up`; rotary applied in place to the q and k views of the fused QKV output.
Rows are addressed through their strides, so views need no copies.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rms_norm_kernel(x_ptr, res_ptr, w_ptr, out_ptr, sum_ptr, stride_x, stride_r, stride_o,
                     stride_s, n_cols, eps, HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    ok = cols < n_cols
    x = tl.load(x_ptr + row * stride_x + cols, mask=ok, other=0.0)
    if HAS_RESIDUAL:
        x = (x.to(tl.float32) + tl.load(res_ptr + row * stride_r + cols, mask=ok,
                                        other=0.0).to(tl.float32)).to(sum_ptr.dtype.element_ty)
        tl.store(sum_ptr + row * stride_s + cols, x, mask=ok)
    xf = x.to(tl.float32)
    inv = tl.rsqrt(tl.sum(xf * xf, axis=0) / n_cols + eps)
    y = (xf * inv).to(out_ptr.dtype.element_ty).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=ok, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_o + cols, (y * w).to(out_ptr.dtype.element_ty), mask=ok)


def _rows(x: torch.Tensor) -> torch.Tensor:
    return x if x.dim() == 2 and x.stride(-1) == 1 else x.reshape(-1, x.shape[-1])


def _norm(x, residual, weight, eps):
    x2 = _rows(x)
    n_rows, n_cols = x2.shape
    out = torch.empty(n_rows, n_cols, dtype=x.dtype, device=x.device)
    total = torch.empty_like(out) if residual is not None else out
    r2 = _rows(residual) if residual is not None else x2
    if n_rows:
        block = triton.next_power_of_2(n_cols)
        _rms_norm_kernel[(n_rows,)](
            x2, r2, weight, out, total, x2.stride(0), r2.stride(0), out.stride(0),
            total.stride(0), n_cols, eps, HAS_RESIDUAL=residual is not None, BLOCK=block,
            num_warps=min(max(block // 256, 1), 8))
    return out.view(x.shape), total.view(x.shape)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return _norm(x, None, weight, eps)[0]


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    return _norm(x, residual, weight, eps)


@triton.jit
def _silu_mul_kernel(x_ptr, out_ptr, stride_x, stride_o, n_cols, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < n_cols
    gate = tl.load(x_ptr + row * stride_x + cols, mask=ok, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * stride_x + n_cols + cols, mask=ok, other=0.0).to(tl.float32)
    act = (gate * tl.sigmoid(gate)).to(out_ptr.dtype.element_ty).to(tl.float32)
    tl.store(out_ptr + row * stride_o + cols, (act * up).to(out_ptr.dtype.element_ty), mask=ok)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    x2 = _rows(gate_up)
    n_rows, n = x2.shape[0], x2.shape[1] // 2
    out = torch.empty(n_rows, n, dtype=gate_up.dtype, device=gate_up.device)
    block = min(triton.next_power_of_2(n), 1024)
    if n_rows:
        _silu_mul_kernel[(n_rows, triton.cdiv(n, block))](
            x2, out, x2.stride(0), out.stride(0), n, BLOCK=block, num_warps=4)
    return out.view(*gate_up.shape[:-1], n)


@triton.jit
def _rotary_kernel(q_ptr, k_ptr, cos_ptr, sin_ptr, stride_qt, stride_qh, stride_kt, stride_kh,
                   stride_c, num_q_heads, HALF: tl.constexpr, HALF_PAD: tl.constexpr):
    """One program per (token, head) over q heads then k heads; rotate-half in place."""
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    if h < num_q_heads:
        base = q_ptr + t * stride_qt + h * stride_qh
    else:
        base = k_ptr + t * stride_kt + (h - num_q_heads) * stride_kh
    d = tl.arange(0, HALF_PAD)
    ok = d < HALF
    dtype = q_ptr.dtype.element_ty
    x1 = tl.load(base + d, mask=ok, other=0.0).to(tl.float32)
    x2 = tl.load(base + HALF + d, mask=ok, other=0.0).to(tl.float32)
    cos = tl.load(cos_ptr + t * stride_c + d, mask=ok, other=0.0).to(tl.float32)
    sin = tl.load(sin_ptr + t * stride_c + d, mask=ok, other=0.0).to(tl.float32)
    tl.store(base + d, (x1 * cos - x2 * sin).to(dtype), mask=ok)
    tl.store(base + HALF + d, (x2 * cos + x1 * sin).to(dtype), mask=ok)


def rotary_qk(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """q: [T, H, D], k: [T, Hkv, D] (strided views, last dim contiguous), cos/sin: [T, D]
    whose two halves are equal (`MRotaryEmbedding.cos_sin`). Rotates q and k in place."""
    T, H, D = q.shape
    assert q.stride(-1) == 1 and k.stride(-1) == 1 and cos.stride(-1) == 1
    if T:
        half = D // 2
        _rotary_kernel[(T, H + k.shape[1])](
            q, k, cos, sin, q.stride(0), q.stride(1), k.stride(0), k.stride(1), cos.stride(0),
            H, HALF=half, HALF_PAD=triton.next_power_of_2(half), num_warps=1)
    return q, k


__all__ = ["add_rms_norm", "rms_norm", "rotary_qk", "silu_mul"]
