"""GPU only: the transformers backend's sliding, chunked, soft-capped and both-ways layers on the
Triton paged attention, its decodes on CUDA graphs: greedy tokens equal transformers' own
`generate` (float32), as on the reference attention. Run on the GPU machine with
`python -m pytest tests/gpu -q`."""

from __future__ import annotations

import pytest
import torch

from tests.models.hf_tiny import FLAT_IMAGES, build_tiny
from tests.models.test_transformers_backend import Reference, _prompts, _run
from vlmserve import LLM

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


# sliding layers and images both ways (Gemma 3), soft-capping and a prompt both ways
# (PaliGemma's Gemma 2), chunked layers (Llama 4), sliding layers beside full ones without
# RoPE (Aya Vision's Cohere2)
@pytest.mark.parametrize("name", ["gemma3", "paligemma", "llama4", "aya_vision"])
def test_windows_on_triton_and_graphs_match_transformers(vlmserve_cache, tmp_path, name):
    path = str(build_tiny(name, tmp_path / name))
    ref = Reference(path, flat=name in FLAT_IMAGES)
    llm = LLM(path, model_impl="transformers", dtype="float32", device="cuda",
              attention_backend="triton", max_num_seqs=4)
    prompts = _prompts(llm, name)
    expected = [ref.generate(p, imgs) for p, imgs in prompts]
    assert _run(llm, prompts) == expected
    assert llm.engine.executor.runner.num_graph_steps > 0
