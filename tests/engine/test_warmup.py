"""The start-up warm-up (worker/warmup.py): it leaves the runner exactly as it was, an engine
warmed up gives the same greedy tokens and statistics as one that was not, and its plan of
attention launches covers every variant the engine's step shapes can select."""

from __future__ import annotations

import random

import pytest
import torch

from tests.engine.helpers import mixed_prompts
from vlmserve import LLM, SamplingParams
from vlmserve.layers.attention_launch import paged_launch, varlen_launch
from vlmserve.worker.warmup_plan import Limits, plan_paged, plan_varlen

GREEDY = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)


def runner_state(runner) -> dict:
    """Everything a step may change in the runner, as plain values."""
    store, enc = runner.store, runner.encoder
    return {
        "objects": (id(store), id(enc), id(runner.requests)),
        "requests": dict(runner.requests),
        "paused": dict(runner._paused_generators),
        "store": (store.num_entries, store.bytes_on_device, store.bytes_on_host, store.step,
                  list(store.trace), vars(store.stats).copy(), dict(store._fresh)),
        "encoder": (enc.num_images, enc.num_batches, enc.staging.turn),
        "counters": (runner._num_results, runner.num_graph_steps),
        "sampled": runner.sampled.clone(),
        "kv": [kv.clone() for kv in runner.kv_caches],
        "rng": torch.get_rng_state(),
    }


def assert_same_state(before: dict, after: dict) -> None:
    for key in before:
        a, b = before[key], after[key]
        if key == "kv":
            assert all(torch.equal(x, y) for x, y in zip(a, b)), "KV cache changed"
        elif isinstance(a, torch.Tensor):
            assert torch.equal(a, b), key
        else:
            assert a == b, key


@pytest.mark.parametrize("model, offload", [("tiny-qwen2-vl", False), ("tiny-qwen2.5-vl", True),
                                           ("tiny-qwen3-vl", True)])
def test_warmup_leaves_no_state_and_same_greedy_output(vlmserve_cache, model, offload):
    kw = dict(dtype="float32", device="cpu", max_num_seqs=4, max_num_batched_tokens=64,
              mm_embedding_offload=offload)
    warm = LLM(model, **kw)
    runner = warm.engine.executor.runner
    before = runner_state(runner)
    calls = []
    forward = runner._forward_eager
    runner._forward_eager = lambda *a: calls.append(a[1]) or forward(*a)
    seconds = warm.engine.executor.warmup()
    del runner._forward_eager
    assert 0 < seconds < 30
    # the fake steps ran: a prefill with images, mixed, decode-shaped and one-token steps
    assert len(calls) == 5 and calls[-1] == [1] and max(calls[0]) > 1
    assert_same_state(before, runner_state(runner))

    cold = LLM(model, **kw)
    prompts = mixed_prompts(warm)
    got = [o.outputs[0].token_ids for o in warm.generate(prompts, GREEDY, use_tqdm=False)]
    want = [o.outputs[0].token_ids for o in cold.generate(prompts, GREEDY, use_tqdm=False)]
    assert got == want
    stats = [{k: v for k, v in llm.engine.get_stats().items()  # counters, not timings
              if isinstance(v, int) and k != "time" and not k.endswith("_s")}
             for llm in (warm, cold)]
    assert stats[0] == stats[1] and stats[0]["encoder_batches"] > 0


def test_warmup_restores_the_runner_when_a_step_fails(vlmserve_cache):
    llm = LLM("tiny-qwen2-vl", dtype="float32", device="cpu", max_num_batched_tokens=64)
    runner = llm.engine.executor.runner
    before = runner_state(runner)
    attention = runner.attention_fn
    steps = 0
    execute = runner.execute_model

    def failing(so):
        nonlocal steps
        steps += 1
        if steps == 3:
            raise RuntimeError("boom")
        return execute(so)

    runner.execute_model = failing
    with pytest.raises(RuntimeError, match="boom"):
        llm.engine.executor.warmup()
    del runner.execute_model
    assert_same_state(before, runner_state(runner))
    layer = runner.model.language_model.layers[0].self_attn
    assert layer.attn_fn is attention  # the recording wrapper is gone


MODELS = [(12, 2, 128), (28, 4, 128), (2, 2, 16), (16, 16, 80)]  # 2B, 7B, tiny, one KV head
LIMITS = [Limits(512, 16384, 32768, 16384), Limits(20, 512, 4096, 512), Limits(4, 64, 300, 64)]


def random_step(rng: random.Random, lim: Limits) -> tuple[list[int], list[int]]:
    """Query and context lengths of a step the scheduler could make under `lim`."""
    b = rng.randint(1, min(lim.max_num_seqs, lim.max_num_batched_tokens))
    query = [1] * b
    left = lim.max_num_batched_tokens - b
    if rng.random() < 0.7:  # some prefill chunks
        for i in rng.sample(range(b), rng.randint(1, b)):
            extra = rng.randint(0, min(left, rng.choice([3, 60, 500, left])))
            query[i] += extra
            left -= extra
    query = [min(q, lim.max_model_len) for q in query]
    ctx = [min(q + rng.choice([0, rng.randint(0, lim.max_model_len)]), lim.max_model_len)
           for q in query]
    return query, ctx


@pytest.mark.parametrize("fp32", [False, True], ids=["bf16", "fp32"])
@pytest.mark.parametrize("sms", [132, 16])
def test_paged_plan_covers_every_step_shape(fp32, sms):
    rng = random.Random(f"{fp32}{sms}")
    for heads, kv_heads, dim in MODELS:
        for lim in LIMITS:
            plan = plan_paged(lim, heads, kv_heads, dim, fp32, sms)
            shapes = plan.shapes()
            assert len(shapes) == len(set(shapes)) <= len(plan.variants) + len(
                plan.merge_variants)
            for _ in range(300):
                query, ctx = random_step(rng, lim)
                cfg = paged_launch(sum(query), len(query), max(query), max(ctx), heads,
                                   kv_heads, dim, fp32, sms)
                assert cfg.variant in plan.variants, (query, ctx)
                assert cfg.merge_variant is None or cfg.merge_variant in plan.merge_variants
            for query, ctx in shapes:  # every planned shape is one the limits allow
                assert len(query) <= lim.max_num_seqs
                assert sum(query) <= lim.max_num_batched_tokens
                assert max(ctx) <= lim.max_model_len and all(map(int.__le__, query, ctx))


@pytest.mark.parametrize("fp32", [False, True], ids=["bf16", "fp32"])
def test_varlen_plan_covers_every_segmentation(fp32):
    rng = random.Random(fp32)
    for lim in LIMITS:
        plan = plan_varlen(lim, fp32)
        unit, max_total = lim.patches_per_row, lim.max_encoder_rows * lim.patches_per_row
        for _ in range(300):
            n = rng.randint(1, lim.max_encoder_rows)
            lens = [unit * rng.choice([1, 2, 4, 16, rng.randint(1, 300)])
                    for _ in range(min(n, 40))] + [unit] * max(n - 40, 0)
            if sum(lens) > max_total:
                continue
            assert varlen_launch(sum(lens), n, max(lens), fp32).variant in plan
        for lens in plan.values():
            assert sum(lens) <= max_total and min(lens) >= unit
