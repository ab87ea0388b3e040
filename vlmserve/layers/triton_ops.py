"""Triton kernels for the decoder's elementwise pieces: one launch each instead of ~8.

Same contracts as the eager functions in `layers/fused.py` (which they replace through
`FusedOps("triton")`): RMSNorm computed in float32, cast to the activation dtype, then scaled
by the weight; LayerNorm in float32 throughout; the residual sum stored in the activation
dtype; SiLU(gate) cast before the product with `up`; rotary applied in place to the q and k
views of the fused QKV output. Rows are addressed through their strides, so views need no
copies. The one-token GEMV is documented where it is defined.
"""

from __future__ import annotations

import sys

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from vlmserve.layers import kv_quant
from vlmserve.layers.fp8 import Fp8Weight
from vlmserve.layers.fused import compose_rms_norm_linear, compose_rms_norm_qkv_rope
from vlmserve.layers.triton_fp8 import fp8_linear


@triton.jit
def _norm_kernel(x_ptr, res_ptr, w_ptr, b_ptr, out_ptr, sum_ptr, stride_x, stride_r, stride_o,
                 stride_s, n_cols, eps, HAS_RESIDUAL: tl.constexpr, LAYER: tl.constexpr,
                 BLOCK: tl.constexpr):
    """RMSNorm (float32, cast, then weight) or LayerNorm (float32 throughout, as torch's),
    of x or of x + residual (the sum also stored)."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    ok = cols < n_cols
    x = tl.load(x_ptr + row * stride_x + cols, mask=ok, other=0.0)
    if HAS_RESIDUAL:
        x = (x.to(tl.float32) + tl.load(res_ptr + row * stride_r + cols, mask=ok,
                                        other=0.0).to(tl.float32)).to(sum_ptr.dtype.element_ty)
        tl.store(sum_ptr + row * stride_s + cols, x, mask=ok)
    xf = x.to(tl.float32)
    w = tl.load(w_ptr + cols, mask=ok, other=0.0).to(tl.float32)
    if LAYER:
        xc = tl.where(ok, xf - tl.sum(xf, axis=0) / n_cols, 0.0)
        inv = tl.rsqrt(tl.sum(xc * xc, axis=0) / n_cols + eps)
        y = xc * inv * w + tl.load(b_ptr + cols, mask=ok, other=0.0).to(tl.float32)
    else:
        inv = tl.rsqrt(tl.sum(xf * xf, axis=0) / n_cols + eps)
        y = (xf * inv).to(out_ptr.dtype.element_ty).to(tl.float32) * w
    tl.store(out_ptr + row * stride_o + cols, y.to(out_ptr.dtype.element_ty), mask=ok)


def _rows(x: torch.Tensor) -> torch.Tensor:
    return x if x.dim() == 2 and x.stride(-1) == 1 else x.reshape(-1, x.shape[-1])


def _norm(x, residual, weight, bias, eps):
    x2 = _rows(x)
    n_rows, n_cols = x2.shape
    out = torch.empty(n_rows, n_cols, dtype=x.dtype, device=x.device)
    total = torch.empty_like(out) if residual is not None else out
    r2 = _rows(residual) if residual is not None else x2
    if n_rows:
        block = triton.next_power_of_2(n_cols)
        _norm_kernel[(n_rows,)](
            x2, r2, weight, weight if bias is None else bias, out, total, x2.stride(0),
            r2.stride(0), out.stride(0), total.stride(0), n_cols, eps,
            HAS_RESIDUAL=residual is not None, LAYER=bias is not None, BLOCK=block,
            num_warps=min(max(block // 256, 1), 8))
    return out.view(x.shape), total.view(x.shape)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return _norm(x, None, weight, None, eps)[0]


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    return _norm(x, residual, weight, None, eps)


def layer_norm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float
               ) -> torch.Tensor:
    return _norm(x, None, weight, bias, eps)[0]


def add_layer_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                   bias: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    return _norm(x, residual, weight, bias, eps)


@triton.jit
def _gemv_input(x_ptr, r_ptr, nw_ptr, s_ptr, ks, k_ok, store_sum, HAS_RES: tl.constexpr,
                NORM: tl.constexpr):
    """A K tile of the GEMV input in float32 and its squares (for the norm): x, or x +
    residual rounded to x's dtype (stored to s where `store_sum`); with NORM, times the norm
    weight (the 1/rms scale comes after the product)."""
    x = tl.load(x_ptr + ks, mask=k_ok, other=0.0)
    if HAS_RES:
        x = (x.to(tl.float32) + tl.load(r_ptr + ks, mask=k_ok, other=0.0).to(tl.float32)
             ).to(x_ptr.dtype.element_ty)
        if store_sum:  # (a scalar branch: Triton's interpreter takes no scalar in a mask)
            tl.store(s_ptr + ks, x, mask=k_ok)
    x = x.to(tl.float32)
    sq = x * x
    if NORM:
        x = x * tl.load(nw_ptr + ks, mask=k_ok, other=0.0).to(tl.float32)
    return x, sq


@triton.jit
def _gemv_kernel(x_ptr, r_ptr, nw_ptr, w_ptr, b_ptr, y_ptr, s_ptr, ws_ptr, N, stride_w,
                 stride_ws, eps, K: tl.constexpr, NORM: tl.constexpr, HAS_RES: tl.constexpr,
                 HAS_BIAS: tl.constexpr, GATED: tl.constexpr, BN: tl.constexpr,
                 BK: tl.constexpr, NUM_K: tl.constexpr, FP8: tl.constexpr, BR: tl.constexpr,
                 BC: tl.constexpr):
    """y[n] = sum_k w[n, k] x[k] (+ b[n]) for BN rows; the K loop is unrolled so that every
    load of the row is in flight at once.

    NORM: the input is rms_norm(x (+ residual)) with weight nw. The sum of squares is
    gathered in the same pass as the product, whose scale 1/rms is applied at the end, so
    the weight loads never wait on the norm; program 0 stores the sum x + residual (rounded
    to the activation dtype, as the input is) to s. HAS_RES needs NORM. Unlike the separate
    kernels, the normed input is not rounded to the activation dtype before the product
    (bf16: about a unit in the last place; the GPU tests bound it). GATED: rows n and N + n
    are gate and up, y[n] = silu(gate) * up, each rounded as the separate kernels do. FP8:
    w holds float8 values, each block of BR rows x BC columns times its scale in ws (half
    the bytes of a 16-bit weight read; the products in float32)."""
    dt = y_ptr.dtype.element_ty
    rows = tl.program_id(0) * BN + tl.arange(0, BN)
    r_ok = rows < N
    w_rows = w_ptr + rows.to(tl.int64)[:, None] * stride_w
    acc = tl.zeros([BN, BK], tl.float32)
    acc_up = tl.zeros([BN, BK], tl.float32)
    sq = tl.zeros([BK], tl.float32)
    for i in tl.static_range(0, NUM_K):
        ks = i * BK + tl.arange(0, BK)
        k_ok = ks < K
        w_ok = r_ok[:, None] & k_ok[None, :]
        w = tl.load(w_rows + ks[None, :], mask=w_ok, other=0.0).to(tl.float32)
        if GATED:
            w_up = tl.load(w_rows + N * stride_w + ks[None, :], mask=w_ok, other=0.0
                           ).to(tl.float32)
        if FP8:
            w *= tl.load(ws_ptr + (rows // BR)[:, None] * stride_ws + (ks // BC)[None, :],
                         mask=w_ok, other=0.0)
            if GATED:
                w_up *= tl.load(ws_ptr + ((rows + N) // BR)[:, None] * stride_ws
                                + (ks // BC)[None, :], mask=w_ok, other=0.0)
        x, x2 = _gemv_input(x_ptr, r_ptr, nw_ptr, s_ptr, ks, k_ok, tl.program_id(0) == 0,
                            HAS_RES, NORM)
        if NORM:
            sq += x2
        acc += w * x[None, :]
        if GATED:
            acc_up += w_up * x[None, :]
    y = tl.sum(acc, axis=1)
    if NORM:
        inv = tl.rsqrt(tl.sum(sq, axis=0) / K + eps)
        y = y * inv
    if HAS_BIAS:
        y += tl.load(b_ptr + rows, mask=r_ok, other=0.0).to(tl.float32)
    if GATED:
        gate = y.to(dt).to(tl.float32)
        up = tl.sum(acc_up, axis=1)
        if NORM:
            up = up * inv
        up = up.to(dt).to(tl.float32)
        y = (gate * tl.sigmoid(gate)).to(dt).to(tl.float32) * up
    tl.store(y_ptr + rows, y.to(dt), mask=r_ok)


# Rows of the output per program, K tile, warps; measured on the H200 with weights cold (28
# layers' worth replayed in one CUDA graph): one row per program with K unrolled beat cuBLAS
# at every 2B and 7B projection (docs/benchmarks.md).
def _gemv_config(K: int) -> tuple[int, int, int]:
    return (1, 2048, 8) if 2048 < K <= 4096 else (1, 512, 4)


_GEMV_MAX_OUT = 65536  # wider outputs (lm_head) stay on cuBLAS, which streams them at ~4 TB/s


def _gemv_fits(x: torch.Tensor, weight: torch.Tensor | Fp8Weight) -> bool:
    """One token, contiguous rows, an output narrow enough for the GEMV."""
    w = weight.q if isinstance(weight, Fp8Weight) else weight
    return (x.numel() == x.shape[-1] and w.shape[0] <= _GEMV_MAX_OUT
            and x.stride(-1) == 1 and w.stride(-1) == 1)


def _gemv(x, weight, bias, n_out, residual=None, norm_weight=None, eps=0.0, gated=False):
    fp8 = isinstance(weight, Fp8Weight)
    w, scale = (weight.q, weight.scale) if fp8 else (weight, weight)
    br, bc = weight.block if fp8 else (1, 1)
    K = w.shape[1]
    y = torch.empty(*x.shape[:-1], n_out, dtype=x.dtype, device=x.device)
    total = torch.empty_like(x) if residual is not None else x
    bn, bk, warps = _gemv_config(K)
    _gemv_kernel[(triton.cdiv(n_out, bn),)](
        x, residual if residual is not None else x, norm_weight if norm_weight is not None
        else x, w, bias if bias is not None else x, y, total, scale, n_out, w.stride(0),
        scale.stride(0), eps, K=K, NORM=norm_weight is not None, HAS_RES=residual is not None,
        HAS_BIAS=bias is not None, GATED=gated, BN=bn, BK=bk, NUM_K=triton.cdiv(K, bk),
        FP8=fp8, BR=br, BC=bc, num_warps=warps)
    return y, total


def linear(x: torch.Tensor, weight: torch.Tensor | Fp8Weight,
           bias: torch.Tensor | None = None) -> torch.Tensor:
    """`F.linear`, through the GEMV above for a single token (a decode step at batch 1);
    more tokens with an FP8 weight through `triton_fp8.fp8_linear`."""
    if not _gemv_fits(x, weight):
        return fp8_linear(x, weight, bias) if isinstance(weight, Fp8Weight) else F.linear(
            x, weight, bias)
    return _gemv(x, weight, bias, weight.shape[0])[0]


# The norm folded into the GEMV costs every program a read of the input, residual and norm
# weight. Measured on the H200 at batch 1 (28 layers in a CUDA graph): 2B (in 1536) 1.51 vs
# 1.52 ms per step with the separate kernels, 7B (in 3584) 4.46 vs 4.05 ms; so only up to:
_NORM_GEMV_MAX_IN = 2048


def rms_norm_linear(x: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor,
                    eps: float, weight: torch.Tensor, bias: torch.Tensor | None = None,
                    gated_silu: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """`fused.rms_norm_linear`: for a single token and a narrow input one GEMV launch with
    the residual add and the norm in front and SiLU-and-mul behind; otherwise the separate
    kernels."""
    if weight.shape[1] > _NORM_GEMV_MAX_IN or not _gemv_fits(x, weight) \
            or (residual is not None and residual.stride(-1) != 1) \
            or (gated_silu and bias is not None):
        return compose_rms_norm_linear(sys.modules[__name__], x, residual, norm_weight, eps,
                                       weight, bias, gated_silu)
    n_out = weight.shape[0] // 2 if gated_silu else weight.shape[0]
    return _gemv(x, weight, bias, n_out, residual, norm_weight, eps, gated_silu)


@triton.jit
def _scaled(x, scale, FP8_KV: tl.constexpr):
    """`x` before its cast to the cache's dtype: for an FP8 cache ``x / scale`` clamped to
    e4m3's range (the cast rounds to nearest even)."""
    if FP8_KV:
        x = tl.minimum(tl.maximum(x.to(tl.float32) / scale, -448.0), 448.0)
    return x


@triton.jit
def _qkv_rope_kernel(x_ptr, r_ptr, nw_ptr, w_ptr, b_ptr, y_ptr, s_ptr, cos_ptr, sin_ptr,
                     cache_ptr, slot_ptr, kv_scales_ptr, stride_w, eps, plane, num_q_heads,
                     num_kv_heads, K: tl.constexpr, HAS_RES: tl.constexpr,
                     HAS_BIAS: tl.constexpr, HALF: tl.constexpr, BK: tl.constexpr,
                     NUM_K: tl.constexpr, FP8_KV: tl.constexpr):
    """One token: rms_norm(x (+ residual)) -> QKV projection (+ bias) -> rotate-half on the
    q and k heads -> k and v to the token's paged-cache slot. Program p owns rows d and
    d + HALF of head p // HALF (d = p % HALF), the pair that rotary mixes. The projection is
    rounded to the activation dtype before the rotation, as when the separate kernels store
    it; the norm is applied as in `_gemv_kernel` (1/rms after the product). FP8_KV: the
    cache takes k / k_scale and v / v_scale in e4m3 (`kv_scales_ptr`: [2] float32)."""
    dt = y_ptr.dtype.element_ty
    p = tl.program_id(0)
    head = p // HALF
    d = p % HALF
    row = head * (2 * HALF) + d
    w_a = w_ptr + row.to(tl.int64) * stride_w
    w_b = w_a + HALF * stride_w
    acc_a = tl.zeros([BK], tl.float32)
    acc_b = tl.zeros([BK], tl.float32)
    sq = tl.zeros([BK], tl.float32)
    for i in tl.static_range(0, NUM_K):
        ks = i * BK + tl.arange(0, BK)
        k_ok = ks < K
        wa = tl.load(w_a + ks, mask=k_ok, other=0.0)
        wb = tl.load(w_b + ks, mask=k_ok, other=0.0)
        x, x2 = _gemv_input(x_ptr, r_ptr, nw_ptr, s_ptr, ks, k_ok, p == 0, HAS_RES, True)
        sq += x2
        acc_a += wa.to(tl.float32) * x
        acc_b += wb.to(tl.float32) * x
    inv = tl.rsqrt(tl.sum(sq, axis=0) / K + eps)
    ya = tl.sum(acc_a, axis=0) * inv
    yb = tl.sum(acc_b, axis=0) * inv
    if HAS_BIAS:
        ya += tl.load(b_ptr + row).to(tl.float32)
        yb += tl.load(b_ptr + row + HALF).to(tl.float32)
    ya = ya.to(dt).to(tl.float32)
    yb = yb.to(dt).to(tl.float32)
    c = tl.load(cos_ptr + d).to(tl.float32)
    sn = tl.load(sin_ptr + d).to(tl.float32)
    rotate = head < num_q_heads + num_kv_heads  # q and k heads; v heads pass through
    out_a = tl.where(rotate, ya * c - yb * sn, ya).to(dt)
    out_b = tl.where(rotate, yb * c + ya * sn, yb).to(dt)
    tl.store(y_ptr + row, out_a)
    tl.store(y_ptr + row + HALF, out_b)
    # cache [2, slots, kv_heads, 2 * HALF]: k heads to plane 0, v heads to plane 1
    kv = head - num_q_heads
    to_cache = kv >= 0
    is_v = kv >= num_kv_heads
    g = tl.where(is_v, kv - num_kv_heads, kv)
    slot = tl.load(slot_ptr).to(tl.int64)
    dst = (cache_ptr + tl.where(is_v, plane, 0) + (slot * num_kv_heads + g) * (2 * HALF) + d)
    ty = cache_ptr.dtype.element_ty
    scale = tl.load(kv_scales_ptr + is_v.to(tl.int32)) if FP8_KV else 1.0
    tl.store(dst, _scaled(out_a, scale, FP8_KV).to(ty), mask=to_cache)
    tl.store(dst + HALF, _scaled(out_b, scale, FP8_KV).to(ty), mask=to_cache)


def rms_norm_qkv_rope(x: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor,
                      eps: float, weight: torch.Tensor, bias: torch.Tensor | None, heads: int,
                      kv_heads: int, cos: torch.Tensor, sin: torch.Tensor,
                      kv_cache: torch.Tensor, slots: torch.Tensor,
                      kv_scales: torch.Tensor | None = None
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    """`fused.rms_norm_qkv_rope`: for a single token and a narrow 16-bit input one launch
    (norm, QKV GEMV, rotary, KV write); otherwise `rms_norm_linear` (an FP8 weight's GEMV at
    one token) and the rotary kernel."""
    n_out, K = weight.shape
    d = n_out // (heads + 2 * kv_heads)
    if K > _NORM_GEMV_MAX_IN or isinstance(weight, Fp8Weight) or not _gemv_fits(x, weight) \
            or x.shape[0] != 1 or d % 2 \
            or (residual is not None and residual.stride(-1) != 1) \
            or cos.stride(-1) != 1 or sin.stride(-1) != 1 or not kv_cache.is_contiguous():
        return compose_rms_norm_qkv_rope(sys.modules[__name__], x, residual, norm_weight, eps,
                                         weight, bias, heads, kv_heads, cos, sin, kv_cache,
                                         slots, kv_scales)
    y = torch.empty(1, n_out, dtype=x.dtype, device=x.device)
    total = torch.empty_like(x) if residual is not None else x
    _, bk, warps = _gemv_config(K)
    _qkv_rope_kernel[(n_out // 2,)](
        x, residual if residual is not None else x, norm_weight, weight,
        bias if bias is not None else weight, y, total, cos, sin, kv_cache, slots,
        _cache_scales(kv_cache, kv_scales, slots), weight.stride(0), eps, kv_cache[0].numel(),
        heads, kv_heads, K=K, HAS_RES=residual is not None, HAS_BIAS=bias is not None,
        HALF=d // 2, BK=bk, NUM_K=triton.cdiv(K, bk), FP8_KV=kv_quant.is_fp8(kv_cache),
        num_warps=warps)
    return y[:, :heads * d].view(1, heads, d), total


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
def _quick_gelu_kernel(x_ptr, out_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < n
    x = tl.load(x_ptr + offs, mask=ok, other=0.0).to(tl.float32)
    tl.store(out_ptr + offs, (x * tl.sigmoid(1.702 * x)).to(out_ptr.dtype.element_ty), mask=ok)


def quick_gelu(x: torch.Tensor) -> torch.Tensor:
    x = x.contiguous()
    out = torch.empty_like(x)
    if x.numel():
        _quick_gelu_kernel[(triton.cdiv(x.numel(), 2048),)](x, out, x.numel(), BLOCK=2048,
                                                             num_warps=8)
    return out


@triton.jit
def _rotate_heads(base, stride_h, num_heads, cos, sin, HEADS: tl.constexpr, HALF: tl.constexpr,
                  HALF_PAD: tl.constexpr):
    """Rotate-half in place on `num_heads` heads at `base` ([HEADS, HALF_PAD] tile); returns
    the rotated halves (in the tensor's dtype) and the tile mask."""
    h = tl.arange(0, HEADS)
    d = tl.arange(0, HALF_PAD)
    ok = (h[:, None] < num_heads) & (d[None, :] < HALF)
    ptr = base + h[:, None] * stride_h + d[None, :]
    x1 = tl.load(ptr, mask=ok, other=0.0).to(tl.float32)
    x2 = tl.load(ptr + HALF, mask=ok, other=0.0).to(tl.float32)
    dtype = base.dtype.element_ty
    y1 = (x1 * cos[None, :] - x2 * sin[None, :]).to(dtype)
    y2 = (x2 * cos[None, :] + x1 * sin[None, :]).to(dtype)
    tl.store(ptr, y1, mask=ok)
    tl.store(ptr + HALF, y2, mask=ok)
    return y1, y2, ok


@triton.jit
def _rotary_cache_kernel(q_ptr, k_ptr, v_ptr, cos_ptr, sin_ptr, cache_ptr, slot_ptr,
                         kv_scales_ptr, stride_qt, stride_qh, stride_kt, stride_kh, stride_vt,
                         stride_vh, stride_c, plane, num_q_heads, num_kv_heads,
                         WRITE_CACHE: tl.constexpr, Q_HEADS: tl.constexpr,
                         KV_HEADS: tl.constexpr, HALF: tl.constexpr, HALF_PAD: tl.constexpr,
                         FP8_KV: tl.constexpr = False):
    """One program per token, all its q and k heads: rotate-half in place; with WRITE_CACHE
    the rotated keys and the values also go to the token's cache slot (FP8_KV: divided by
    their scales, `kv_scales_ptr`, in e4m3)."""
    t = tl.program_id(0).to(tl.int64)
    d = tl.arange(0, HALF_PAD)
    cos = tl.load(cos_ptr + t * stride_c + d, mask=d < HALF, other=0.0).to(tl.float32)
    sin = tl.load(sin_ptr + t * stride_c + d, mask=d < HALF, other=0.0).to(tl.float32)
    _rotate_heads(q_ptr + t * stride_qt, stride_qh, num_q_heads, cos, sin, Q_HEADS, HALF,
                  HALF_PAD)
    k1, k2, ok = _rotate_heads(k_ptr + t * stride_kt, stride_kh, num_kv_heads, cos, sin,
                               KV_HEADS, HALF, HALF_PAD)
    if WRITE_CACHE:  # cache [2, slots, kv_heads, 2 * HALF]; plane = K's size
        h = tl.arange(0, KV_HEADS)
        dst = (cache_ptr + (tl.load(slot_ptr + t) * num_kv_heads + h[:, None]) * (2 * HALF)
               + d[None, :])
        ty = cache_ptr.dtype.element_ty
        k_scale = tl.load(kv_scales_ptr) if FP8_KV else 1.0
        v_scale = tl.load(kv_scales_ptr + 1) if FP8_KV else 1.0
        tl.store(dst, _scaled(k1, k_scale, FP8_KV).to(ty), mask=ok)
        tl.store(dst + HALF, _scaled(k2, k_scale, FP8_KV).to(ty), mask=ok)
        src = v_ptr + t * stride_vt + h[:, None] * stride_vh + d[None, :]
        for part in tl.static_range(2):
            val = tl.load(src + part * HALF, mask=ok, other=0.0)
            tl.store(dst + plane + part * HALF, _scaled(val, v_scale, FP8_KV).to(ty), mask=ok)


def rotary_qk(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """q: [T, H, D], k: [T, Hkv, D] (strided views, last dim contiguous), cos/sin: [T, D]
    whose two halves are equal (`MRotaryEmbedding.cos_sin`). Rotates q and k in place."""
    _launch_rotary(q, k, None, cos, sin, None, None)
    return q, k


def rotary_qk_float32(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    """The kernel always computes in float32 and rounds once: the vision convention too."""
    return rotary_qk(q, k, cos, sin)


def rotary_qk_cache(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor,
                    sin: torch.Tensor, kv_cache: torch.Tensor, slots: torch.Tensor,
                    kv_scales: torch.Tensor | None = None) -> torch.Tensor:
    """`rotary_qk`, then the rotated k and v written to `kv_cache` [2, blocks, block_size,
    kv_heads, D] at `slots` [T] (an FP8 cache's quantized by `kv_scales`), all in one
    launch. Returns the rotated q."""
    assert kv_cache.is_contiguous() and v.stride(-1) == 1
    _launch_rotary(q, k, v, cos, sin, kv_cache, slots, kv_scales)
    return q


def _cache_scales(kv_cache: torch.Tensor, kv_scales: torch.Tensor | None,
                  unused: torch.Tensor) -> torch.Tensor:
    """The scales pointer of a kernel's cache write: `kv_scales` (1.0 if None) for an FP8
    cache, else `unused`."""
    if not kv_quant.is_fp8(kv_cache):
        return unused
    return kv_quant.unit_scales(kv_cache.device) if kv_scales is None else kv_scales


def _launch_rotary(q, k, v, cos, sin, kv_cache, slots, kv_scales=None) -> None:
    T, H, D = q.shape
    assert q.stride(-1) == 1 and k.stride(-1) == 1 and cos.stride(-1) == 1
    if not T:
        return
    cache = v is not None
    half = D // 2
    half_pad = triton.next_power_of_2(half)
    q_heads = triton.next_power_of_2(H)
    _rotary_cache_kernel[(T,)](
        q, k, v if cache else k, cos, sin, kv_cache if cache else q,
        slots if cache else cos, _cache_scales(kv_cache, kv_scales, cos) if cache else cos,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1),
        v.stride(0) if cache else 0, v.stride(1) if cache else 0, cos.stride(0),
        kv_cache[0].numel() if cache else 0, H, k.shape[1], WRITE_CACHE=cache,
        Q_HEADS=q_heads, KV_HEADS=triton.next_power_of_2(k.shape[1]), HALF=half,
        HALF_PAD=half_pad, FP8_KV=cache and kv_quant.is_fp8(kv_cache),
        num_warps=min(max(q_heads * half_pad // 256, 1), 8))


__all__ = ["add_layer_norm", "add_rms_norm", "layer_norm", "linear", "quick_gelu", "rms_norm",
           "rms_norm_linear", "rms_norm_qkv_rope", "rotary_qk", "rotary_qk_cache",
           "rotary_qk_float32", "silu_mul"]


# the output norm of the linear-attention layers, beside their other kernels
from vlmserve.layers.triton_gdn import gated_rms_norm  # noqa: E402, F401
