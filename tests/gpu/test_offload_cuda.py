"""GPU only: the offload path with real streams and events (pinned host entries, copy stream,
ping-pong buffers) gives the same greedy tokens as keeping embeddings on the device."""

from __future__ import annotations

import pytest
import torch

from tests.engine.helpers import mixed_prompts
from vlmserve import LLM, SamplingParams

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.mark.parametrize("model", ["tiny-qwen2-vl", "tiny-qwen2.5-vl"])
def test_offload_on_cuda_matches_device_resident(vlmserve_cache, model):
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    runs = {}
    for offload in (False, True):
        llm = LLM(model, dtype="float32", device="cuda", max_num_seqs=4,
                  max_num_batched_tokens=37, mm_embedding_offload=offload)
        outs = llm.generate(mixed_prompts(llm) * 2, params, use_tqdm=False)
        runs[offload] = [o.outputs[0].token_ids for o in outs]
        stats = llm.engine.get_stats()
        if offload:
            store = llm.engine.executor.runner.store
            assert stats["prefetch_hit_rows"] > 0
            assert stats["mm_embedding_peak_bytes_device"] == sum(
                b.numel() * b.element_size() for b in store._buffers)
            assert all(t.is_pinned() for t in store._host.values())
    assert runs[True] == runs[False]
