"""`models/transformers_fused.py`: a transformers model's RMSNorms whose forward is
transformers' canonical one run the engine's `rms_norm`, with the same output to the bit on
the CPU; norms written otherwise (Gemma's) keep transformers' forward."""

from __future__ import annotations

import copy

import torch
import transformers as tf

from vlmserve.layers.fused import EAGER_OPS
from vlmserve.models.transformers_fused import fuse_rms_norms

TINY = dict(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, head_dim=8)


class _Recording:
    """EAGER_OPS' rms_norm, counting its calls."""

    def __init__(self) -> None:
        self.calls = 0

    def rms_norm(self, x, weight, eps):
        self.calls += 1
        return EAGER_OPS.rms_norm(x, weight, eps)


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
