"""The Gated DeltaNet decode step in one Triton kernel, states read and written in place at
their slots of the pool: one token of each of B sequences, per (sequence, value head, block of
value columns) program: q and k L2-normalised (q scaled), the slot's state ``S [k_dim,
v_dim]`` decayed by ``exp(g)``, corrected by ``k (beta (v - S^T k))^T`` and read by q.

Same contract as `gated_deltanet.delta_rule_step` over ``ssm_state[slots]`` (zeros where a
sequence has no initial state), written back: what the fla backend's decode-only steps run
(fla's fused recurrence takes a dense batch of states, which costs a gather and a scatter of
every state around it, two more launches a layer inside the decode graph)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _gdn_decode_kernel(q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, state_ptr, slot_ptr, init_ptr,
                       out_ptr, stride_qb, stride_qh, stride_kb, stride_kh, stride_vb,
                       stride_vh, stride_gb, stride_betab, scale, eps, HV: tl.constexpr,
                       REP: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
                       BK: tl.constexpr, BV: tl.constexpr):
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
    g = tl.load(g_ptr + b * stride_gb + h).to(tl.float32)
    beta = tl.load(beta_ptr + b * stride_betab + h).to(tl.float32)
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


def gdn_decode(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
               beta: torch.Tensor, ssm_state: torch.Tensor, slots: torch.Tensor,
               has_initial_state: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """q, k ``[B, Hk, Dk]``, v ``[B, Hv, Dv]``, g, beta ``[B, Hv]``; ``ssm_state [slots, Hv,
    Dk, Dv]`` float32 (contiguous), updated in place at ``slots [B]`` (read as zeros where
    ``has_initial_state [B]`` is False) -> ``[B, Hv, Dv]`` float32."""
    B, Hk, K = q.shape
    Hv, V = v.shape[1], v.shape[2]
    assert ssm_state.dtype == torch.float32 and ssm_state.is_contiguous()
    assert all(t.stride(-1) == 1 for t in (q, k, v, g, beta))
    out = torch.empty(B, Hv, V, dtype=torch.float32, device=v.device)
    if B == 0:
        return out
    BK = triton.next_power_of_2(K)
    BV = min(triton.next_power_of_2(V), max(16, 4096 // BK))
    _gdn_decode_kernel[(B, Hv, triton.cdiv(V, BV))](
        q, k, v, g, beta, ssm_state, slots, has_initial_state, out,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        g.stride(0), beta.stride(0), K ** -0.5, eps, HV=Hv, REP=Hv // Hk, K=K, V=V, BK=BK,
        BV=BV)
    return out
