"""Vision steps through `VisionGraphs`' padded buffers equal the eager tower's (on the CPU
the buffers run eagerly, ``capture=False``; tests/gpu/test_vision_graphs.py replays real CUDA
graphs): padding rows in segments of their own, buffers reused across steps of a bucket,
steps past ``max_rows`` or ``max_graphs`` eager."""

from __future__ import annotations

import pytest
import torch

from tests.models.test_vision import GRIDS, _assert_close, _inputs, _pair, _randomize
from vlmserve.config import EngineConfig, resolve_config
from vlmserve.layers.vision_attention import varlen_attention
from vlmserve.models.vision import step_inputs
from vlmserve.models.vision.qwen3_vl import Qwen3VisionTransformer
from vlmserve.models.vision.step_inputs import bucket_rows, pack_padded, padded_layout
from vlmserve.worker import vision_graphs
from vlmserve.worker.vision_graphs import BatchGraphs, VisionGraphs, attach_vision_graphs

pytest.importorskip("transformers")
from transformers.models.qwen3_vl.configuration_qwen3_vl import Qwen3VLVisionConfig  # noqa: E402


def _tower(kind: str) -> torch.nn.Module:
    if kind != "qwen3_vl":
        return _pair(kind)[1]
    cfg = Qwen3VLVisionConfig(depth=3, hidden_size=32, intermediate_size=64, num_heads=2,
                              out_hidden_size=64, num_position_embeddings=64,
                              deepstack_visual_indexes=[0, 1], patch_size=14,
                              temporal_patch_size=2, spatial_merge_size=2)
    tower = Qwen3VisionTransformer(cfg).eval()
    _randomize(tower, 0)
    return tower


KINDS = ["qwen2_vl", "qwen2_5_vl", "qwen3_vl"]


@pytest.mark.parametrize("kind", KINDS)
@torch.no_grad()
def test_padded_steps_equal_eager(kind: str) -> None:
    tower = _tower(kind)
    graphs = VisionGraphs(tower, max_rows=4096, capture=False)
    steps = [GRIDS[c] for c in ("one", "three", "video", "windows", "ragged")]
    steps.append([[1, 14, 14]] + [[1, 2, 2]] * 9)  # many short segments after a long one
    eager = [tower(*_inputs(g, seed=i)) for i, g in enumerate(steps)]
    tower.graphs = graphs
    for i, (grids, ref) in enumerate(zip(steps, eager, strict=True)):
        _assert_close(tower(*_inputs(grids, seed=i)), ref)
    assert graphs.num_replays == len(steps) and graphs.num_eager == 0


@torch.no_grad()
def test_a_bucket_serves_later_steps_from_its_buffers() -> None:
    """Two steps of one bucket (the second with fewer rows and other segments of the same
    bounds) share one graph's buffers; stale rows of the first never reach the second."""
    tower = _tower("qwen2_5_vl")
    graphs = VisionGraphs(tower, max_rows=4096, capture=False)
    first, second = [[1, 16, 16], [1, 4, 8]], [[1, 16, 16], [1, 2, 8]]
    refs = [tower(*_inputs(g, seed=5)) for g in (first, second)]
    tower.graphs = graphs
    for g, ref in zip((first, second), refs, strict=True):
        _assert_close(tower(*_inputs(g, seed=5)), ref)
    assert len(graphs.graphs) == 1 and graphs.num_replays == 2


@torch.no_grad()
def test_steps_past_the_limits_run_eagerly() -> None:
    tower = _tower("qwen2_vl")
    graphs = VisionGraphs(tower, max_rows=300, max_graphs=1, capture=False)
    tower.graphs = graphs
    big = _inputs([[1, 20, 20]])  # 400 rows > 300
    _assert_close(tower(*big), _eager(tower, big))
    assert graphs.num_replays == 0 and not graphs.graphs
    tower(*_inputs([[1, 4, 4]]))  # the one graph
    small = _inputs([[1, 2, 2]] * 40)  # 160 rows, other segments: no room for a graph
    _assert_close(tower(*small), _eager(tower, small))
    assert graphs.num_replays == 1 and graphs.num_eager == 1


def _eager(tower, inputs) -> torch.Tensor:
    graphs, tower.graphs = tower.graphs, None
    try:
        return tower(*inputs)
    finally:
        tower.graphs = graphs


def test_buckets() -> None:
    assert [bucket_rows(n) for n in (1, 256, 257, 320, 321, 1024, 1025, 5000)] == [
        256, 256, 320, 320, 384, 1024, 1280, 5120]


def test_the_layout_bounds_every_segment() -> None:
    """Padding rows come in segments no longer than the longest real one's bound, the
    cu_seqlens entries a power of two."""
    tower = _tower("qwen2_5_vl")
    inputs = tower.step_inputs([(1, 16, 16), (1, 4, 8)])  # 288 rows: 256 + 32
    layout = padded_layout(inputs, 320)
    sets = {name: (count, bound) for name, count, bound in layout.segments}
    assert sets["frames"] == (4, 256)  # 2 frames + 1 padding segment of 32 -> 4 entries
    assert sets["windows"] == (8, 64)  # 4 windows of 64 rows, 1 of 32, the padding's 1
    ints = torch.zeros(layout.int_size, dtype=torch.int32)
    pack_padded(inputs, layout, ints, None)
    views = layout.views(ints, None)
    assert views.segments["frames"].cu_seqlens.tolist() == [0, 256, 288, 320, 320]
    assert views.gather[288:].tolist() == list(range(288, 320))
    assert views.scatter[72:].tolist() == list(range(72, 80))


def test_attach_gives_each_tower_its_graphs() -> None:
    holder = torch.nn.Module()
    holder.visual, holder.clip = _tower("qwen2_vl"), _clip()
    with pytest.raises(ValueError, match="device cu_seqlens"):
        attach_vision_graphs(holder, 2048)  # SDPA's launches are planned on the host
    assert attach_vision_graphs(holder, 2048, attention=_device_cu_attention) == 2
    assert holder.visual.graphs.attention is _device_cu_attention  # SDPA's eager steps
    holder.visual.set_attention_backend(_device_cu_attention)
    assert attach_vision_graphs(holder, 2048, attention=varlen_attention) == 2
    assert isinstance(holder.visual.graphs, VisionGraphs) and holder.visual.graphs.max_rows == 2048
    assert holder.visual.graphs.attention is None  # the tower's own takes device cu_seqlens
    assert isinstance(holder.clip.graphs, BatchGraphs) and holder.clip.graphs.max_batch == 2048 // 4


def _device_cu_attention(q, k, v, cu_seqlens, max_seqlen):
    """A varlen attention taking ``cu_seqlens`` alone, as flash and triton do."""
    return varlen_attention(q, k, v, cu_seqlens)


@torch.no_grad()
def test_device_cu_attention_steps_equal_eager() -> None:
    tower = _tower("qwen2_5_vl")
    pixels, grid = _inputs(GRIDS["ragged"])
    ref = tower(pixels, grid)
    tower.set_attention_backend(_device_cu_attention)
    tower.graphs = VisionGraphs(tower, max_rows=4096, capture=False)
    _assert_close(tower(pixels, grid), ref)


@pytest.mark.parametrize("kind", KINDS)
@torch.no_grad()
def test_eager_steps_plan_host_launches_only_for_sdpa(kind: str, monkeypatch) -> None:
    """An attention that takes device ``cu_seqlens`` (flash, triton) gets the longest segment
    as its bound and no SDPA launch plan is built for it; its output equals SDPA's."""
    tower = _tower(kind)
    pixels, grid = _inputs(GRIDS["ragged"])
    ref = tower(pixels, grid)
    bounds = []

    def attention(q, k, v, cu_seqlens, max_seqlen):
        bounds.append((max_seqlen, int(cu_seqlens.diff().max())))
        return varlen_attention(q, k, v, cu_seqlens)

    tower.set_attention_backend(attention)
    planned = []
    real = step_inputs.build_varlen_plan
    monkeypatch.setattr(step_inputs, "build_varlen_plan",
                        lambda *a, **k: planned.append(1) or real(*a, **k))
    _assert_close(tower(pixels, grid), ref)
    assert bounds and all(bound == longest for bound, longest in bounds) and not planned
    tower.set_attention_backend(None)
    _assert_close(tower(pixels, grid), ref)
    assert planned


@pytest.mark.parametrize("kind", KINDS)
@torch.no_grad()
def test_graphs_of_an_sdpa_tower_run_their_own_attention(kind: str) -> None:
    """Eager steps keep SDPA; the graph's buffers run with the graphs' attention (over
    device cu_seqlens), which is taken away again after each run."""
    tower = _tower(kind)
    steps = [GRIDS[c] for c in ("one", "three", "ragged")]
    eager = [tower(*_inputs(g, seed=i)) for i, g in enumerate(steps)]
    used = []

    def attention(q, k, v, cu_seqlens, max_seqlen):
        used.append(1)
        return varlen_attention(q, k, v, cu_seqlens)

    tower.graphs = VisionGraphs(tower, max_rows=4096, capture=False, attention=attention)
    for i, (grids, ref) in enumerate(zip(steps, eager, strict=True)):
        _assert_close(tower(*_inputs(grids, seed=i)), ref)
    assert tower.graphs.num_replays == len(steps) and used
    assert all(b.attn.attn_fn is None for b in tower.blocks)
    calls = len(used)
    _assert_close(_eager(tower, _inputs(steps[0], seed=0)), eager[0])
    assert len(used) == calls  # the eager step ran SDPA


def _clip():
    from transformers import CLIPVisionConfig

    from vlmserve.models.vision.clip import CLIPVisionTower

    cfg = CLIPVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                           num_attention_heads=2, image_size=28, patch_size=14)
    tower = CLIPVisionTower(cfg).eval()
    _randomize(tower, 3)
    return tower


@torch.no_grad()
def test_batches_of_one_size_images_replay_by_batch_size() -> None:
    tower = _clip()
    graphs = BatchGraphs(tower, max_batch=8, capture=False)
    batches = [torch.randn(n, 3, 28, 28, generator=torch.Generator().manual_seed(n))
               for n in (3, 1, 4, 9)]
    refs = [tower(b) for b in batches]
    tower.graphs = graphs
    for b, ref in zip(batches, refs, strict=True):
        _assert_close(tower(b), ref)
    assert sorted(k[0] for k in graphs.graphs) == [1, 4]  # 3 and 4 share one; 9 > 8: eager
    assert graphs.num_replays == 3


def _resolve(device: str, **options):
    config = EngineConfig.from_kwargs(model="tiny-qwen2-vl", **options)
    return resolve_config(config, "offline", device, 80 * 2**30, triton=device == "cuda",
                          dtype="bfloat16", max_image_tokens=1024, embedding_row_bytes=2048)


def test_resolved_rows() -> None:
    assert _resolve("cuda", vision_cuda_graph_max_rows=8192
                    ).resolved.vision_cuda_graph_max_rows == 8192
    for device, options in (("cpu", {}), ("cuda", {"enforce_eager": True})):
        assert _resolve(device, vision_cuda_graph_max_rows=8192,
                        vision_attention_backend="flash", **options
                        ).resolved.vision_cuda_graph_max_rows == 0
    with pytest.raises(ValueError, match="must be >= 0"):
        _resolve("cuda", vision_cuda_graph_max_rows=-1)


@torch.no_grad()
def test_a_failed_capture_leaves_the_tower_eager(monkeypatch) -> None:
    tower = _tower("qwen2_vl")
    graphs = VisionGraphs(tower, max_rows=4096, capture=False)
    pixels, grid = _inputs(GRIDS["three"])
    ref = tower(pixels, grid)
    tower.graphs = graphs
    graphs.capture = True  # as on CUDA, where the capture below fails

    def broken(fn, pool, error_mode):
        raise RuntimeError("operation not permitted when stream is capturing")
    monkeypatch.setattr(vision_graphs, "capture_graph", broken)
    for _ in range(2):
        _assert_close(tower(pixels, grid), ref)
    assert graphs.max_rows == 0 and not graphs.graphs and graphs.num_replays == 0
