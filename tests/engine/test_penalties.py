"""Presence, frequency and repetition penalties, logit biases and min-p: the batched sampler
against their definitions, and greedy output token-for-token identical to transformers
`generate` with the same penalties (its repetition penalty; OpenAI's presence and frequency
penalties and logit biases as logits processors), requests with and without penalties in one
batch, through chunked prefill and preemption."""

from __future__ import annotations

import pytest
import torch

from tests.engine.helpers import HFOracle, chat_prompt, make_image
from vlmserve import LLM, SamplingParams
from vlmserve.errors import InvalidSamplingParamsError
from vlmserve.layers.sampler import TokenHistory, apply_penalties, sample

MAX_TOKENS = 12


def test_penalties_follow_their_definitions() -> None:
    torch.manual_seed(0)
    vocab = 30
    logits = torch.randn(4, vocab) * 3
    raw = logits.clone()
    prompt, out = [1, 2, 3, 3], [3, 5, 5, 5, 7]
    params = [SamplingParams(temperature=0.0),
              SamplingParams(presence_penalty=0.5, frequency_penalty=0.25),
              SamplingParams(repetition_penalty=1.5, logit_bias={0: 2.0, 29: -100.0}),
              SamplingParams(repetition_penalty=0.8, presence_penalty=-1.0)]
    history = [None] + [TokenHistory(p, prompt + out, len(prompt), vocab, torch.device("cpu"))
                        for p in params[1:]]
    got = apply_penalties(logits, params, history)
    assert torch.equal(logits, raw)  # the raw logits stay as they were (logprobs read them)
    counts = torch.bincount(torch.tensor(out), minlength=vocab).float()
    seen = (counts > 0) | torch.isin(torch.arange(vocab), torch.tensor(prompt))

    def rep(x, r):
        return torch.where(seen, torch.where(x > 0, x / r, x * r), x)
    torch.testing.assert_close(got[0], raw[0], rtol=0, atol=0)
    torch.testing.assert_close(got[1], raw[1] - 0.25 * counts - 0.5 * (counts > 0))
    want = rep(raw[2], 1.5)
    want[0] += 2.0
    want[29] -= 100.0
    torch.testing.assert_close(got[2], want)
    torch.testing.assert_close(got[3], rep(raw[3], 0.8) + 1.0 * (counts > 0))
    # the history counts what is sampled after
    history[1].count(torch.tensor([7]))
    assert history[1].counts[7].item() == 2 and history[1].counts[5].item() == 3


def test_min_p_drops_tokens_below_its_share_of_the_top_one() -> None:
    torch.manual_seed(1)
    logits = torch.log(torch.tensor([0.5, 0.3, 0.12, 0.05, 0.03]))
    n = 20_000
    params = [SamplingParams(temperature=1.0, min_p=0.2)] * n
    tokens = sample(logits.expand(n, -1).clone(), params, [None] * n)
    freq = torch.bincount(tokens, minlength=5).float() / n
    assert (freq[3:] == 0).all()  # 0.05 and 0.03 < 0.2 * 0.5 <= 0.12
    torch.testing.assert_close(freq[:3], torch.tensor([0.5, 0.3, 0.12]) / 0.92, atol=0.015,
                               rtol=0)


class _OpenAIPenalties:
    """transformers logits processor: OpenAI's presence and frequency penalties over the
    generated tokens, and logit biases."""

    def __init__(self, num_prompt: int, presence: float, frequency: float, bias: dict) -> None:
        self.num_prompt, self.presence, self.frequency, self.bias = (num_prompt, presence,
                                                                     frequency, bias)

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        counts = torch.zeros_like(scores)
        counts.scatter_add_(1, input_ids[:, self.num_prompt:],
                            torch.ones_like(input_ids[:, self.num_prompt:], dtype=scores.dtype))
        scores = scores - self.frequency * counts - self.presence * (counts > 0)
        for token, b in self.bias.items():
            scores[:, token] += b
        return scores


def _hf(oracle: HFOracle, processed, params: SamplingParams) -> list[int]:
    from transformers import LogitsProcessorList

    processors = LogitsProcessorList()
    if params.presence_penalty or params.frequency_penalty or params.logit_bias:
        processors.append(_OpenAIPenalties(len(processed.prompt_token_ids),
                                           params.presence_penalty, params.frequency_penalty,
                                           params.logit_bias))
    tokens, _ = oracle._generate(processed, MAX_TOKENS,
                                 repetition_penalty=params.repetition_penalty,
                                 logits_processor=processors)
    return tokens


@pytest.fixture(scope="module")
def setup(vlmserve_cache):
    from vlmserve.models.builtin import resolve_model

    llm = LLM("tiny-qwen2-vl", dtype="float32")
    return llm, HFOracle(resolve_model("tiny-qwen2-vl"), "Qwen2VLForConditionalGeneration")


@pytest.mark.parametrize("engine_kwargs", [
    {},
    # chunks cut through images, and preemption (a resumed request's counts rebuilt)
    {"max_num_batched_tokens": 37, "max_num_seqs": 5, "num_kv_blocks": 24, "block_size": 8},
])
def test_greedy_with_penalties_matches_transformers(setup, engine_kwargs) -> None:
    llm, oracle = setup
    if engine_kwargs:
        llm = LLM("tiny-qwen2-vl", dtype="float32", **engine_kwargs)
    prompts = [chat_prompt(llm, "Describe the picture.", [make_image(84, 56, 11)]),
               {"prompt": "Once upon a time there was"},
               chat_prompt(llm, "What is in it?", [make_image(56, 112, 12)]),
               {"prompt": "The quick brown fox"},
               chat_prompt(llm, "And now?", [make_image(112, 84, 13)])]
    base = dict(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    params = [SamplingParams(**base, repetition_penalty=1.8),
              SamplingParams(**base, presence_penalty=1.5, frequency_penalty=0.9),
              SamplingParams(**base),
              SamplingParams(**base, repetition_penalty=1.3, presence_penalty=2.0,
                             logit_bias={5: 3.0, 7: -100.0}),
              SamplingParams(**base, frequency_penalty=-0.5)]
    outs = llm.generate(prompts, params, use_tqdm=False)
    changed = 0
    for prompt, p, out in zip(prompts, params, outs):
        processed = llm.engine.input_processor.process(prompt)
        got = out.outputs[0].token_ids
        assert got == _hf(oracle, processed, p), (prompt.get("prompt"), p)
        changed += got != oracle.generate(processed, MAX_TOKENS)
    assert changed >= 3  # the penalties changed the greedy path (the test can fail)
    if engine_kwargs:
        assert llm.engine.scheduler.num_preemptions > 0


def test_bad_penalties_are_refused_naming_the_field(setup) -> None:
    llm, _ = setup
    for kw, name in [({"presence_penalty": 2.5}, "presence_penalty"),
                     ({"frequency_penalty": float("nan")}, "frequency_penalty"),
                     ({"repetition_penalty": 0.0}, "repetition_penalty"),
                     ({"min_p": 1.5}, "min_p"),
                     ({"logit_bias": {-1: 1.0}}, "logit_bias"),
                     ({"logit_bias": {1: 101.0}}, "logit_bias")]:
        with pytest.raises(InvalidSamplingParamsError, match=name):
            SamplingParams(**kw)
    vocab = llm.engine.input_processor.vocab_size
    with pytest.raises(InvalidSamplingParamsError, match="vocabulary"):
        llm.generate("Hi", SamplingParams(logit_bias={vocab: 1.0}), use_tqdm=False)


def test_min_tokens_holds_back_stop_tokens_like_transformers_min_new_tokens(setup) -> None:
    """min_tokens: no stop token (nor EOS) before that many tokens, as transformers'
    min_new_tokens; stop strings do not end the request before then either."""
    from transformers import GenerationConfig

    llm, oracle = setup
    prompt = chat_prompt(llm, "Describe the picture.", [make_image(84, 56, 11)])
    processed = llm.engine.input_processor.process(prompt)
    path = oracle.generate(processed, MAX_TOKENS)
    stop = path[1]  # the second greedy token, as a stop token
    base = dict(max_tokens=MAX_TOKENS, temperature=0.0, stop_token_ids=[stop])
    early = llm.generate(prompt, SamplingParams(**base), use_tqdm=False)[0].outputs[0]
    assert early.token_ids == path[:2] and early.finish_reason == "stop"
    got = llm.generate(prompt, SamplingParams(**base, min_tokens=5), use_tqdm=False)[0].outputs[0]
    ids, kwargs = oracle._inputs(processed)
    cfg = GenerationConfig(max_new_tokens=MAX_TOKENS, min_new_tokens=5, do_sample=False,
                           eos_token_id=[stop], pad_token_id=0)
    want = oracle.model.generate(input_ids=ids, attention_mask=ids.new_ones(ids.shape),
                                 generation_config=cfg, **kwargs)[0, ids.shape[1]:].tolist()
    assert got.token_ids == want and len(got.token_ids) > 5 and stop not in got.token_ids[:5]
    # a stop string: the text of the first token, found again only from min_tokens on
    text = llm.get_tokenizer().decode(path[:1])
    cut = llm.generate(prompt, SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0,
                                              ignore_eos=True, stop=[text]),
                       use_tqdm=False)[0].outputs[0]
    held = llm.generate(prompt, SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0,
                                               ignore_eos=True, stop=[text], min_tokens=3),
                        use_tqdm=False)[0].outputs[0]
    assert cut.finish_reason == "stop" and len(cut.token_ids) == 1
    assert len(held.token_ids) >= 3
    with pytest.raises(InvalidSamplingParamsError, match="min_tokens"):
        SamplingParams(max_tokens=4, min_tokens=5)
