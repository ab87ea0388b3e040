"""The FP8 KV cache's pieces on the CPU: the write quantizes (scale, clamp, e4m3), the torch
reference reads back dequantized, checkpoint scales are found under their names, the option
resolves to a dtype."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import save_file

from vlmserve.config import EngineConfig
from vlmserve.layers import kv_quant
from vlmserve.layers.attention import (
    build_attention_metadata,
    paged_attention_reference,
    write_kv,
)
from vlmserve.models.quantization import is_attention_scale, kv_cache_scales

FP8 = torch.float8_e4m3fn
SCALES = torch.tensor([0.05, 0.1])


def test_written_values_read_back_within_e4m3_rounding():
    """Each value comes back within half an e4m3 step (1/16 relative) where it is a normal
    e4m3 number, beyond 448 x scale as 448 x scale; other slots stay empty."""
    g = torch.Generator().manual_seed(0)
    k, v = (torch.randn(6, 2, 8, generator=g) for _ in range(2))
    k[0, 0, 0], v[1, 1, 1] = 1e3, -1e3  # out of range: clamped
    cache = torch.zeros(2, 4, 4, 2, 8, dtype=FP8)
    slots = torch.tensor([3, 0, 9, 15, 4, 11])
    write_kv(cache, k, v, slots, SCALES)
    flat = cache.view(2, 16, 2, 8).float() * SCALES.view(2, 1, 1, 1)
    for plane, x in enumerate((k, v)):
        back, scale = flat[plane, slots], SCALES[plane]
        assert back.abs().max() == pytest.approx(448 * scale.item())
        normal = (x.abs() >= 2**-6 * scale) & (x.abs() <= 448 * scale)
        err = ((back - x).abs() / x.abs())[normal]
        assert 0 < err.max() <= 2**-4 + 1e-6
    empty = torch.ones(16, dtype=torch.bool)
    empty[slots] = False
    assert (flat[:, empty] == 0).all()


def test_unscaled_write_is_a_scale_of_one():
    k = torch.tensor([[[0.3, -2.0, 500.0, 1e-3]]])
    cache = torch.zeros(2, 1, 2, 1, 4, dtype=FP8)
    write_kv(cache, k, -k, torch.tensor([1]))
    assert cache[0, 0, 1, 0].float().tolist() == (
        k.clamp(-448, 448).to(FP8).float()[0, 0].tolist())
    assert (cache[1, 0, 1].float() == -cache[0, 0, 1].float()).all()


def test_reference_attention_reads_the_cache_dequantized():
    """Decodes and a prefill chunk over an FP8 cache equal the same attention over the
    cache read back to float32 by hand (x * scale)."""
    g = torch.Generator().manual_seed(1)
    query_lens, seq_lens = [1, 1, 5], [9, 16, 12]
    meta = build_attention_metadata(query_lens, seq_lens, [[0, 1], [2, 3], [5, 4]], 8,
                                    torch.device("cpu"))
    cache = torch.zeros(2, 6, 8, 2, 16, dtype=FP8)
    write_kv(cache, *(torch.randn(48, 2, 16, generator=g) for _ in range(2)),
             torch.arange(48), SCALES)
    q = torch.randn(sum(query_lens), 4, 16, generator=g)
    out = paged_attention_reference(q, cache, meta, 0.25, kv_scales=SCALES)
    by_hand = cache.float() * SCALES.view(2, 1, 1, 1, 1)
    torch.testing.assert_close(out, paged_attention_reference(q, by_hand, meta, 0.25))
    unscaled = paged_attention_reference(q, cache, meta, 0.25)  # no scales: 1.0
    torch.testing.assert_close(unscaled, paged_attention_reference(q, cache.float(), meta, 0.25))
    assert not torch.allclose(out, unscaled)


def test_checkpoint_scales_by_name(tmp_path):
    """compressed-tensors / ModelOpt names, the older kv_scale for both, a layer without
    scales absent (1.0 where used), the image encoder's and MTP's left alone."""
    save_file({
        "model.layers.0.self_attn.k_scale": torch.tensor(0.5),
        "model.layers.0.self_attn.v_scale": torch.tensor([0.25]),
        "model.language_model.layers.2.self_attn.k_proj.k_scale": torch.tensor(2.0),
        "model.language_model.layers.3.self_attn.kv_scale": torch.tensor(3.0),
        "model.layers.1.self_attn.q_scale": torch.tensor(1.0),
        "model.layers.1.self_attn.k_proj.weight": torch.zeros(2, 2),
        "model.visual.layers.0.self_attn.k_scale": torch.tensor(1.0),
        "mtp.layers.0.self_attn.v_scale": torch.tensor(1.0),
    }, str(tmp_path / "model.safetensors"))
    assert kv_cache_scales(tmp_path, 4, ("model.visual.",)) == {
        0: (0.5, 0.25), 2: (2.0, 1.0), 3: (3.0, 3.0)}
    assert is_attention_scale("model.layers.1.self_attn.q_scale")
    assert is_attention_scale("layers.7.self_attn.qkv_proj.v_scale")
    assert not is_attention_scale("model.layers.1.self_attn.k_proj.weight_scale_inv")
    with pytest.raises(ValueError, match="3 decoder layers"):
        kv_cache_scales(tmp_path, 3, ("model.visual.",))
    save_file({"model.layers.0.self_attn.k_scale": torch.ones(4)},
              str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match="one scale per layer"):
        kv_cache_scales(tmp_path, 4)


def test_the_option():
    assert kv_quant.kv_cache_dtype("auto", torch.bfloat16) == torch.bfloat16
    for name in ("fp8", "fp8_e4m3"):
        assert kv_quant.kv_cache_dtype(name, torch.float32) == FP8
        EngineConfig.from_kwargs(kv_cache_dtype=name)
    with pytest.raises(ValueError, match="auto, fp8, fp8_e4m3"):
        EngineConfig.from_kwargs(kv_cache_dtype="int8")


def test_what_cannot_hold_an_fp8_cache_is_refused(monkeypatch):
    from vlmserve.models.qwen2_vl import Qwen2VLForConditionalGeneration
    from vlmserve.models.transformers_backend import TransformersVLM

    class NoScales:  # a model whose attention takes no KV scales
        pass

    cpu, gpu = torch.device("cpu"), torch.device("cuda", 0)
    kv_quant.check_fp8_support(Qwen2VLForConditionalGeneration, cpu, False)
    kv_quant.check_fp8_support(TransformersVLM, cpu, False)
    with pytest.raises(ValueError, match="NoScales's attention takes no KV scales"):
        kv_quant.check_fp8_support(NoScales, cpu, False)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device: (8, 0))
    with pytest.raises(ValueError, match="capability 8.9 or newer"):
        kv_quant.check_fp8_support(Qwen2VLForConditionalGeneration, gpu, True)
    kv_quant.check_fp8_support(Qwen2VLForConditionalGeneration, gpu, False)  # torch's ops
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device: (9, 0))
    kv_quant.check_fp8_support(Qwen2VLForConditionalGeneration, gpu, True)
