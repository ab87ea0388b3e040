"""The Gated DeltaNet decode kernel (layers/triton_gdn.py) against the torch recurrence
(`gated_deltanet.delta_rule_step`): outputs, the states written at their slots, the other
slots untouched, a sequence without an initial state starting from zeros (whatever its slot
held), the gates from their raw inputs; grouped heads (more value heads than key heads) and
strided q / k / v / gate views as the layer passes them."""

from __future__ import annotations

import pytest
import torch

from tests.gpu.triton_target import DEVICE, ON_GPU  # first: skips without triton
from vlmserve.layers.gated_deltanet import delta_rule_step, depthwise_conv_torch, gate_values
from vlmserve.layers.linear_metadata import build_linear_metadata
from vlmserve.layers.triton_gdn import conv_decode, gdn_decode

SHAPES = [(4, 2, 4, 128, 128), (3, 16, 16, 128, 128)] if ON_GPU else [(4, 2, 4, 16, 8),
                                                                      (3, 1, 1, 32, 16)]


@pytest.mark.parametrize("B, Hk, Hv, K, V", SHAPES)
@torch.no_grad()
def test_decode_equals_the_torch_step_in_place(B, Hk, Hv, K, V) -> None:
    gen = torch.Generator(device=DEVICE).manual_seed(0)

    def randn(*shape):
        return torch.randn(*shape, generator=gen, device=DEVICE)

    # q | k | v side by side in one row per token, as the layer's convolution output
    qkv = randn(B, 2 * Hk * K + Hv * V)
    q = qkv[:, :Hk * K].view(B, Hk, K)
    k = qkv[:, Hk * K:2 * Hk * K].view(B, Hk, K)
    v = qkv[:, 2 * Hk * K:].view(B, Hv, V)
    ab = randn(B, 2 * Hv + 3) * 8  # the raw gates, rows apart, as the projection's split
    a, b = ab[:, :Hv], ab[:, Hv:2 * Hv]
    a[0, 0] = 30.0  # past softplus's threshold
    A_log, dt_bias = randn(Hv), randn(Hv)
    g, beta = gate_values(a, b, A_log, dt_bias)
    pool = randn(B + 3, Hv, K, V)
    slots = torch.tensor([B + 2, 0, 3, 1][:B], device=DEVICE)
    init = torch.tensor([True, False, True, True][:B], device=DEVICE)
    pool[slots[~init]] = float("nan")  # a slot's leftovers, never read without a state
    want_out, want_states = delta_rule_step(
        q, k, v, g, beta, torch.where(init[:, None, None, None], pool[slots], 0.0))
    state = pool.clone()
    out = gdn_decode(q, k, v, a, b, A_log, dt_bias, state, slots, init)
    tol = dict(rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(out, want_out, **tol)
    torch.testing.assert_close(state[slots], want_states, **tol)
    others = [i for i in range(B + 3) if i not in slots.tolist()]
    assert torch.equal(state[others], pool[others])
    assert out.isfinite().all()


@pytest.mark.parametrize("silu, bias", [(True, False), (False, True)])
@torch.no_grad()
def test_conv_decode_equals_the_torch_gathers(silu, bias) -> None:
    """One token of each sequence through the convolution: the output (SiLU in x's dtype as
    Qwen3.5 takes it, or float32 with a bias as LFM2) and every state as the torch gathers
    leave them (a sequence without an initial state from zeros; other slots untouched)."""
    B, C, KW = 4, (6144 if ON_GPU else 40), 4
    gen = torch.Generator(device=DEVICE).manual_seed(1)

    def randn(*shape):
        return torch.randn(*shape, generator=gen, device=DEVICE)

    x = randn(B, C + 8)[:, :C]  # rows apart, as a split of the input projection's
    weight, b = randn(C, 1, KW)[:, 0], (randn(C) if bias else None)
    pool = randn(7, KW - 1, C)
    slots, init = [5, 0, 2, 6], [True, False, True, True]
    pool[0] = float("nan")  # the fresh sequence's slot: leftovers never read
    meta = build_linear_metadata([1] * B, slots, init, KW, DEVICE)
    want_state = pool.clone()
    want = depthwise_conv_torch(x, weight, want_state, meta, b)
    state = pool.clone()
    got = conv_decode(x, weight, state, meta.state_slots, meta.has_initial_state, b, silu)
    if silu:
        want = torch.nn.functional.silu(want).to(x.dtype)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(state[slots], want_state[slots])
    others = [1, 3, 4]
    assert torch.equal(state[others], pool[others])
