"""Block-wise FP8 checkpoints (Qwen's -FP8 format) load as they are: their weights read back
exactly as transformers reads them, greedy output identical to transformers on the same FP8
checkpoint, a tensor-parallel rank's slices taken from the read-back weights; any other
quantization refused by name before anything loads."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.engine.helpers import HFOracle, chat_prompt, make_image
from vlmserve import LLM, SamplingParams
from vlmserve.layers.tensor_parallel import TensorSlice
from vlmserve.models.builtin import resolve_model
from vlmserve.models.loader import iter_safetensors
from vlmserve.models.quantization import (
    Fp8BlockQuant,
    quantize_fp8_block,
    quantize_fp8_checkpoint,
)


def _everything(name: str, t: torch.Tensor) -> bool:  # the vision tower's matrices too
    return t.dim() == 2 and "embed_tokens" not in name and "lm_head" not in name


@pytest.fixture(scope="module", params=[("tiny-qwen2-vl", "Qwen2VLForConditionalGeneration"),
                                        ("tiny-qwen3-vl", "Qwen3VLForConditionalGeneration")])
def fp8(request, vlmserve_cache, tmp_path_factory) -> tuple[Path, str]:
    name, arch = request.param
    dst = tmp_path_factory.mktemp(f"{name}-fp8")
    return quantize_fp8_checkpoint(resolve_model(name), dst, block=(32, 32),
                                   include=_everything), arch


def test_greedy_output_identical_to_transformers_on_the_fp8_checkpoint(fp8):
    """Held as FP8 (the default) and read back (quantization="none"): the same greedy
    tokens as transformers on the FP8 checkpoint, with chunks of 40 tokens cutting through
    the images; held, the language model's projections are FP8 and take less memory."""
    path, arch = fp8
    oracle = HFOracle(path, arch)  # transformers dequantizes it (no GPU): our reference
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    sizes = {}
    for quantization in ("auto", "none"):
        llm = LLM(str(path), dtype="float32", device="cpu", max_num_batched_tokens=40,
                  quantization=quantization)
        prompts = [chat_prompt(llm, "What is this?", [make_image(112, 84, 1)]),
                   chat_prompt(llm, "Compare them.", [make_image(56, 56, 2),
                                                      make_image(84, 140, 3)]),
                   chat_prompt(llm, "A haiku, please.", [])]
        for prompt, out in zip(prompts, llm.generate(prompts, params, use_tqdm=False)):
            processed = llm.engine.input_processor.process(prompt)
            assert out.outputs[0].token_ids == oracle.generate(processed, 10)
        model = llm.engine.executor.runner.model
        mlp = model.language_model.layers[0].mlp
        held = quantization == "auto"
        assert (mlp.gate_up_proj.weight.dtype == torch.float8_e4m3fn) == held
        assert (mlp.down_proj.weight.dtype == torch.float8_e4m3fn) == held
        assert all(p.dtype == torch.float32 for n, p in model.named_parameters()
                   if n.startswith("visual."))  # the tower's FP8 weights: read back
        sizes[quantization] = llm.engine.executor.load_stats.weight_bytes
        theirs = dict(oracle.model.named_parameters())  # the same weights as transformers'
        down = theirs[next(n for n in theirs if n.endswith("layers.0.mlp.down_proj.weight"))]
        ours = mlp.down_proj.w
        assert torch.equal(ours.dequantize(torch.float32) if held else ours, down)
    assert sizes["auto"] < 0.8 * sizes["none"]


def test_unquantized_checkpoint_quantized_as_it_loads(vlmserve_cache, tmp_path):
    """quantization="fp8": the projections that can take 128x128 blocks (all but the tiny
    q/k/v, whose k does not start on a block) quantized at load, as the same weights in an
    FP8 checkpoint, and the same tokens as transformers on that checkpoint."""
    online = LLM("tiny-qwen2-vl", dtype="float32", device="cpu", quantization="fp8")
    layer = online.engine.executor.runner.model.language_model.layers[0]
    for module in (layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj):
        assert module.weight.dtype == torch.float8_e4m3fn
    assert layer.self_attn.qkv_proj.weight.dtype == torch.float32
    path = quantize_fp8_checkpoint(
        resolve_model("tiny-qwen2-vl"), tmp_path, block=(128, 128),
        include=lambda n, t: n.endswith(("o_proj.weight", "down_proj.weight",
                                         "gate_proj.weight", "up_proj.weight")))
    oracle = HFOracle(path, "Qwen2VLForConditionalGeneration")
    prompt = chat_prompt(online, "What is this?", [make_image(112, 84, 1)])
    out = online.generate(prompt, SamplingParams(max_tokens=10, temperature=0.0,
                                                 ignore_eos=True), use_tqdm=False)[0]
    assert out.outputs[0].token_ids == oracle.generate(
        online.engine.input_processor.process(prompt), 10)
    with pytest.raises(ValueError, match="quantization must be one of auto, none, fp8"):
        LLM("tiny-qwen2-vl", dtype="float32", device="cpu", quantization="int4")


def test_read_back_weights_are_the_blocks_times_their_scales(fp8):
    path, _ = fp8
    raw = load_file(str(path / "model.safetensors"))
    got = dict(iter_safetensors(path, quant=Fp8BlockQuant((32, 32))))
    assert not any(n.endswith("_scale_inv") for n in got)
    name = next(n for n in raw if n.endswith("_scale_inv"))[:-len("_scale_inv")]
    w, s = raw[name].float(), raw[name + "_scale_inv"]
    for i in range(w.shape[0]):
        for j in range(w.shape[1]):
            assert got[name][i, j] == w[i, j] * s[i // 32, j // 32]
    # a tensor-parallel rank's part: cut from the read-back weight
    part = TensorSlice(dim=1, start=16, stop=48, size=32)
    sliced = dict(iter_safetensors(path, slice_for=lambda n: part if n == name else None,
                                   quant=Fp8BlockQuant((32, 32))))
    assert torch.equal(sliced[name], got[name][:, 16:48])


def test_partial_blocks_and_e8m0_scales():
    torch.manual_seed(0)
    w = torch.randn(70, 45)
    q, s = quantize_fp8_block(w, (32, 16))
    assert q.dtype == torch.float8_e4m3fn and s.shape == (3, 3)
    back = Fp8BlockQuant((32, 16)).dequantize(q, s)
    assert back.shape == w.shape and ((back - w).norm() / w.norm()) < 0.05
    assert back[69, 44] == q[69, 44].float() * s[2, 2]  # the partial corner block
    e8m0 = torch.tensor([[127, 128], [126, 130]], dtype=torch.uint8)  # 1, 2, 0.5, 8
    ones = torch.ones(3, 3).to(torch.float8_e4m3fn)
    out = Fp8BlockQuant((2, 2)).dequantize(ones, e8m0)
    assert out.tolist() == [[1, 1, 2], [1, 1, 2], [0.5, 0.5, 8]]
    with pytest.raises(ValueError, match="has 3x3 scales, not 2x2"):
        Fp8BlockQuant((32, 16)).dequantize(q, s[:2, :2])


@pytest.mark.parametrize("qconfig, named", [
    ({"quant_method": "awq", "bits": 4, "group_size": 128}, "'awq'"),
    ({"quant_method": "gptq", "bits": 4}, "'gptq'"),
    ({"quant_method": "fp8", "activation_scheme": "dynamic"}, "'fp8' without weight_block_size"),
])
def test_other_quantizations_refused_by_name(vlmserve_cache, tmp_path, qconfig, named):
    shutil.copytree(resolve_model("tiny-qwen2-vl"), tmp_path, dirs_exist_ok=True)
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "quantization_config": qconfig}))
    with pytest.raises(ValueError, match=f"quantized with {named}.*loads fp8"):
        LLM(str(tmp_path), dtype="float32", device="cpu")


@pytest.mark.parametrize("mode", ["data", "weights"])
def test_tensor_parallel_ranks_hold_their_fp8_parts(fp8, mode):
    """TP=2 (gloo, two processes): each rank holds FP8 parts of the projections whose split
    starts on a block (o_proj's and down_proj's input halves, gate/up's row halves) and reads
    the rest back (the tiny k/v halves start inside a block); the same tokens as one process.
    Quantizing as the weights load is refused under tensor parallelism, by name."""
    path, _ = fp8
    kw = dict(dtype="float32", device="cpu", max_num_batched_tokens=37, max_num_seqs=4)
    one = LLM(str(path), **kw)
    prompts = [chat_prompt(one, "What?", [make_image(112, 84, 1)]), chat_prompt(one, "Hi", [])]
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    want = [o.outputs[0].token_ids for o in one.generate(prompts, params, use_tqdm=False)]
    tp = LLM(str(path), tensor_parallel_size=2, mm_encoder_tp_mode=mode, **kw)
    try:
        layer = tp.engine.executor.runner.model.language_model.layers[0]
        assert layer.self_attn.qkv_proj.weight.dtype == torch.float32
        for module in (layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj):
            assert module.weight.dtype == torch.float8_e4m3fn
        got = [o.outputs[0].token_ids for o in tp.generate(prompts, params, use_tqdm=False)]
        assert got == want
    finally:
        tp.engine.shutdown()
    if mode == "data":
        with pytest.raises(Exception, match="does not run under tensor parallelism"):
            LLM("tiny-qwen2-vl", tensor_parallel_size=2, quantization="fp8", **kw)
