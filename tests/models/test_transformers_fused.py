"""`models/transformers_fused.py`: a transformers model's RMSNorms whose forward is
transformers' canonical one run the engine's `rms_norm`, with the same output to the bit on
the CPU; norms written otherwise (Gemma's) keep transformers' forward. So for the canonical
rotary, inside the engine's forward (`rotary_ops`) only; the Triton kernel's path through it
in the interpreter."""

from __future__ import annotations

import copy

import pytest
import torch
import transformers as tf

from vlmserve.layers.fused import EAGER_OPS
from vlmserve.models.transformers_fused import (
    fuse_quick_gelus,
    fuse_rms_norms,
    fuse_rotary,
    join_projections,
    rotary_ops,
)

TINY = dict(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, head_dim=8)


class _Recording:
    """EAGER_OPS' rms_norm, counting its calls."""

    def __init__(self) -> None:
        self.calls = 0

    def rms_norm(self, x, weight, eps):
        self.calls += 1
        return EAGER_OPS.rms_norm(x, weight, eps)

    def rotary_qk_float32(self, q, k, cos, sin):
        self.calls += 1
        return EAGER_OPS.rotary_qk_float32(q, k, cos, sin)


def _model(cls, config):
    torch.manual_seed(0)
    model = cls(config).eval()
    for p in model.parameters():  # norms away from their initial ones
        p.data.normal_(0, 0.5)
    return model


def test_canonical_rms_norms_run_the_engines_op_bit_for_bit():
    model = _model(tf.Qwen3ForCausalLM, tf.Qwen3Config(**TINY))  # q/k norms too
    reference = copy.deepcopy(model)
    ops = _Recording()
    norms = 2 * TINY["num_hidden_layers"] + 1 + 2 * TINY["num_hidden_layers"]
    assert fuse_rms_norms(model, ops) == norms
    ids = torch.randint(0, TINY["vocab_size"], (2, 7), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        got, want = model(ids).logits, reference(ids).logits
    assert ops.calls == norms
    assert torch.equal(got, want)


def test_a_norm_written_otherwise_keeps_its_forward():
    model = _model(tf.Gemma3ForCausalLM, tf.Gemma3TextConfig(**TINY))  # x * (1 + weight)
    ops = _Recording()
    assert fuse_rms_norms(model, ops) == 0
    with torch.no_grad():
        model(torch.tensor([[1, 2, 3]]))
    assert ops.calls == 0


def test_another_dtype_than_the_weights_takes_transformers_forward():
    model = _model(tf.Qwen2ForCausalLM, tf.Qwen2Config(**TINY))
    ops = _Recording()
    fuse_rms_norms(model, ops)
    norm = model.model.norm
    x = torch.randn(3, TINY["hidden_size"], dtype=torch.bfloat16)
    want = type(norm).forward(norm, x)
    assert torch.equal(norm(x), want) and want.dtype == torch.float32 and ops.calls == 0


def proj_name(attn, proj) -> str:
    return next(n for n, m in attn.named_children() if m is proj)


def _logits(model, ids, ops=None):
    with torch.no_grad(), rotary_ops(ops):
        return model(ids).logits


def test_canonical_rotary_runs_the_engines_op_inside_its_forward_bit_for_bit():
    model = _model(tf.Qwen2ForCausalLM, tf.Qwen2Config(**TINY))
    assert fuse_rotary(model) == 1 and fuse_rotary(model) == 1  # routed once, found again
    ids = torch.randint(0, TINY["vocab_size"], (1, 9), generator=torch.Generator().manual_seed(2))
    ops = _Recording()
    want = _logits(model, ids)  # outside: transformers' own (any other caller of the module)
    assert ops.calls == 0
    assert torch.equal(_logits(model, ids, ops), want)
    assert ops.calls == TINY["num_hidden_layers"]
    torch.testing.assert_close(_logits(model, ids.repeat(2, 1), ops)[1], want[0])  # batch 2:
    # transformers' own
    assert ops.calls == TINY["num_hidden_layers"]


def test_a_rotary_written_otherwise_keeps_its_own():
    model = _model(tf.CohereForCausalLM, tf.CohereConfig(**TINY))  # interleaved pairs
    assert fuse_rotary(model) == 0


def test_the_triton_rotary_through_the_routed_function(monkeypatch):
    """The Triton kernel (the interpreter on the CPU) on the views the routed function hands
    it: q and k rotated in place, within float32 rounding of transformers'."""
    pytest.importorskip("triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    from vlmserve.layers import triton_ops

    model = _model(tf.Qwen2ForCausalLM, tf.Qwen2Config(**TINY))
    fuse_rotary(model)
    ids = torch.randint(0, TINY["vocab_size"], (1, 5), generator=torch.Generator().manual_seed(3))
    want = _logits(model, ids)
    torch.testing.assert_close(_logits(model, ids, triton_ops), want, rtol=1e-5, atol=1e-5)


def test_sibling_projections_run_as_one_gemm_and_the_canonical_mlp_as_the_engines():
    model = _model(tf.Qwen2ForCausalLM, tf.Qwen2Config(**TINY))  # q/k/v with biases
    reference = copy.deepcopy(model)
    ops = _Recording()
    ops.silu_mul = lambda x: (ops.__dict__.__setitem__("calls", ops.calls + 1)
                              or EAGER_OPS.silu_mul(x))
    layers = TINY["num_hidden_layers"]
    params = sum(p.numel() for p in model.parameters())
    assert join_projections(model, ops) == 2 * layers
    assert join_projections(model, ops) == 2 * layers  # again: the same joins
    assert sum(p.numel() for p in model.parameters()) == params  # views, no copy
    attn = model.model.layers[0].self_attn
    assert attn.k_proj.weight.untyped_storage().data_ptr() == \
        attn.q_proj.weight.untyped_storage().data_ptr()
    ids = torch.randint(0, TINY["vocab_size"], (2, 7), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        got, want = model(ids).logits, reference(ids).logits
    assert ops.calls == layers  # the MLPs through silu_mul
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    # a sibling called on another input computes its own
    x, y = torch.randn(3, TINY["hidden_size"]), torch.randn(3, TINY["hidden_size"])
    ref_attn = reference.model.layers[0].self_attn
    with torch.no_grad():
        assert torch.allclose(attn.q_proj(x), ref_attn.q_proj(x), atol=1e-6)
        assert torch.allclose(attn.k_proj(y), ref_attn.k_proj(y), atol=1e-6)
        assert torch.allclose(attn.v_proj(y), ref_attn.v_proj(y), atol=1e-6)
        joined = attn.v_proj.forward.func.__self__
        for proj in (attn.v_proj, attn.k_proj, attn.q_proj):  # in any order
            assert torch.allclose(proj(x), getattr(ref_attn, proj_name(attn, proj))(x),
                                  atol=1e-6)
        assert joined._input is None  # every sibling served: let go


def test_a_gelu_mlp_keeps_its_forward_with_its_projections_joined():
    config = tf.GemmaConfig(**TINY, hidden_activation="gelu_pytorch_tanh")
    model = _model(tf.GemmaForCausalLM, config)
    reference = copy.deepcopy(model)
    ops = _Recording()
    assert join_projections(model, ops) == 2 * TINY["num_hidden_layers"]
    ids = torch.tensor([[1, 2, 3, 4]])
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, reference(ids).logits,
                                   rtol=1e-5, atol=1e-5)
    assert ops.calls == 0


def test_the_vision_tower_rotary_and_quick_gelu_run_the_engines_ops_bit_for_bit():
    from transformers.models.qwen2_vl import modeling_qwen2_vl as m

    config = tf.Qwen2VLConfig(vision_config=dict(depth=2, embed_dim=32, num_heads=4,
                                                 mlp_ratio=2, hidden_act="quick_gelu"))
    torch.manual_seed(0)
    tower = m.Qwen2VisionTransformerPretrainedModel._from_config(config.vision_config).eval()
    reference = copy.deepcopy(tower)
    ops = _Recording()
    ops.quick_gelu = lambda x: (ops.__dict__.__setitem__("calls", ops.calls + 1)
                                or EAGER_OPS.quick_gelu(x))
    assert fuse_rotary(tower) >= 1 and fuse_quick_gelus(tower, ops) == 2
    grid = torch.tensor([[1, 4, 6]])
    pixels = torch.randn(24, 3 * 2 * 14 * 14, generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        want = reference(pixels, grid_thw=grid).last_hidden_state
        calls = ops.calls  # the GELUs run ours always; the rotary only inside rotary_ops
        with rotary_ops(ops):
            got = tower(pixels, grid_thw=grid).last_hidden_state
    assert ops.calls == calls + 2 * 2  # two layers: a rotary and a GELU each
    assert torch.equal(got, want)


def test_a_rotary_whose_cos_halves_differ_keeps_transformers_function():
    from transformers.models.qwen2_vl import modeling_qwen2_vl as m

    tower = tf.Qwen2VLConfig(vision_config=dict(depth=1, embed_dim=32, num_heads=4))
    fuse_rotary(m.Qwen2VisionTransformerPretrainedModel._from_config(tower.vision_config))
    routed = m.apply_rotary_pos_emb_vision.__self__
    q, k = torch.randn(5, 4, 8), torch.randn(5, 4, 8)
    cos, sin = torch.randn(5, 8), torch.randn(5, 8)  # halves that differ
    state = routed.halves_agree
    try:
        routed.halves_agree = None
        ops = _Recording()
        with rotary_ops(ops):
            got = m.apply_rotary_pos_emb_vision(q, k, cos, sin)
        assert ops.calls == 0 and routed.halves_agree is False
        want = routed.original(q, k, cos, sin)
        assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
    finally:
        routed.halves_agree = state
