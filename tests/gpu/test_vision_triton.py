"""GPU only: the vision towers with one attention launch for every image and window (our
Triton varlen kernel; torch's varlen FlashAttention) match the torch SDPA path: full-size
towers in bf16, tiny models' tokens in float32 (Triton) and bf16 (flash)."""

from __future__ import annotations

import pytest
import torch

from tests.engine.helpers import mixed_prompts
from tests.gpu.towers import full_size_tower
from vlmserve import LLM, SamplingParams

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.mark.parametrize("backend", ["triton", "flash"])
@pytest.mark.parametrize("preset", ["qwen2-vl-2b-random", "qwen2.5-vl-7b-random"])
def test_full_size_tower_bf16(preset, backend):
    from vlmserve.layers.vision_attention import get_vision_attention_backend

    tower = full_size_tower(preset)
    grids = torch.tensor([[1, 32, 32], [1, 48, 64], [1, 16, 24], [1, 64, 64]], device="cuda")
    pixels = torch.randn(int(grids.prod(-1).sum()), 3 * 2 * 14 * 14, device="cuda")
    with torch.inference_mode():
        ref = tower(pixels, grids).float()
        tower.set_attention_backend(
            get_vision_attention_backend(backend, torch.device("cuda"), torch.bfloat16))
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


@pytest.mark.parametrize("model", ["tiny-qwen2-vl", "tiny-qwen2.5-vl"])
def test_tiny_models_flash(vlmserve_cache, model):
    """bf16 (flash runs in fp16 / bf16 only): a server's option end to end, and the tower's
    rows for a batch of images of different sizes close to SDPA's."""
    from vlmserve.layers.vision_attention import varlen_attention_flash
    from vlmserve.multimodal.inputs import pixel_values

    llm = LLM(model, dtype="bfloat16", device="cuda", vision_attention_backend="flash")
    prompts = mixed_prompts(llm)
    outs = llm.generate(prompts, SamplingParams(max_tokens=6, temperature=0.0,
                                                ignore_eos=True), use_tqdm=False)
    assert [len(o.outputs[0].token_ids) for o in outs] == [6] * len(prompts)
    engine = llm.engine
    model_ = engine.executor.runner.model
    images = [img for p in prompts for img in engine.input_processor.process(p).images]
    assert len({img.length for img in images}) > 2
    pixels = pixel_values(images, dtype=torch.bfloat16).cuda()
    meta = [img.encoder_meta for img in images]
    with torch.inference_mode():
        out = model_.encode_images(pixels, meta).float()
        model_.set_vision_attention_backend(None)
        ref = model_.encode_images(pixels, meta).float()
        model_.set_vision_attention_backend(varlen_attention_flash)
    rel = ((out - ref).norm() / ref.norm()).item()
    assert rel < 2e-2, rel
