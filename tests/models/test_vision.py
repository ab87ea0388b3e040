"""Parity of the Qwen2-VL / Qwen2.5-VL vision towers with transformers (CPU, float32)."""

from __future__ import annotations

import pytest
import torch

from vlmserve.layers.vision_attention import build_varlen_plan, varlen_attention
from vlmserve.models.vision.qwen2_5_vl import Qwen2_5_VisionTransformer, window_partition
from vlmserve.models.vision.qwen2_vl import Qwen2VisionTransformer

transformers = pytest.importorskip("transformers")
from transformers.models.qwen2_5_vl.configuration_qwen2_5_vl import Qwen2_5_VLVisionConfig  # noqa: E402
from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import (  # noqa: E402
    Qwen2_5_VisionTransformerPretrainedModel,
)
from transformers.models.qwen2_vl.configuration_qwen2_vl import Qwen2VLVisionConfig  # noqa: E402
from transformers.models.qwen2_vl.modeling_qwen2_vl import Qwen2VisionTransformerPretrainedModel  # noqa: E402

PATCH_DIM = 3 * 2 * 14 * 14


def _randomize(model: torch.nn.Module, seed: int) -> None:
    """Large-std random weights so that every layer visibly matters."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen) * 0.2
            if "norm" in name or "ln_q" in name:
                p.copy_(1.0 + noise if name.endswith("weight") else noise)
            elif "patch_embed" in name:
                p.copy_(noise * 0.1)  # 1176 inputs per output
            else:
                p.copy_(noise)


def _pair(kind: str, seed: int = 0):
    """(hf_model, our_model) with identical random weights."""
    if kind == "qwen2_vl":
        cfg = Qwen2VLVisionConfig(
            embed_dim=32,
            depth=2,
            num_heads=2,
            mlp_ratio=2,
            patch_size=14,
            spatial_merge_size=2,
            temporal_patch_size=2,
            hidden_size=64,
        )
        hf_cls, ours_cls = Qwen2VisionTransformerPretrainedModel, Qwen2VisionTransformer
    else:
        cfg = Qwen2_5_VLVisionConfig(
            hidden_size=32,
            intermediate_size=64,
            depth=4,
            num_heads=2,
            fullatt_block_indexes=[1, 3],
            window_size=112,
            out_hidden_size=64,
            patch_size=14,
            spatial_merge_size=2,
            temporal_patch_size=2,
        )
        hf_cls, ours_cls = Qwen2_5_VisionTransformerPretrainedModel, Qwen2_5_VisionTransformer
    cfg._attn_implementation = "eager"
    hf = hf_cls(cfg).eval()
    _randomize(hf, seed)
    ours = ours_cls(cfg).eval()
    state = hf.state_dict()
    loaded = ours.load_weights(state.items())
    assert loaded == set(state) == {n for n, _ in ours.named_parameters()}
    return hf, ours


def _inputs(grids: list[list[int]], seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    grid = torch.tensor(grids, dtype=torch.long)
    n = int(grid.prod(-1).sum())
    return torch.randn(n, PATCH_DIM, generator=torch.Generator().manual_seed(seed)), grid


def _assert_close(ours: torch.Tensor, ref: torch.Tensor, rel: float = 1e-4) -> None:
    assert ours.shape == ref.shape
    scale = ref.abs().max().item()
    assert scale > 1e-3
    err = (ours - ref).abs().max().item()
    assert err <= rel * scale, f"max abs diff {err:.3g} vs scale {scale:.3g}"


GRIDS = {
    "one": [[1, 4, 4]],
    "three": [[1, 4, 4], [1, 8, 6], [1, 16, 16]],
    "video": [[2, 6, 4], [1, 4, 8]],
    "windows": [[1, 16, 16], [1, 24, 20]],  # 4x4-unit windows; 24x20 -> 12x10 units (ragged)
    "ragged": [[1, 10, 14], [2, 18, 12], [1, 2, 2]],
}


@pytest.mark.parametrize("kind", ["qwen2_vl", "qwen2_5_vl"])
@pytest.mark.parametrize("case", list(GRIDS))
@torch.no_grad()
def test_matches_hf(kind: str, case: str) -> None:
    hf, ours = _pair(kind)
    pixels, grid = _inputs(GRIDS[case])
    ref = hf(pixels, grid_thw=grid).pooler_output
    out = ours(pixels, grid)
    assert out.shape == (grid.prod(-1).sum().item() // 4, 64)
    _assert_close(out, ref)


@pytest.mark.parametrize("kind", ["qwen2_vl", "qwen2_5_vl"])
@torch.no_grad()
def test_batching_invariance(kind: str) -> None:
    _, ours = _pair(kind)
    pa, ga = _inputs([[1, 24, 20]], seed=2)
    pb, gb = _inputs([[1, 8, 6]], seed=3)
    pc, gc = _inputs([[1, 16, 16]], seed=4)
    both = ours(torch.cat([pa, pb, pc]), torch.cat([ga, gb, gc]))
    alone = torch.cat([ours(pa, ga), ours(pb, gb), ours(pc, gc)])
    _assert_close(both, alone)


@torch.no_grad()
def test_window_attention_matters() -> None:
    """Swapping the window layers to full attention must change the output (windows are real)."""
    _, ours = _pair("qwen2_5_vl")
    pixels, grid = _inputs(GRIDS["windows"])
    out = ours(pixels, grid)
    ours.fullatt_block_indexes = frozenset(range(len(ours.blocks)))
    assert (ours(pixels, grid) - out).abs().max() > 1e-3


def test_window_partition() -> None:
    order, seqlens = window_partition([(1, 4, 6), (1, 2, 2)], merge=2, window_units=2)
    # image 0: 2x3 units -> windows [0,1,3,4], [2,5]; image 1: one unit (offset 6)
    assert order.tolist() == [0, 1, 3, 4, 2, 5, 6]
    assert seqlens.tolist() == [16, 8, 4]


def _loop_attention(q, k, v, cu):
    outs = []
    for a, b in zip(cu[:-1].tolist(), cu[1:].tolist()):
        qs, ks, vs = (x[a:b].transpose(0, 1) for x in (q, k, v))  # [H, L, D]
        attn = torch.softmax(qs @ ks.transpose(1, 2) / q.shape[-1] ** 0.5, dim=-1)
        outs.append((attn @ vs).transpose(0, 1))
    return torch.cat(outs)


@pytest.mark.parametrize(
    "lengths",
    [[37], [64] * 5, [64, 64, 32, 64, 16, 48], [1000, 5, 300, 700, 64, 64], [3, 0, 9]],
)
def test_varlen_attention(lengths: list[int]) -> None:
    gen = torch.Generator().manual_seed(0)
    total, heads, dim = sum(lengths), 3, 16
    q, k, v = (torch.randn(total, heads, dim, generator=gen) for _ in range(3))
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    ref = _loop_attention(q, k, v, cu)
    torch.testing.assert_close(varlen_attention(q, k, v, cu), ref, rtol=1e-5, atol=1e-5)
    plan = build_varlen_plan(cu)
    torch.testing.assert_close(
        varlen_attention(q, k, v, cu, max(lengths), plan=plan), ref, rtol=1e-5, atol=1e-5
    )


def test_equal_length_runs_launch_in_power_of_two_batches() -> None:
    """13 adjacent equal segments: zero-copy batches of 8, 4 and 1 (bounded SDPA shapes)."""
    lengths = [300] * 13 + [100] * 3  # both above the small-segment merge
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    plan = build_varlen_plan(cu)
    assert [(b.num_seqs, b.max_len, b.start) for b in plan.buckets] == [
        (8, 300, 0), (4, 300, 2400), (1, 300, 3600), (2, 100, 3900), (1, 100, 4100)]
    gen = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(sum(lengths), 2, 8, generator=gen) for _ in range(3))
    torch.testing.assert_close(varlen_attention(q, k, v, cu, plan=plan),
                               _loop_attention(q, k, v, cu), rtol=1e-5, atol=1e-5)


def test_load_weights_rejects_unknown_and_misshaped() -> None:
    _, ours = _pair("qwen2_vl")
    with pytest.raises(KeyError):
        ours.load_weights([("visual.blocks.0.attn.qkv.weight", torch.zeros(96, 32))])
    with pytest.raises(ValueError):
        ours.load_weights([("blocks.0.attn.qkv.weight", torch.zeros(32, 32))])


@torch.no_grad()
def test_empty_batch() -> None:
    _, ours = _pair("qwen2_5_vl")
    out = ours(torch.zeros(0, PATCH_DIM), torch.zeros(0, 3, dtype=torch.long))
    assert out.shape == (0, 64)


@torch.no_grad()
def test_encoder_runner_batches_by_size_and_stores_each_image() -> None:
    """The runner encodes a step's distinct images in one forward, largest first, each with
    its processor's `encoder_meta`; every image's stored rows equal that image encoded
    alone."""
    from vlmserve.models.qwen2_vl_processing import Qwen2VLPixels
    from vlmserve.multimodal.inputs import ImageInput, pixel_values
    from vlmserve.worker.encoder_runner import EncoderRunner
    from vlmserve.worker.mm_embedding_store import MMEmbeddingStore

    _, ours = _pair("qwen2_vl")
    seen = []

    class Model:
        def encode_images(self, pixels, meta):
            seen.append(meta)
            return ours(pixels, torch.tensor(meta))

    transform = Qwen2VLPixels(patch_size=14, temporal_patch_size=2, merge_size=2,
                              rescale_factor=1 / 255, mean=(0.5, 0.4, 0.3), std=(0.2, 0.3, 0.25),
                              fused=False)
    grids = {"a": [1, 4, 4], "b": [1, 8, 6], "c": [1, 16, 16], "d": [1, 6, 8]}
    gen = torch.Generator().manual_seed(10)
    images = []
    for h, g in grids.items():
        pixels = torch.randint(0, 256, (g[1] * 14, g[2] * 14, 3), generator=gen,
                               dtype=torch.uint8)
        images.append(ImageInput(h, 0, g[1] * g[2] // 4, pixels, tuple(g), transform))
    store = MMEmbeddingStore(torch.device("cpu"), 64, torch.float32)
    runner = EncoderRunner(Model(), torch.device("cpu"), torch.float32, store)
    runner.run({img.mm_hash: img for img in images})
    assert runner.num_batches == 1 and runner.num_images == 4
    (meta,) = seen
    assert meta == [(1, 16, 16), (1, 6, 8), (1, 8, 6), (1, 4, 4)]  # equal sizes together
    for img in images:
        alone = ours(pixel_values([img]), torch.tensor([img.encoder_meta]))
        _assert_close(store.gather([(img.mm_hash, 0, img.length)]), alone)
    runner.run({img.mm_hash: img for img in images})  # all stored: nothing to encode
    assert runner.num_batches == 1


def test_vision_attention_backend_choice() -> None:
    """`auto` is flash only where it runs (CUDA, fp16 / bf16), else the SDPA groups; a backend
    that cannot run here fails at start-up with a message naming it."""
    from vlmserve.layers.vision_attention import get_vision_attention_backend

    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert get_vision_attention_backend("auto", cpu, torch.bfloat16) is None
    assert get_vision_attention_backend("auto", cuda, torch.float32) is None
    assert get_vision_attention_backend("torch", cuda, torch.bfloat16) is None
    flash = get_vision_attention_backend("auto", cuda, torch.bfloat16)
    assert flash is get_vision_attention_backend("flash", cuda, torch.float16)
    with pytest.raises(ValueError, match="flash vision attention backend needs a CUDA"):
        get_vision_attention_backend("flash", cpu, torch.bfloat16)
    with pytest.raises(ValueError, match="needs float16 or bfloat16, not torch.float32"):
        get_vision_attention_backend("flash", cuda, torch.float32)
    with pytest.raises(ValueError, match="unknown vision attention backend 'sdpa'"):
        get_vision_attention_backend("sdpa", cpu)
