"""A block-wise FP8 checkpoint on CUDA, its projections held as FP8 and multiplied by the
Triton FP8 kernels (decode graphs included): the same greedy tokens as transformers on the
checkpoint (float32, as the CPU parity tests)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)

from tests.engine.helpers import HFOracle, chat_prompt, make_image  # noqa: E402
from vlmserve import LLM, SamplingParams  # noqa: E402
from vlmserve.models.builtin import resolve_model  # noqa: E402
from vlmserve.models.quantization import (  # noqa: E402
    SCALE_SUFFIX,
    Fp8BlockQuant,
    quantize_fp8_checkpoint,
)

torch.backends.cuda.matmul.allow_tf32 = False


def _read_back(path: Path, dst: Path) -> Path:
    """The FP8 checkpoint with its weights read back (transformers on a GPU machine would
    not dequantize it on the CPU; on the CPU both read it back alike: test_quantization)."""
    shutil.copytree(path, dst)
    tensors = load_file(str(path / "model.safetensors"))
    quant = Fp8BlockQuant((32, 32))
    out = {n: quant.dequantize(t, tensors[n + SCALE_SUFFIX]) if n + SCALE_SUFFIX in tensors
           else t for n, t in tensors.items() if not n.endswith(SCALE_SUFFIX)}
    save_file(out, str(dst / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((dst / "config.json").read_text())
    del config["quantization_config"]
    (dst / "config.json").write_text(json.dumps(config))
    return dst


def test_fp8_checkpoint_on_cuda_matches_transformers(vlmserve_cache, tmp_path):
    path = quantize_fp8_checkpoint(resolve_model("tiny-qwen2-vl"), tmp_path / "fp8",
                                   block=(32, 32))
    llm = LLM(str(path), dtype="float32", device="cuda", max_num_batched_tokens=48)
    proj = llm.engine.executor.runner.model.language_model.layers[0].mlp.down_proj
    assert proj.weight.dtype == torch.float8_e4m3fn and proj.weight.is_cuda
    prompts = [chat_prompt(llm, "What is this?", [make_image(112, 84, i)]) for i in range(3)]
    prompts.append(chat_prompt(llm, "A haiku, please.", []))
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    oracle = HFOracle(_read_back(path, tmp_path / "read_back"), "Qwen2VLForConditionalGeneration")
    for prompt, out in zip(prompts, llm.generate(prompts, params, use_tqdm=False)):
        assert out.outputs[0].token_ids == oracle.generate(
            llm.engine.input_processor.process(prompt), 10)
