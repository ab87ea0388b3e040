"""Decodes of the linear-attention layers in one Triton kernel each, on the state pools in
place at the sequences' slots (`layers/gated_deltanet.py` calls them on CUDA):

- `gdn_decode`: the gated delta rule for one token of each of B sequences, per (sequence,
  value head, block of value columns) program: the gates from their raw inputs, q and k
  L2-normalised (q scaled), the slot's
  state ``S [k_dim, v_dim]`` decayed by ``exp(g)``, corrected by ``k (beta (v - S^T k))^T``
  and read by q. Same contract as `gated_deltanet.delta_rule_step` over ``ssm_state[slots]``
  written back (fla's fused recurrence takes a dense batch of states: a gather and a scatter
  of every state around it, more launches a layer inside the decode graph).
- `conv_decode`: the causal depthwise convolution of one token each, the slot's last inputs
  shifted by one (`gated_deltanet.depthwise_conv`'s torch gathers take ~8 launches).

A sequence without an initial state reads zeros, whatever its slot held."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _gdn_decode_kernel(q_ptr, k_ptr, v_ptr, a_ptr, b_ptr, alog_ptr, dt_ptr, state_ptr,
                       slot_ptr, init_ptr, out_ptr, stride_qb, stride_qh, stride_kb,
                       stride_kh, stride_vb, stride_vh, stride_ab, stride_bb, scale, eps,
                       HV: tl.constexpr, REP: tl.constexpr, K: tl.constexpr,
                       V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr):
    b = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    cols = tl.program_id(2) * BV + tl.arange(0, BV)
    rows = tl.arange(0, BK)
    row_ok, col_ok = rows < K, cols < V
    q = tl.load(q_ptr + b * stride_qb + (h // REP) * stride_qh + rows, mask=row_ok,
                other=0.0).to(tl.float32)
    k = tl.load(k_ptr + b * stride_kb + (h // REP) * stride_kh + rows, mask=row_ok,
                other=0.0).to(tl.float32)
    q = q * tl.rsqrt(tl.sum(q * q, axis=0) + eps) * scale
    k = k * tl.rsqrt(tl.sum(k * k, axis=0) + eps)
    v = tl.load(v_ptr + b * stride_vb + h * stride_vh + cols, mask=col_ok,
                other=0.0).to(tl.float32)
    # the gates (`gated_deltanet.gate_values`): g = -exp(A_log) * softplus(a + dt_bias) in
    # float32 (softplus linear past 20, as torch's), beta = sigmoid(b) rounded to b's dtype
    x = tl.load(a_ptr + b * stride_ab + h).to(tl.float32) + tl.load(dt_ptr + h).to(tl.float32)
    softplus = tl.where(x > 20.0, x, tl.log(1.0 + tl.exp(tl.minimum(x, 20.0))))
    g = -tl.exp(tl.load(alog_ptr + h).to(tl.float32)) * softplus
    raw = tl.load(b_ptr + b * stride_bb + h)
    beta = tl.sigmoid(raw.to(tl.float32)).to(raw.dtype).to(tl.float32)
    slot = tl.load(slot_ptr + b).to(tl.int64)
    ptrs = state_ptr + ((slot * HV + h) * K + rows[:, None]) * V + cols[None, :]
    ok = row_ok[:, None] & col_ok[None, :]
    keep = tl.load(init_ptr + b) != 0
    state = tl.where(keep, tl.load(ptrs, mask=ok, other=0.0), 0.0) * tl.exp(g)
    delta = (v - tl.sum(state * k[:, None], axis=0)) * beta
    state = state + k[:, None] * delta[None, :]
    out = tl.sum(state * q[:, None], axis=0)
    tl.store(out_ptr + (b * HV + h) * V + cols, out, mask=col_ok)
    tl.store(ptrs, state, mask=ok)


def gdn_decode(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, a: torch.Tensor,
               b: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor,
               ssm_state: torch.Tensor, slots: torch.Tensor, has_initial_state: torch.Tensor,
               eps: float = 1e-6) -> torch.Tensor:
    """q, k ``[B, Hk, Dk]``, v ``[B, Hv, Dv]``, the raw gates a, b ``[B, Hv]`` and the
    layer's ``A_log``, ``dt_bias [Hv]`` (the gates computed in the kernel as
    `gated_deltanet.gate_values` computes them); ``ssm_state [slots, Hv, Dk, Dv]`` float32
    (contiguous), updated in place at ``slots [B]`` (read as zeros where
    ``has_initial_state [B]`` is False) -> ``[B, Hv, Dv]`` float32."""
    B, Hk, K = q.shape
    Hv, V = v.shape[1], v.shape[2]
    assert ssm_state.dtype == torch.float32 and ssm_state.is_contiguous()
    assert all(t.stride(-1) == 1 for t in (q, k, v, a, b, A_log, dt_bias))
    out = torch.empty(B, Hv, V, dtype=torch.float32, device=v.device)
    if B == 0:
        return out
    BK = triton.next_power_of_2(K)
    BV = min(triton.next_power_of_2(V), max(16, 4096 // BK))
    _gdn_decode_kernel[(B, Hv, triton.cdiv(V, BV))](
        q, k, v, a, b, A_log, dt_bias, ssm_state, slots, has_initial_state, out,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        a.stride(0), b.stride(0), K ** -0.5, eps, HV=Hv, REP=Hv // Hk, K=K, V=V, BK=BK,
        BV=BV)
    return out


@triton.jit
def _conv_decode_kernel(x_ptr, w_ptr, bias_ptr, state_ptr, slot_ptr, init_ptr, out_ptr,
                        stride_x, stride_w, stride_out, C, KW: tl.constexpr,
                        HAS_BIAS: tl.constexpr, SILU: tl.constexpr, BC: tl.constexpr):
    b = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BC + tl.arange(0, BC)
    ok = cols < C
    slot = tl.load(slot_ptr + b).to(tl.int64)
    keep = tl.load(init_ptr + b) != 0
    x = tl.load(x_ptr + b * stride_x + cols, mask=ok, other=0.0)
    acc = x.to(tl.float32) * tl.load(w_ptr + cols * stride_w + KW - 1, mask=ok,
                                     other=0.0).to(tl.float32)
    row = state_ptr + slot * (KW - 1) * C + cols  # the slot's oldest input, this column
    for j in tl.static_range(KW - 1):
        past = tl.where(keep, tl.load(row + j * C, mask=ok, other=0.0), 0.0)
        acc += past.to(tl.float32) * tl.load(w_ptr + cols * stride_w + j, mask=ok,
                                             other=0.0).to(tl.float32)
        if j > 0:  # each input one row older (row j - 1 was read the pass before)
            tl.store(row + (j - 1) * C, past.to(state_ptr.dtype.element_ty), mask=ok)
    tl.store(row + (KW - 2) * C, x.to(state_ptr.dtype.element_ty), mask=ok)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + cols, mask=ok, other=0.0).to(tl.float32)
    if SILU:
        acc = acc * tl.sigmoid(acc)
    tl.store(out_ptr + b * stride_out + cols, acc.to(out_ptr.dtype.element_ty), mask=ok)


def conv_decode(x: torch.Tensor, weight: torch.Tensor, conv_state: torch.Tensor,
                slots: torch.Tensor, has_initial_state: torch.Tensor,
                bias: torch.Tensor | None = None, silu: bool = False) -> torch.Tensor:
    """The causal depthwise convolution of one token of each of B sequences, ``x [B, C]``
    (rows may be apart), with ``weight [C, kernel]`` (and ``bias [C]``), each continuing the
    last ``kernel - 1`` inputs in ``conv_state [slots, kernel - 1, C]`` at its slot (zeros
    without an initial state), which become its latest ``kernel - 1`` in place -> float32
    ``[B, C]``, or SiLU of it in ``x``'s dtype with ``silu`` (as `gated_deltanet.causal_conv`)."""
    B, C = x.shape
    KW = weight.shape[1]
    assert KW >= 2 and x.stride(1) == 1 and weight.stride(1) == 1
    assert conv_state.is_contiguous() and conv_state.shape[1:] == (KW - 1, C)
    out = torch.empty(B, C, dtype=x.dtype if silu else torch.float32, device=x.device)
    if B == 0:
        return out
    BC = 256
    _conv_decode_kernel[(B, triton.cdiv(C, BC))](
        x, weight, bias if bias is not None else weight, conv_state, slots, has_initial_state,
        out, x.stride(0), weight.stride(0), out.stride(0), C, KW=KW,
        HAS_BIAS=bias is not None, SILU=silu, BC=BC)
    return out


@triton.jit
def _gated_rms_norm_kernel(x_ptr, z_ptr, w_ptr, out_ptr, stride_z, eps, H: tl.constexpr,
                           D: tl.constexpr, BD: tl.constexpr):
    r = tl.program_id(0).to(tl.int64)  # a (token, head) row
    cols = tl.arange(0, BD)
    ok = cols < D
    dt = out_ptr.dtype.element_ty
    x = tl.load(x_ptr + r * D + cols, mask=ok, other=0.0).to(dt).to(tl.float32)
    n = x * tl.rsqrt(tl.sum(x * x, axis=0) / D + eps)
    w = tl.load(w_ptr + cols, mask=ok, other=0.0).to(tl.float32)
    y = (w * n.to(dt).to(tl.float32)).to(dt).to(tl.float32)
    z = tl.load(z_ptr + (r // H) * stride_z + (r % H) * D + cols, mask=ok,
                other=0.0).to(tl.float32)
    tl.store(out_ptr + r * D + cols, (y * (z / (1.0 + tl.exp(-z)))).to(dt), mask=ok)


def gated_rms_norm(x: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, eps: float
                   ) -> torch.Tensor:
    """`fused.gated_rms_norm` in one kernel: ``x [T, H, D]`` contiguous (any float dtype,
    rounded to z's first), ``z [T, H * D]`` (rows may be apart: a split of the input
    projection), ``weight [D]`` -> ``[T, H * D]`` in z's dtype."""
    T, H, D = x.shape
    assert x.is_contiguous() and z.stride(1) == 1 and z.shape == (T, H * D)
    out = torch.empty(T, H * D, dtype=z.dtype, device=z.device)
    if T:
        _gated_rms_norm_kernel[(T * H,)](x, z, weight, out, z.stride(0), eps, H=H, D=D,
                                         BD=triton.next_power_of_2(D))
    return out
