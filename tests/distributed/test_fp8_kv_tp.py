"""An FP8 KV cache under tensor parallelism (CPU, gloo): each rank holds its KV heads in e4m3
with the checkpoint's per-tensor scales (the same on every rank) and the ranks give the
greedy tokens of one process, the second time from the prefix cache."""

from __future__ import annotations

import torch

from tests.distributed.helpers import one_process, token_ids
from vlmserve import LLM, SamplingParams


def test_tp2_fp8_cache_matches_single_process(vlmserve_cache):
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    kw = dict(dtype="float32", device="cpu", kv_cache_dtype="fp8", max_num_seqs=4,
              max_num_batched_tokens=37)
    _, prompts, expected = one_process("tiny-qwen2-vl", params, count=3, **kw)
    tp = LLM("tiny-qwen2-vl", tensor_parallel_size=2, **kw)
    try:
        cache = tp.engine.executor.runner.kv_caches[0]
        assert cache.dtype == torch.float8_e4m3fn and cache.shape[-2] == 1  # 1 of 2 KV heads
        assert token_ids(tp, prompts, params) == expected
        assert token_ids(tp, prompts, params) == expected
        assert tp.engine.get_stats()["prefix_cache_hit_tokens"] > 0
    finally:
        tp.engine.shutdown()
