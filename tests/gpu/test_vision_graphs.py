"""GPU only: vision steps replayed from CUDA graphs equal the same padded step run eagerly
(bit for bit) and the unpadded eager step (to bf16 rounding), on full-size towers; the tiny
models' greedy tokens (Qwen towers, CLIP towers by batch size) are the same with and without
the graphs."""

from __future__ import annotations

import pytest
import torch

from tests.engine.helpers import mixed_prompts
from tests.gpu.towers import full_size_tower
from vlmserve import LLM, SamplingParams

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

STEPS = [[[1, 32, 32]], [[1, 32, 32], [1, 16, 24]], [[1, 48, 64], [2, 16, 16]],
         [[1, 32, 32]], [[1, 20, 28]] * 3]


@pytest.mark.parametrize("backend", ["flash", "triton"])
@pytest.mark.parametrize("preset", ["qwen2-vl-2b-random", "qwen2.5-vl-7b-random"])
def test_full_size_tower(preset, backend):
    from vlmserve.layers.vision_attention import get_vision_attention_backend
    from vlmserve.worker.vision_graphs import VisionGraphs

    tower = full_size_tower(preset)
    tower.set_attention_backend(
        get_vision_attention_backend(backend, torch.device("cuda"), torch.bfloat16))
    graphs = VisionGraphs(tower, max_rows=8192)
    padded = VisionGraphs(tower, max_rows=8192, capture=False)
    with torch.inference_mode():
        for i, grids in enumerate(STEPS):
            grid = torch.tensor(grids)
            gen = torch.Generator(device="cuda").manual_seed(i)
            pixels = torch.randn(int(grid.prod(-1).sum()), 3 * 2 * 14 * 14, device="cuda",
                                 generator=gen)
            eager = tower(pixels, grid).float()
            tower.graphs = padded
            same_shapes = tower(pixels, grid).float()
            tower.graphs = graphs
            replayed = tower(pixels, grid).float()
            tower.graphs = None
            assert torch.equal(replayed, same_shapes), i
            rel = ((replayed - eager).norm() / eager.norm()).item()
            assert torch.isfinite(replayed).all() and rel < 2e-2, (i, rel)
    assert graphs.num_replays == len(STEPS) and len(graphs.graphs) < len(STEPS)


@pytest.mark.parametrize("model", ["tiny-qwen2-vl", "tiny-qwen2.5-vl", "tiny-qwen3-vl",
                                   "tiny-llava-1.5", "tiny-llava-next"])
def test_tiny_models_same_tokens(vlmserve_cache, model):
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    tokens = []
    for rows in (0, 4096):
        llm = LLM(model, dtype="float32", device="cuda", vision_attention_backend="triton",
                  vision_cuda_graph_max_rows=rows)
        tokens.append([o.outputs[0].token_ids
                       for o in llm.generate(mixed_prompts(llm), params, use_tqdm=False)])
        towers = [m for m in llm.engine.executor.runner.model.modules()
                  if getattr(m, "graphs", None) is not None]
        assert (len(towers) == 1 and towers[0].graphs.num_replays > 0) if rows else not towers
    assert tokens[0] == tokens[1]


@pytest.mark.parametrize("model", ["tiny-qwen2-vl", "tiny-qwen2.5-vl", "tiny-qwen3-vl"])
def test_sdpa_towers_replay_graphs_of_their_own_attention(vlmserve_cache, model):
    """The default SDPA vision attention with graphs: the graphs capture triton (float32),
    the eager steps above the cap keep SDPA; greedy tokens as without graphs."""
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    tokens = []
    for rows in (0, 4096):
        llm = LLM(model, dtype="float32", device="cuda", vision_cuda_graph_max_rows=rows)
        tokens.append([o.outputs[0].token_ids
                       for o in llm.generate(mixed_prompts(llm), params, use_tqdm=False)])
        towers = [m for m in llm.engine.executor.runner.model.modules()
                  if getattr(m, "graphs", None) is not None]
        if rows:
            assert len(towers) == 1 and towers[0].graphs.num_replays > 0
            assert towers[0].graphs.attention is not None and towers[0].torch_attention
    assert tokens[0] == tokens[1]
