"""`SamplingParams(logprobs=k)`: each generated token's raw log-probabilities equal
log_softmax of transformers' logits on the tiny checkpoint, for greedy and sampled requests,
through batching, chunked prefill, preemption and async scheduling; only steps where a
request asked compute them."""

from __future__ import annotations

import pytest
import torch

from tests.engine.helpers import HFOracle, chat_prompt, make_image, mixed_prompts
from vlmserve import LLM, SamplingParams
from vlmserve.models.builtin import resolve_model
from vlmserve.worker import model_runner

MODEL, ARCH = "tiny-qwen2-vl", "Qwen2VLForConditionalGeneration"
ATOL = 2e-4  # float32 on the CPU, two implementations of the same model


@pytest.fixture(scope="module")
def llm(vlmserve_cache) -> LLM:
    return LLM(MODEL, dtype="float32", device="cpu", max_num_batched_tokens=256)


@pytest.fixture(scope="module")
def oracle(vlmserve_cache) -> HFOracle:
    return HFOracle(resolve_model(MODEL), ARCH)


def check_against(logprobs: list[dict[int, float]], token_ids: list[int],
                  ref_logits: torch.Tensor, k: int) -> None:
    """Each token's dict: the k most likely of log_softmax(ref_logits) in order, with their
    values, plus the sampled token with its value."""
    ref = torch.log_softmax(ref_logits, dim=-1)  # [T, vocab]
    assert len(logprobs) == len(token_ids) == ref.shape[0]
    for t, (lps, token) in enumerate(zip(logprobs, token_ids)):
        ids = list(lps)
        assert token in lps, "the sampled token is always in the dict"
        assert lps[token] == pytest.approx(ref[t, token].item(), abs=ATOL)
        top = ids[:k]
        assert len(ids) == k + (token not in top)
        values = [lps[i] for i in top]
        assert values == sorted(values, reverse=True), "most likely first"
        ref_top = ref[t].topk(k)
        torch.testing.assert_close(torch.tensor(values), ref_top.values, atol=ATOL, rtol=0)
        for i in top:  # the same tokens (up to ties within the tolerance)
            assert ref[t, i].item() >= ref_top.values[-1].item() - ATOL
        if token not in top:
            assert ids[-1] == token


def test_greedy_logprobs_equal_hf_log_softmax(llm, oracle) -> None:
    """With an image; the greedy token is the most likely one."""
    prompt = chat_prompt(llm, "What is this?", [make_image(112, 84, 1)])
    k = 5
    out = llm.generate([prompt], SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True,
                                                logprobs=k), use_tqdm=False)[0].outputs[0]
    tokens, logits = oracle.generate_with_logits(llm.engine.input_processor.process(prompt), 8)
    assert out.token_ids == tokens
    check_against(out.logprobs, out.token_ids, logits, k)
    for lps, token in zip(out.logprobs, out.token_ids):
        assert next(iter(lps)) == token
        assert len(lps) == k


def test_sampled_logprobs_are_raw_and_hold_the_sampled_token(llm, oracle) -> None:
    """temperature, top_k and top_p change what is sampled, not the logprobs reported (the
    raw ones); logprobs=0 gives the sampled token's alone."""
    prompts = [chat_prompt(llm, "Tell me a story.", []),
               chat_prompt(llm, "Two images.", [make_image(56, 84, 2), make_image(84, 56, 3)])]
    for k, extra in ((0, {}), (3, {"top_k": 40, "top_p": 0.9})):
        params = SamplingParams(max_tokens=10, temperature=1.7, seed=11, ignore_eos=True,
                                logprobs=k, **extra)
        outs = llm.generate(prompts, params, use_tqdm=False)
        for prompt, out in zip(prompts, outs):
            c = out.outputs[0]
            logits = oracle.score(llm.engine.input_processor.process(prompt), c.token_ids)
            check_against(c.logprobs, c.token_ids, logits, k)
            if k == 0:
                assert all(list(lps) == [t] for lps, t in zip(c.logprobs, c.token_ids))
        if k == 3:  # at this temperature some sampled tokens are not among the top 3
            assert any(len(lps) == 4 for out in outs for lps in out.outputs[0].logprobs)


@pytest.mark.parametrize("engine_kwargs", [
    {"max_num_batched_tokens": 37, "max_num_seqs": 3},
    {"num_kv_blocks": 24, "block_size": 8, "max_num_batched_tokens": 128},
    {"async_scheduling": False, "max_num_batched_tokens": 64},
])
def test_logprobs_through_chunking_preemption_and_sync_scheduling(oracle, engine_kwargs
                                                                    ) -> None:
    """Mixed batches where every other request asks: each gets one dict per token, equal to
    the reference; the others get none."""
    llm = LLM(MODEL, dtype="float32", device="cpu", **engine_kwargs)
    prompts = mixed_prompts(llm)
    params = [SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True,
                             logprobs=2 if i % 2 == 0 else None) for i in range(len(prompts))]
    outs = llm.generate(prompts, params, use_tqdm=False)
    for i, (prompt, out) in enumerate(zip(prompts, outs)):
        c = out.outputs[0]
        if i % 2:
            assert c.logprobs is None
            continue
        tokens, logits = oracle.generate_with_logits(
            llm.engine.input_processor.process(prompt), 6)
        assert c.token_ids == tokens
        check_against(c.logprobs, c.token_ids, logits, 2)
    if "num_kv_blocks" in engine_kwargs:
        assert llm.engine.core.scheduler.num_preemptions > 0


def test_only_steps_where_a_request_asked_compute_logprobs(llm, monkeypatch) -> None:
    """No full-vocabulary log_softmax when nobody asked; when one request of three asks, only
    its row is computed."""
    calls: list[int] = []
    compute = model_runner.compute_logprobs

    def counted(logits, tokens, rows, k):
        calls.append(len(rows))
        return compute(logits, tokens, rows, k)

    monkeypatch.setattr(model_runner, "compute_logprobs", counted)
    prompts = [chat_prompt(llm, text, []) for text in ("One.", "Two, longer.", "Three")]
    plain = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    llm.generate(prompts, plain, use_tqdm=False)
    assert calls == []
    asking = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True, logprobs=1)
    outs = llm.generate(prompts, [plain, asking, plain], use_tqdm=False)
    assert calls and set(calls) == {1}
    assert [o.outputs[0].logprobs is None for o in outs] == [True, False, True]
    assert len(outs[1].outputs[0].logprobs) == 4


@pytest.mark.parametrize("bad", [-1, 21, 1.5, True, "3"])
def test_bad_logprobs_are_refused(bad) -> None:
    with pytest.raises(ValueError, match="logprobs"):
        SamplingParams(logprobs=bad)


def check_prompt_logprobs(out, processed, oracle, k: int) -> None:
    """`out.prompt_logprobs`: None for the first prompt token, then for token t the k most
    likely at position t - 1 and token t, equal to log_softmax of transformers' logits over
    the prompt; `prompt_logprob_ranks` that token's rank there."""
    ids = processed.prompt_token_ids
    ref_ids, kwargs = oracle._inputs(processed)
    with torch.inference_mode():
        logits = oracle.model(input_ids=ref_ids, attention_mask=torch.ones_like(ref_ids),
                              **kwargs).logits[0, :-1].float().cpu()
    assert len(out.prompt_logprobs) == len(out.prompt_logprob_ranks) == len(ids)
    assert out.prompt_logprobs[0] is None and out.prompt_logprob_ranks[0] is None
    check_against(out.prompt_logprobs[1:], ids[1:], logits, k)
    ref = torch.log_softmax(logits, dim=-1)
    for t, rank in enumerate(out.prompt_logprob_ranks[1:]):
        value = ref[t, ids[t + 1]]
        assert (ref[t] > value + ATOL).sum() + 1 <= rank <= (ref[t] > value - ATOL).sum() + 1


@pytest.mark.parametrize("engine_kwargs", [
    {"max_num_batched_tokens": 37, "max_num_seqs": 3},
    {"num_kv_blocks": 24, "block_size": 8, "max_num_batched_tokens": 128},
    {"async_scheduling": False, "max_num_batched_tokens": 64},
])
def test_prompt_logprobs_equal_hf_through_chunks_and_preemption(oracle, engine_kwargs) -> None:
    """Every other request scores its prompt (`prompt_logprobs`, k 0 and 3): chunks cut
    through images, preemption, sync scheduling leave the scores equal to transformers'; the
    generated tokens are those of the requests that did not ask."""
    llm = LLM(MODEL, dtype="float32", device="cpu", **engine_kwargs)
    prompts = mixed_prompts(llm)
    params = [SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True,
                             prompt_logprobs=(3 if i % 4 == 0 else 0) if i % 2 == 0 else None)
              for i in range(len(prompts))]
    outs = llm.generate(prompts, params, use_tqdm=False)
    plain = llm.generate(prompts, SamplingParams(max_tokens=4, temperature=0.0,
                                                 ignore_eos=True), use_tqdm=False)
    for i, (prompt, out) in enumerate(zip(prompts, outs)):
        assert out.outputs[0].token_ids == plain[i].outputs[0].token_ids
        if i % 2:
            assert out.prompt_logprobs is None and out.prompt_logprob_ranks is None
            continue
        check_prompt_logprobs(out, llm.engine.input_processor.process(prompt), oracle,
                              params[i].prompt_logprobs)
    if "num_kv_blocks" in engine_kwargs:
        assert llm.engine.core.scheduler.num_preemptions > 0


def test_prompt_logprobs_skip_the_prefix_cache(llm, oracle) -> None:
    """A prompt seen before is cached; a request scoring it computes it all again, and both
    scores are the same; delta outputs carry them once, with the first token."""
    prompt = chat_prompt(llm, "Score every token of this prompt, please.",
                         [make_image(84, 84, 4)])
    params = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True, prompt_logprobs=2)
    llm.generate([prompt], SamplingParams(max_tokens=1), use_tqdm=False)  # now cached
    kv = llm.engine.core.scheduler.kv
    hits = kv.num_hit_tokens
    first, second = (llm.generate([prompt], params, use_tqdm=False)[0] for _ in range(2))
    assert kv.num_hit_tokens == hits
    assert first.prompt_logprobs == second.prompt_logprobs
    check_prompt_logprobs(first, llm.engine.input_processor.process(prompt), oracle, 2)
    engine = llm.engine
    engine.add_request(prompt, SamplingParams(
        max_tokens=3, temperature=0.0, ignore_eos=True, prompt_logprobs=2, output_kind="delta"),
        request_id="delta")
    outs = []
    while engine.has_unfinished_requests():
        outs += [o for o in engine.step() if o.request_id == "delta"]
    assert [o.prompt_logprobs is not None for o in outs] == [True] + [False] * (len(outs) - 1)
    assert outs[0].prompt_logprobs == first.prompt_logprobs
