"""Structured outputs: every constrained output matches its JSON schema, regular expression,
choice or grammar, greedy and sampled; the greedy tokens are those of transformers `generate`
with the same grammar's mask as a logits processor, also through chunked prefill, preemption
and async scheduling; unconstrained requests batched with them are unchanged; a bad grammar
is refused naming the problem and the engine serves on."""

from __future__ import annotations

import json
import re

import pytest
import torch

from tests.engine.helpers import HFOracle, chat_prompt, make_image
from vlmserve import LLM, SamplingParams
from vlmserve.errors import InvalidSamplingParamsError
from vlmserve.layers.grammar import allocate_bitmask, apply_bitmask
from vlmserve.sampling_params import StructuredOutputsParams as SO

xgr = pytest.importorskip("xgrammar")

MAX_TOKENS = 48
SCHEMA = {"type": "object",
          "properties": {"color": {"enum": ["red", "green", "blue"]}, "ok": {"type": "boolean"},
                         "n": {"type": "integer", "minimum": 0, "maximum": 99}},
          "required": ["color", "ok", "n"], "additionalProperties": False}
REGEX = r"[a-c]{3}-\d{2}"
CHOICES = ["yes", "no", "a cat on the table"]
GRAMMAR = 'root ::= "(" digit+ ")"\ndigit ::= [0-9]'


def constraints() -> list[SO]:
    return [SO(json=SCHEMA, disable_any_whitespace=True), SO(regex=REGEX),
            SO(choice=CHOICES), SO(grammar=GRAMMAR),
            SO(json_object=True, disable_any_whitespace=True),
            SO(json=json.dumps(SCHEMA), disable_any_whitespace=True)]


def assert_matches(so: SO, text: str) -> None:
    kind = so.spec[0]
    if kind == "json":
        value = json.loads(text)
        assert set(value) == {"color", "ok", "n"} and value["color"] in ("red", "green", "blue")
        assert isinstance(value["ok"], bool) and 0 <= value["n"] <= 99
    elif kind == "json_object":
        assert isinstance(json.loads(text), dict)
    elif kind == "regex":
        assert re.fullmatch(REGEX, text), text
    elif kind == "choice":
        assert text in CHOICES
    else:
        assert re.fullmatch(r"\(\d+\)", text), text


@pytest.fixture(scope="module")
def llm(vlmserve_cache) -> LLM:
    return LLM("tiny-qwen2-vl", dtype="float32")


def prompts(llm: LLM) -> list:
    return [chat_prompt(llm, "Describe the picture as JSON.", [make_image(84, 56, 11)]),
            {"prompt": "Once upon a time there was"},
            chat_prompt(llm, "What is in it?", [make_image(56, 112, 12)]),
            {"prompt": "The quick brown fox"},
            chat_prompt(llm, "And now?", [make_image(112, 84, 13)]),
            {"prompt": "Answer with JSON:"}]


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_outputs_match_their_constraints_and_leave_the_others_alone(llm, temperature) -> None:
    ps = prompts(llm)
    cons = constraints()
    base = dict(max_tokens=MAX_TOKENS, temperature=temperature)
    params = [SamplingParams(**base, seed=i, structured_outputs=c) for i, c in enumerate(cons)]
    free = [SamplingParams(**base, seed=100 + i, ignore_eos=True) for i in range(3)]
    outs = llm.generate(ps + ps[:3], params + free, use_tqdm=False)
    for c, out in zip(cons, outs):
        o = out.outputs[0]
        if c.json_object and o.finish_reason == "length":  # a random model's keys go on
            assert o.text.startswith('{"'), o.text
            continue
        assert o.finish_reason == "stop", (c.spec, o.text)
        assert_matches(c, o.text)
    # the unconstrained requests sample as they do alone (seeded)
    alone = llm.generate(ps[:3], free, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs[len(cons):]] == [
        o.outputs[0].token_ids for o in alone]
    # the grammar changed the output (the test can fail)
    plain = llm.generate(ps, [SamplingParams(**base, seed=i) for i in range(len(ps))],
                         use_tqdm=False)
    assert sum(p.outputs[0].text != o.outputs[0].text for p, o in zip(plain, outs)) >= 5


class _GrammarProcessor:
    """transformers logits processor: the grammar's allowed tokens after the generated ones
    (xgrammar's matcher), nothing masked once the grammar has ended."""

    def __init__(self, compiled, num_prompt: int) -> None:
        self.matcher, self.num_prompt = xgr.GrammarMatcher(compiled), num_prompt
        self.bitmask = allocate_bitmask(1, compiled.tokenizer_info.vocab_size)

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        if input_ids.shape[1] > self.num_prompt:
            self.matcher.accept_token(int(input_ids[0, -1]))
        if self.matcher.is_terminated():
            return scores
        self.bitmask.fill_(-1)
        self.matcher.fill_next_token_bitmask(self.bitmask, 0)
        return apply_bitmask(scores, self.bitmask)


@pytest.mark.parametrize("engine_kwargs", [
    {},
    {"async_scheduling": False},
    # chunks cut through images, and preemption (a resumed request's matcher rebuilt)
    {"max_num_batched_tokens": 37, "max_num_seqs": 6, "num_kv_blocks": 30, "block_size": 8},
])
def test_greedy_matches_transformers_with_the_same_grammar(llm, engine_kwargs) -> None:
    from transformers import LogitsProcessorList

    from vlmserve.models.builtin import resolve_model

    oracle = HFOracle(resolve_model("tiny-qwen2-vl"), "Qwen2VLForConditionalGeneration")
    if engine_kwargs:
        llm = LLM("tiny-qwen2-vl", dtype="float32", **engine_kwargs)
    eos = list(llm.engine.core.eos_token_ids)
    tok = llm.get_tokenizer()
    vocab = oracle.model.config.get_text_config().vocab_size
    compiler = xgr.GrammarCompiler(xgr.TokenizerInfo.from_huggingface(
        tok, vocab_size=vocab, stop_token_ids=eos))
    ps, cons = prompts(llm), constraints()
    outs = llm.generate(ps, [SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0,
                                            structured_outputs=c) for c in cons],
                        use_tqdm=False)
    for prompt, c, out in zip(ps, cons, outs):
        processed = llm.engine.input_processor.process(prompt)
        kind, text, ws = c.spec
        compiled = (compiler.compile_json_schema(text, any_whitespace=ws) if kind == "json"
                    else compiler.compile_json_schema('{"type": "object"}', any_whitespace=ws)
                    if kind == "json_object" else compiler.compile_regex(text)
                    if kind == "regex" else compiler.compile_grammar(
                        text if kind == "grammar" else
                        "root ::= " + " | ".join(json.dumps(x) for x in json.loads(text))))
        proc = _GrammarProcessor(compiled, len(processed.prompt_token_ids))
        want, _ = oracle._generate(processed, MAX_TOKENS,
                                   logits_processor=LogitsProcessorList([proc]))
        got = out.outputs[0].token_ids
        assert got == want[:len(got)], (kind, got, want)
        assert got[-1] in eos if out.outputs[0].finish_reason == "stop" else len(got) == len(
            want), (kind, got, want)
    if "num_kv_blocks" in engine_kwargs:
        assert llm.engine.scheduler.num_preemptions > 0
    runner = llm.engine.executor.runner  # every compile handed over was taken, none kept
    assert runner.grammars._by_request == {} and runner._paused_grammars == {}


def test_bad_constraints_are_refused_naming_the_problem(llm) -> None:
    for kw, words in [({}, "exactly one"), ({"regex": "a", "choice": ["b"]}, "exactly one"),
                      ({"choice": []}, "choice"), ({"choice": ["a", ""]}, "choice"),
                      ({"regex": ""}, "regex"), ({"json": 5}, "json"),
                      ({"json": "{not json"}, "not valid JSON")]:
        with pytest.raises(InvalidSamplingParamsError, match=words):
            SO(**kw).spec  # noqa: B018 - what the front end checks
    for so, words in [(SO(regex="(unclosed"), "invalid regex"),
                      (SO(grammar="root ::= undefined_rule"), "invalid grammar"),
                      (SO(json={"type": "no-such-type"}), "invalid json")]:
        with pytest.raises(InvalidSamplingParamsError, match=words):
            llm.generate("Hi", SamplingParams(max_tokens=4, structured_outputs=so),
                         use_tqdm=False)
    # the engine serves on
    out = llm.generate("Hi", SamplingParams(max_tokens=8, temperature=0.0,
                                            structured_outputs=SO(choice=["ok"])),
                       use_tqdm=False)[0].outputs[0]
    assert out.text == "ok" and out.finish_reason == "stop"


def test_a_compiling_grammar_holds_its_request_back_not_the_steps(llm, monkeypatch) -> None:
    """Until its grammar is compiled a request waits outside the scheduler while the others
    run; a grammar that fails to compile fails its request alone, with the reason."""
    import threading

    from vlmserve.layers import grammar_compile

    gate = threading.Event()
    compile_ = grammar_compile.GrammarCompiler._compile

    def slow(self, proc, job):
        assert gate.wait(30)
        if job.spec[1] == "(a|b)":
            self._settle(job, error=RuntimeError("no memory for the token mask"))
            return True
        return compile_(self, proc, job)
    monkeypatch.setattr(grammar_compile.GrammarCompiler, "_compile", slow)
    engine = llm.engine
    greedy = dict(max_tokens=6, temperature=0.0)
    engine.add_request({"prompt": "Once upon a time"},
                       SamplingParams(**greedy, ignore_eos=True), "plain")
    engine.add_request({"prompt": "Once upon a time"},
                       SamplingParams(**greedy, structured_outputs=SO(choice=["ok", "no"])),
                       "held")
    engine.add_request({"prompt": "Hi"},
                       SamplingParams(**greedy, structured_outputs=SO(regex="(a|b)")), "bad")
    with pytest.raises(ValueError, match="in use"):
        engine.add_request({"prompt": "Hi"}, SamplingParams(**greedy), "held")
    engine.add_request({"prompt": "Hi"},
                       SamplingParams(**greedy, structured_outputs=SO(choice=["x"])), "gone")
    engine.abort_request("gone")  # while compiling: nothing of it is kept
    done = {}
    while "plain" not in done:
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
    assert set(done) == {"plain"}  # six steps ran while both grammars compiled
    assert set(engine.core._compiling) == {"held", "bad"}
    gate.set()
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
    assert done["held"].outputs[0].text in ("ok", "no")
    assert done["bad"].outputs[0].finish_reason == "error"
    assert "gone" not in done and engine.executor.runner.grammars._by_request == {}


def test_apply_bitmask_masks_exactly_the_cleared_bits_of_the_given_rows() -> None:
    torch.manual_seed(0)
    vocab = 70  # not a multiple of 32: the last word's extra bits are ignored
    logits = torch.randn(4, vocab)
    allowed = torch.rand(2, vocab) < 0.3
    bitmask = torch.zeros(2, 3, dtype=torch.int32)
    for r in range(2):
        for t in allowed[r].nonzero().flatten().tolist():
            bitmask[r, t // 32] |= torch.tensor(1 << (t % 32), dtype=torch.int64).to(
                torch.int32)
    want = logits.clone()
    for r, row in enumerate((1, 3)):
        want[row][~allowed[r]] = float("-inf")
    got = apply_bitmask(logits.clone(), bitmask, [1, 3])
    assert torch.equal(got, want)
    want = logits[:2].clone()
    want[~allowed] = float("-inf")
    assert torch.equal(apply_bitmask(logits[:2].clone(), bitmask), want)  # every row


def test_llava_outputs_match_their_constraints(vlmserve_cache) -> None:
    """LLaVA's tokenizer (Llama's byte fallback) holds to grammars as Qwen's does."""
    llava = LLM("tiny-llava-1.5", dtype="float32")
    cons = [c for c in constraints() if not c.json_object]
    outs = llava.generate(["Describe the image."] * len(cons),
                          [SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0,
                                          structured_outputs=c) for c in cons], use_tqdm=False)
    for c, out in zip(cons, outs):
        assert out.outputs[0].finish_reason == "stop", (c.spec, out.outputs[0].text)
        assert_matches(c, out.outputs[0].text)
