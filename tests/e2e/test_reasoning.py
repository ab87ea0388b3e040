"""`--reasoning-parser`: a reasoning model's thinking in the message's `reasoning` (and
`reasoning_content`), its answer in `content`, streamed and not, whichever way the thinking
was opened (by the answer's own <think>, or by the prompt); the thinking of an answer that
calls tools kept apart from its calls."""

from __future__ import annotations

import itertools
import json
import random
from collections.abc import Iterator

import openai
import pytest

from tests.e2e.test_server import ENGINE_FLAGS, MODEL, serving, user
from vlmserve import LLM, SamplingParams
from vlmserve.config import EngineConfig
from vlmserve.entrypoints.args import engine_kwargs
from vlmserve.entrypoints.cli import make_parser
from vlmserve.entrypoints.openai.reasoning import (
    ReasoningSplitter,
    prompt_opens_thinking,
    split_reasoning,
)
from vlmserve.entrypoints.openai.server import build_app
from vlmserve.frontend.async_llm import AsyncLLM
from vlmserve.sampling_params import StructuredOutputsParams

CASES = [  # (answer, prompt opened <think>, reasoning, content)
    ("<think>\nLet me see.\n</think>\n\nIt is a cat.", False, "Let me see.\n", "It is a cat."),
    ("Let me see.</think>It is a cat.", True, "Let me see.", "It is a cat."),
    ("\n\nHmm, thinking and cut off", True, "Hmm, thinking and cut off", None),
    ("<think>cut off inside <", False, "cut off inside <", None),
    ("It is a cat.", False, None, "It is a cat."),
    ("<thinking>is not the tag", False, None, "<thinking>is not the tag"),
    ("  <think></think>only the answer", False, "", "only the answer"),
    ("a</think>b</think>c", True, "a", "b</think>c"),
    ("", False, None, ""),
]


@pytest.mark.parametrize("text, opened, reasoning, content", CASES)
def test_split_whole_and_in_every_cut(text, opened, reasoning, content) -> None:
    assert split_reasoning(text, opened) == (reasoning, content)
    cuts = [list(c) for n in range(3) for c in itertools.combinations(range(1, len(text)), n)]
    rng = random.Random(0)
    cuts.append(sorted(rng.sample(range(1, len(text)), min(len(text) - 1, 9))) if text else [])
    for cut in cuts:  # a stream's chunks may end anywhere, inside a tag too
        split = ReasoningSplitter(opened)
        bounds = [0, *cut, len(text)]
        parts = [split.feed(text[a:b], final=b == len(text)) for a, b in itertools.pairwise(
            bounds)]
        assert "".join(p[0] for p in parts) == (reasoning or "")
        assert "".join(p[1] for p in parts) == (content or "")


def test_whether_a_prompt_opens_thinking() -> None:
    assert prompt_opens_thinking("<|im_start|>assistant\n<think>\n")  # Qwen3-VL-Thinking
    assert not prompt_opens_thinking("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert not prompt_opens_thinking("<|im_start|>assistant\n") and not prompt_opens_thinking("")


@pytest.fixture(scope="module")
def server(vlmserve_cache) -> Iterator[str]:
    args = make_parser().parse_args([
        "serve", MODEL, *ENGINE_FLAGS, "--reasoning-parser", "qwen3",
        "--enable-auto-tool-choice", "--tool-call-parser", "hermes"])
    engine = AsyncLLM(EngineConfig.from_kwargs(**engine_kwargs(args) | {"model": MODEL}))
    with serving(build_app(engine, args)) as url:
        yield url
    engine.shutdown()


def _both(url: str, messages: list[dict], n: int, **kw) -> tuple[dict, dict]:
    """The non-streamed message, and the streamed deltas joined the same way."""
    client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
    kw = {"model": MODEL, "messages": messages, "max_tokens": n, "temperature": 0} | kw
    whole = client.chat.completions.create(**kw).choices[0]
    message = whole.message.model_dump() | {"finish": whole.finish_reason}
    joined: dict = {"content": "", "reasoning": "", "reasoning_content": "", "calls": []}
    finish = None
    for chunk in client.chat.completions.create(stream=True, **kw):
        if not chunk.choices:
            continue
        delta = chunk.choices[0].delta.model_dump()
        for key in ("content", "reasoning", "reasoning_content"):
            joined[key] += delta.get(key) or ""
        joined["calls"] += delta.get("tool_calls") or []
        finish = chunk.choices[0].finish_reason or finish
    joined["finish"] = finish
    return message, joined


@pytest.fixture(scope="module")
def llm(vlmserve_cache) -> LLM:
    return LLM(MODEL, dtype="float32", device="cpu", max_model_len=1024)


def test_thinking_the_answer_opens(server: str, llm: LLM) -> None:
    """The answer writes <think>...</think> (a regex makes the random model do it): the
    thinking in reasoning and reasoning_content, the rest in content, streamed the same."""
    regex = r"<think>\n[a-z]{2,6} [a-z]{2,6}\n</think>\n\n[a-z]{2,8}\."
    messages = user("Think first.")
    ref = llm.chat(messages, SamplingParams(max_tokens=40, temperature=0.0, structured_outputs=
                                            StructuredOutputsParams(regex=regex)),
                   use_tqdm=False)[0].outputs[0].text
    thought, answer = ref.split("</think>")
    message, streamed = _both(server, messages, 40,
                              extra_body={"structured_outputs": {"regex": regex}})
    assert message["reasoning"] == message["reasoning_content"] == thought[len("<think>\n"):]
    assert message["content"] == answer.lstrip()
    assert streamed["reasoning"] == streamed["reasoning_content"] == message["reasoning"]
    assert streamed["content"] == message["content"]


def test_thinking_the_prompt_opened(server: str, llm: LLM) -> None:
    """The prompt ends inside <think> (here a continued assistant message; Qwen3-VL-Thinking's
    template writes the tag itself): the answer is thinking from its first token, all of it
    when it never closes; a prompt whose thinking is closed gives content only."""
    opened = [*user("Why?"), {"role": "assistant", "content": "<think>\n"}]
    closed = [*user("Why?"), {"role": "assistant", "content": "<think>\n\n</think>\n\n"}]
    body = {"add_generation_prompt": False, "continue_final_message": True}
    for messages, thinking in ((opened, True), (closed, False)):
        ref = llm.chat(messages, SamplingParams(max_tokens=12, temperature=0.0,
                                                ignore_eos=True), use_tqdm=False,
                       add_generation_prompt=False, continue_final_message=True)
        reasoning, content = split_reasoning(ref[0].outputs[0].text, thinking)
        assert (reasoning is not None) == thinking
        message, streamed = _both(server, messages, 12,
                                  extra_body=body | {"ignore_eos": True})
        assert (message["reasoning"], message["content"]) == (reasoning, content)
        assert (streamed["reasoning"], streamed["content"]) == (reasoning or "", content or "")


def test_thinking_apart_from_tool_calls(server: str) -> None:
    tools = [{"type": "function", "function": {"name": "weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}}}}]
    regex = (r'<think>\nweather [a-z]{2,5}\n</think>\n\n<tool_call>\n\{"name": "weather", '
             r'"arguments": \{"city": "(Paris|Rome)"\}\}\n</tool_call>')
    message, streamed = _both(server, user("Weather in Paris?"), 200, tools=tools,
                              extra_body={"structured_outputs": {"regex": regex}})
    assert message["reasoning"].startswith("weather ") and not message["content"]
    (call,) = message["tool_calls"]
    assert json.loads(call["function"]["arguments"])["city"] in ("Paris", "Rome")
    assert streamed["reasoning"] == message["reasoning"] and streamed["content"] == ""
    assert [c["function"]["arguments"] for c in streamed["calls"]] == [
        call["function"]["arguments"]]
    assert message["finish"] == streamed["finish"] == "tool_calls"
