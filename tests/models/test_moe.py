"""Qwen3-VL-MoE's experts as checkpoints hold them: transformers' layout ([E, 2I, H] /
[E, H, I]), the hub's (the last two dims swapped) and Qwen3-MoE's one tensor per expert and
projection (also block-wise FP8, read back) load to the same model and the same tokens;
other shapes and missing experts are refused by name. (Parity with transformers: tests/engine/
test_parity.py; TP: tests/distributed/test_tensor_parallel.py; the Triton experts:
tests/gpu/test_triton_moe.py.)"""

from __future__ import annotations

import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from vlmserve import LLM, SamplingParams
from vlmserve.layers.moe import ExpertWeights, moe_reference, route
from vlmserve.models.builtin import resolve_model
from vlmserve.models.quantization import SCALE_SUFFIX, Fp8BlockQuant, quantize_fp8_checkpoint

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


def _one_by_one(tensors):
    """The stacked experts as Qwen3-MoE names them: `experts.N.{gate,up,down}_proj.weight`."""
    out = {}
    for name, t in tensors.items():
        if not name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            out[name] = t
            continue
        base = name.rsplit(".", 1)[0]
        for e, w in enumerate(t):
            if name.endswith("gate_up_proj"):  # [2I, H]: the gate's rows, then up's
                gate, up = w.chunk(2)
                out[f"{base}.{e}.gate_proj.weight"] = gate.contiguous()
                out[f"{base}.{e}.up_proj.weight"] = up.contiguous()
            else:
                out[f"{base}.{e}.down_proj.weight"] = w.contiguous()
    return out


def test_experts_stored_one_by_one_give_the_same_tokens(vlmserve_cache, tmp_path):
    assert _tokens(_rewritten(tmp_path, _one_by_one)) == _tokens(
        resolve_model("tiny-qwen3-vl-moe"))


def test_a_missing_expert_is_named(vlmserve_cache, tmp_path):
    def drop(tensors):
        out = _one_by_one(tensors)
        del out["model.language_model.layers.2.mlp.experts.5.up_proj.weight"]
        return out

    with pytest.raises(ValueError, match=r"lacks weights.*layers\.2\.mlp\.experts\.gate_up_proj"):
        LLM(str(_rewritten(tmp_path, drop)), dtype="float32", device="cpu")


def test_fp8_experts_one_by_one_load_read_back(vlmserve_cache, tmp_path):
    """An FP8 checkpoint whose experts are stored one by one (block-wise FP8 with scales, as
    Qwen's -FP8 releases): the experts come read back to the model's dtype, and the tokens
    equal those of the read-back values stored stacked in full precision."""
    per_expert = _rewritten(tmp_path, _one_by_one)
    fp8 = quantize_fp8_checkpoint(per_expert, tmp_path / "fp8", block=(16, 16),
                                  include=lambda n, t: ".experts." in n)
    quant = Fp8BlockQuant((16, 16))
    stored = load_file(str(fp8 / "model.safetensors"))
    read_back = {n: quant.dequantize(t, stored[n + SCALE_SUFFIX]) for n, t in stored.items()
                 if n + SCALE_SUFFIX in stored}
    assert read_back and all(t.dtype == torch.float8_e4m3fn for n, t in stored.items()
                             if n in read_back)

    def restacked(tensors):
        out = {n: t for n, t in tensors.items() if ".experts." not in n}
        for name in [n for n in tensors if n.endswith(("gate_up_proj", "down_proj"))
                     and ".experts." in n]:
            base = name.rsplit(".", 1)[0]
            count = tensors[name].shape[0]
            if name.endswith("gate_up_proj"):
                out[name] = torch.stack([torch.cat([read_back[f"{base}.{e}.gate_proj.weight"],
                                                    read_back[f"{base}.{e}.up_proj.weight"]])
                                         for e in range(count)])
            else:
                out[name] = torch.stack([read_back[f"{base}.{e}.down_proj.weight"]
                                         for e in range(count)])
        return out

    (tmp_path / "ref").mkdir()
    assert _tokens(fp8) == _tokens(_rewritten(tmp_path / "ref", restacked))


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


def test_a_ranks_share_is_the_same_from_every_layout():
    """Under TP a rank keeps columns [start, start + share) of every expert's intermediate
    dim: the same values whether the checkpoint stacks the experts (either layout) or stores
    them one by one."""
    g = torch.Generator().manual_seed(1)
    e, h, i = 3, 8, 6
    gate_up, down = torch.randn(e, 2 * i, h, generator=g), torch.randn(e, h, i, generator=g)
    want_gate_up = torch.cat([gate_up[:, 2:4], gate_up[:, i + 2:i + 4]], dim=1)
    for layout in ("stacked", "hub", "one by one"):
        part, seen = ExpertWeights(h, 2, e, inter_start=2, inter_total=i), set()
        if layout == "one by one":
            done = []
            for k in range(e):
                done += part.load(f"{k}.gate_proj.weight", gate_up[k, :i], seen)
                done += part.load(f"{k}.up_proj.weight", gate_up[k, i:], seen)
                done += part.load(f"{k}.down_proj.weight", down[k], seen)
            assert sorted(done) == ["down_proj", "gate_up_proj"]  # each once, when whole
        else:
            swap = layout == "hub"
            part.load("gate_up_proj", gate_up.transpose(1, 2) if swap else gate_up, seen)
            part.load("down_proj", down.transpose(1, 2) if swap else down, seen)
        assert torch.equal(part.gate_up_proj, want_gate_up), layout
        assert torch.equal(part.down_proj, down[:, :, 2:4]), layout


def test_a_ranks_experts_are_the_same_from_every_layout():
    """Under expert parallelism a rank keeps experts [start, start + count) whole."""
    g = torch.Generator().manual_seed(2)
    e, h, i = 4, 8, 6
    gate_up, down = torch.randn(e, 2 * i, h, generator=g), torch.randn(e, h, i, generator=g)
    for layout in ("stacked", "one by one"):
        part, seen = ExpertWeights(h, i, 2, expert_start=2, num_total=e), set()
        done = []
        if layout == "stacked":
            done += part.load("gate_up_proj", gate_up, seen) + part.load("down_proj", down, seen)
        else:
            for k in range(e):  # the other rank's experts are skipped
                done += part.load(f"{k}.gate_proj.weight", gate_up[k, :i], seen)
                done += part.load(f"{k}.up_proj.weight", gate_up[k, i:], seen)
                done += part.load(f"{k}.down_proj.weight", down[k], seen)
        assert sorted(done) == ["down_proj", "gate_up_proj"], layout
        assert torch.equal(part.gate_up_proj, gate_up[2:]) and torch.equal(part.down_proj,
                                                                           down[2:]), layout
