"""Two GPUs or more only: tensor parallelism on CUDA (NCCL) for each vision mode, with image
embeddings offloaded (pinned host rows held once per host, by rank 0, and broadcast to the
other rank): greedy tokens equal one GPU's, float32. The CPU tests (gloo) check the same
logic; this checks the NCCL and stream paths (host-group broadcast, pixels to the encoding
rank, the split vision tower)."""

from __future__ import annotations

import pytest
import torch

from tests.engine.helpers import mixed_prompts
from vlmserve import LLM, SamplingParams

pytestmark = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")

PARAMS = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
OPTS = dict(dtype="float32", device="cuda", max_num_seqs=4, max_num_batched_tokens=37,
            mm_embedding_offload=True)


@pytest.fixture(scope="module")
def reference(vlmserve_cache):
    runs: dict[str, tuple[list, list]] = {}

    def get(model: str) -> tuple[list, list]:
        if model not in runs:
            llm = LLM(model, **OPTS)
            prompts = mixed_prompts(llm)
            runs[model] = (prompts, [o.outputs[0].token_ids
                                     for o in llm.generate(prompts, PARAMS, use_tqdm=False)])
            llm.engine.shutdown()
        return runs[model]
    return get


@pytest.mark.parametrize("mode", ["data", "replicate", "weights"])
@pytest.mark.parametrize("model", ["tiny-qwen2-vl", "tiny-llava-next"])
def test_tp2_on_cuda_matches_one_gpu(reference, model, mode):
    prompts, expected = reference(model)
    tp = LLM(model, tensor_parallel_size=2, mm_encoder_tp_mode=mode, **OPTS)
    try:
        leader, other = tp.engine.executor.rank_load_stats
        assert leader.host_cache_bytes > 0 and other.host_cache_bytes == 0
        outs = tp.generate(prompts, PARAMS, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outs] == expected
        assert tp.engine.get_stats()["prefetch_hit_rows"] > 0  # rows came back from the host
    finally:
        tp.engine.shutdown()


@pytest.mark.parametrize("expert_parallel", [False, True])
def test_moe_tp2_on_cuda_matches_one_gpu(reference, expert_parallel):
    """Qwen3-VL-MoE on two GPUs: every expert's columns split, or each GPU half the experts
    (the Triton experts' skipped bucket, then NCCL's all-reduce)."""
    prompts, expected = reference("tiny-qwen3-vl-moe")
    tp = LLM("tiny-qwen3-vl-moe", tensor_parallel_size=2,
             enable_expert_parallel=expert_parallel, **OPTS)
    try:
        outs = tp.generate(prompts, PARAMS, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outs] == expected
    finally:
        tp.engine.shutdown()
