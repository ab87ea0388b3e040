"""Qwen3-VL-MoE's experts as checkpoints hold them: transformers' layout ([E, 2I, H] /
[E, H, I]) and the hub's (the last two dims swapped) load to the same model and the same
tokens; other layouts are refused by name. (Parity with transformers: tests/engine/
test_parity.py; TP: tests/distributed/test_tensor_parallel.py; the Triton experts:
tests/gpu/test_triton_moe.py.)"""

from __future__ import annotations

import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from vlmserve import LLM, SamplingParams
from vlmserve.layers.moe import moe_reference, route
from vlmserve.models.builtin import resolve_model

PROMPTS = ["Tell me about experts.", "One two three"]


def _rewritten(tmp_path, fn):
    src = resolve_model("tiny-qwen3-vl-moe")
    dst = tmp_path / "ckpt"
    shutil.copytree(src, dst)
    tensors = load_file(str(dst / "model.safetensors"))
    save_file(fn(tensors), str(dst / "model.safetensors"), metadata={"format": "pt"})
    return dst


def _tokens(model) -> list[list[int]]:
    llm = LLM(str(model), dtype="float32", device="cpu")
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False)]


def test_hub_layout_gives_the_same_tokens(vlmserve_cache, tmp_path):
    def swap(tensors):
        return {k: (v.transpose(1, 2).contiguous() if ".experts." in k else v)
                for k, v in tensors.items()}

    hub = _rewritten(tmp_path, swap)
    assert _tokens(hub) == _tokens(resolve_model("tiny-qwen3-vl-moe"))


def test_other_expert_layouts_are_refused_by_name(vlmserve_cache, tmp_path):
    def cut(tensors):
        name = "model.language_model.layers.0.mlp.experts.down_proj"
        return {**tensors, name: tensors[name][:, :, :40].contiguous()}

    with pytest.raises(ValueError, match=r"experts\.down_proj has shape \(8, 64, 40\)"):
        LLM(str(_rewritten(tmp_path, cut)), dtype="float32", device="cpu")


def test_experts_stored_one_by_one_are_refused(vlmserve_cache, tmp_path):
    def split(tensors):
        out = dict(tensors)
        name = "model.language_model.layers.0.mlp.experts.gate_up_proj"
        for e, w in enumerate(out.pop(name)):
            out[f"model.language_model.layers.0.mlp.experts.{e}.gate_proj.weight"] = (
                w[:48].contiguous())
        return out

    with pytest.raises(ValueError, match="experts stored one by one"):
        LLM(str(_rewritten(tmp_path, split)), dtype="float32", device="cpu")


def test_reference_equals_a_token_by_token_sum():
    g = torch.Generator().manual_seed(0)
    t, h, i, e, k = 6, 16, 12, 5, 2
    x = torch.randn(t, h, generator=g)
    gate_up, down = torch.randn(e, 2 * i, h, generator=g), torch.randn(e, h, i, generator=g)
    weights, ids = route(torch.randn(t, e, generator=g), k)
    assert torch.allclose(weights.sum(-1), torch.ones(t))  # renormalized over the k picked
    want = torch.zeros(t, h)
    for n in range(t):
        for j in range(k):
            gate, up = (gate_up[ids[n, j]] @ x[n]).chunk(2)
            want[n] += weights[n, j] * (down[ids[n, j]] @ (torch.nn.functional.silu(gate) * up))
    torch.testing.assert_close(moe_reference(x, gate_up, down, weights, ids), want)
