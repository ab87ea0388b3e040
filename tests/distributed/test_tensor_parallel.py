"""Tensor parallelism on the CPU: ranks in separate processes over gloo give the same greedy
tokens as one process (and so as transformers), for both model families."""

from __future__ import annotations

import os

import pytest

from tests.engine.helpers import mixed_prompts
from vlmserve import LLM, SamplingParams


@pytest.mark.parametrize("model", ["tiny-qwen2-vl", "tiny-qwen2.5-vl"])
def test_tp2_matches_single_process(vlmserve_cache, model):
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    kw = dict(dtype="float32", device="cpu", max_num_batched_tokens=37, max_num_seqs=4)
    single = LLM(model, **kw)
    prompts = mixed_prompts(single)
    expected = [o.outputs[0].token_ids for o in single.generate(prompts, params, use_tqdm=False)]
    tp = LLM(model, tensor_parallel_size=2, **kw)
    try:
        runner = tp.engine.executor.runner
        attn = runner.model.language_model.layers[0].self_attn
        assert (attn.heads, attn.kv_heads) == (2, 1)  # 4 heads / 2 KV heads split over 2
        outs = tp.generate(prompts, params, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outs] == expected
        stats = tp.engine.get_stats()
        assert stats["num_free_kv_blocks"] == stats["num_kv_blocks"]
    finally:
        tp.engine.shutdown()


def test_tp4_replicates_kv_heads(vlmserve_cache):
    """4 ranks, 2 KV heads: each KV head lives on two ranks, each rank has one query head;
    with the start-up warm-up on every rank."""
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    kw = dict(dtype="float32", device="cpu", max_num_batched_tokens=64)
    single = LLM("tiny-qwen2-vl", **kw)
    prompts = mixed_prompts(single)[:4]
    expected = [o.outputs[0].token_ids for o in single.generate(prompts, params, use_tqdm=False)]
    # every rank runs the start-up warm-up: its steps' collectives must pair up across ranks
    tp = LLM("tiny-qwen2-vl", tensor_parallel_size=4, kernel_warmup=True, **kw)
    try:
        attn = tp.engine.executor.runner.model.language_model.layers[0].self_attn
        assert (attn.heads, attn.kv_heads) == (1, 1)
        outs = tp.generate(prompts, params, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outs] == expected
    finally:
        tp.engine.shutdown()


def test_tp_must_divide_heads(vlmserve_cache):
    with pytest.raises(ValueError, match="must divide"):
        LLM("tiny-qwen2-vl", dtype="float32", device="cpu", tensor_parallel_size=3)


def test_row_parallel_bias_is_added_once_after_the_sum():
    """Two ranks' halves of an o_proj with a bias (Llama's `attention_bias`): the bias is
    added after the all-reduce, once, so the sum equals the whole layer."""
    import torch

    from vlmserve.distributed.tensor_parallel import RowParallelLinear

    class _Sum:  # the all-reduce of two ranks, both computed here
        def __init__(self) -> None:
            self.parts: list[torch.Tensor] = []

        def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
            self.parts.append(x)
            return x

    torch.manual_seed(0)
    x, w, b = torch.randn(3, 8), torch.randn(5, 8), torch.randn(5)
    tp = _Sum()
    halves = [RowParallelLinear(w[:, i * 4:(i + 1) * 4].clone(), tp, b.clone())
              for i in range(2)]
    for i, layer in enumerate(halves):
        layer(x[:, i * 4:(i + 1) * 4])
    total = tp.parts[0] + tp.parts[1] + b
    torch.testing.assert_close(total, x @ w.T + b)


def test_tp2_llava_matches_single_process(vlmserve_cache):
    from tests.engine.helpers import make_image

    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    kw = dict(dtype="float32", device="cpu", max_num_batched_tokens=64, max_num_seqs=4)
    convs = [[{"role": "user", "content": [{"type": "image", "image": make_image(w, h, i)},
                                           {"type": "text", "text": "Describe."}]}]
             for i, (w, h) in enumerate([(84, 84), (120, 60)])]
    convs.append([{"role": "user", "content": "Just text."}])
    single = LLM("tiny-llava-1.5", **kw)
    expected = [o.outputs[0].token_ids for o in single.chat(convs, params, use_tqdm=False)]
    tp = LLM("tiny-llava-1.5", tensor_parallel_size=2, **kw)
    try:
        outs = tp.chat(convs, params, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outs] == expected
    finally:
        tp.engine.shutdown()


def test_a_dead_rank_stops_the_engine_with_an_error_not_a_hang(vlmserve_cache):
    import os
    import signal
    import time

    from vlmserve.distributed.parallel_state import RankFailedError

    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    tp = LLM("tiny-qwen2-vl", tensor_parallel_size=2, dtype="float32", device="cpu",
             max_num_batched_tokens=64, tp_timeout=20)
    try:
        assert len(tp.generate(["Hello"], params, use_tqdm=False)[0].outputs[0].token_ids) == 4
        rank1 = tp.engine.executor._procs[0]
        os.kill(rank1.pid, signal.SIGKILL)
        rank1.join(10)
        start = time.monotonic()
        with pytest.raises(RankFailedError, match="rank 1 exited"):
            tp.generate(["Hello again"], params, use_tqdm=False)
        assert time.monotonic() - start < 10
    finally:
        tp.engine.shutdown()


def test_every_rank_takes_rank0s_tokens(vlmserve_cache, monkeypatch):
    """Rank 1's sampler sees other logits (fault injection: reversed); its tokens would
    differ, but every rank uses rank 0's, so the output equals one process's."""
    from pathlib import Path

    faults = str(Path(__file__).parents[1] / "e2e" / "fault_injection")
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(
        [faults, *filter(None, [os.environ.get("PYTHONPATH")])]))
    monkeypatch.setenv("VLMSERVE_PERTURB_RANK", "1")
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    kw = dict(dtype="float32", device="cpu", max_num_batched_tokens=64, max_num_seqs=4)
    prompts = ["One.", "Two three.", "Four five six."]
    single = LLM("tiny-qwen2-vl", **kw)
    expected = [o.outputs[0].token_ids for o in single.generate(prompts, params, use_tqdm=False)]
    tp = LLM("tiny-qwen2-vl", tensor_parallel_size=2, **kw)
    try:
        outs = tp.generate(prompts, params, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outs] == expected
    finally:
        tp.engine.shutdown()
