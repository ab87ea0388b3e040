"""GPU only: the vision towers with the Triton varlen kernel (one launch for every image and
window) match the torch SDPA path: full-size towers in bf16, tiny models' tokens in float32."""

from __future__ import annotations

import pytest
import torch

from tests.engine.helpers import mixed_prompts
from vlmserve import LLM, SamplingParams

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.mark.parametrize("preset", ["qwen2-vl-2b-random", "qwen2.5-vl-7b-random"])
def test_full_size_tower_bf16(preset):
    from vlmserve.layers.triton_attention import varlen_attention_triton
    from vlmserve.models.builtin import build_config
    from vlmserve.models.registry import resolve_model_class

    cfg = build_config(preset)
    cls = resolve_model_class(cfg).vision_cls
    torch.manual_seed(0)
    with torch.device("cuda"):
        tower = cls(cfg.vision_config).to(torch.bfloat16).eval()
    for p in tower.parameters():
        torch.nn.init.normal_(p, std=0.02)
    grids = torch.tensor([[1, 32, 32], [1, 48, 64], [1, 16, 24], [1, 64, 64]], device="cuda")
    pixels = torch.randn(int(grids.prod(-1).sum()), 3 * 2 * 14 * 14, device="cuda")
    with torch.inference_mode():
        ref = tower(pixels, grids).float()
        tower.set_attention_backend(varlen_attention_triton)
        out = tower(pixels, grids).float()
    rel = ((out - ref).norm() / ref.norm()).item()
    assert torch.isfinite(out).all() and rel < 3e-2, rel


@pytest.mark.parametrize("model", ["tiny-qwen2-vl", "tiny-qwen2.5-vl"])
def test_tiny_models_same_tokens(vlmserve_cache, model):
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    tokens = []
    for backend in ("torch", "triton"):
        llm = LLM(model, dtype="float32", device="cuda", vision_attention_backend=backend)
        tokens.append([o.outputs[0].token_ids
                       for o in llm.generate(mixed_prompts(llm), params, use_tqdm=False)])
    assert tokens[0] == tokens[1]
