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
from vlmserve.distributed.tensor_parallel import TensorSlice
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
    path, arch = fp8
    llm = LLM(str(path), dtype="float32", device="cpu", max_num_batched_tokens=40)
    oracle = HFOracle(path, arch)  # transformers dequantizes it (no GPU): our reference
    prompts = [chat_prompt(llm, "What is this?", [make_image(112, 84, 1)]),
               chat_prompt(llm, "Compare them.", [make_image(56, 56, 2), make_image(84, 140, 3)]),
               chat_prompt(llm, "A haiku, please.", [])]
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    for prompt, out in zip(prompts, llm.generate(prompts, params, use_tqdm=False)):
        processed = llm.engine.input_processor.process(prompt)
        assert out.outputs[0].token_ids == oracle.generate(processed, 10)
    # and the weights are transformers' own, the vision tower's too (chunks of 40 tokens
    # cut through the images: the output above is not only a short prefill)
    ours = dict(llm.engine.executor.runner.model.named_parameters())
    theirs = dict(oracle.model.named_parameters())
    q = [n for n in ours if n.endswith("q_proj.weight") or n.endswith("qkv.weight")]
    assert q and all(any(torch.equal(ours[n], t) for t in theirs.values()) for n in q)


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
