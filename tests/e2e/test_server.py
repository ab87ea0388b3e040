"""The OpenAI-compatible server, end to end: real uvicorn on a loopback port, official client."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import io
import json
import socket
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import openai
import pytest
import uvicorn
from PIL import Image
from prometheus_client.parser import text_string_to_metric_families

from tests.engine.helpers import make_image, make_mp4, make_smooth_mp4
from tests.wait import wait_until
from vlmserve import LLM, SamplingParams
from vlmserve.config import EngineConfig
from vlmserve.entrypoints.args import engine_kwargs
from vlmserve.entrypoints.cli import make_parser
from vlmserve.entrypoints.openai.server import build_app
from vlmserve.frontend.async_llm import AsyncLLM

MAX_MODEL_LEN = 1024
# test servers listen on loopback alone (the default host is every interface, as vLLM's)
ENGINE_FLAGS = ["--dtype", "float32", "--device", "cpu", "--max-model-len", str(MAX_MODEL_LEN),
                "--max-num-batched-tokens", "256", "--host", "127.0.0.1"]
MODEL = "tiny-qwen2-vl"


def data_url(img: Image.Image) -> str:
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def user(text: str, *urls: str) -> list[dict]:
    parts = [{"type": "image_url", "image_url": {"url": u}} for u in urls]
    return [{"role": "user", "content": [*parts, {"type": "text", "text": text}]}]


class Server:
    def __init__(self, engine: AsyncLLM, url: str, media_dir: Path) -> None:
        self.engine, self.url, self.media_dir = engine, url, media_dir
        self.client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
        self.aclient_kwargs = dict(base_url=url + "/v1", api_key="none", max_retries=0)

    def stats(self) -> dict:
        return httpx.get(self.url + "/stats").json()

    def metrics(self) -> dict[str, float]:
        text = httpx.get(self.url + "/metrics").text
        return {s.name + "".join(f"{{{k}={v}}}" for k, v in sorted(s.labels.items())): s.value
                for fam in text_string_to_metric_families(text) for s in fam.samples}


@pytest.fixture(scope="module")
def server(vlmserve_cache: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    media = tmp_path_factory.mktemp("media")
    args = make_parser().parse_args([
        "serve", MODEL, *ENGINE_FLAGS, "--allowed-local-media-path", str(media),
        "--limit-mm-per-prompt", "2", "--max-image-pixels", "200000",
        "--max-request-bytes", "1000000", "--served-model-name", "tiny",
        "--enable-auto-tool-choice", "--tool-call-parser", "hermes"])
    # images decoded and prompts tokenized in a preprocessing process, as `vlmserve serve` does
    engine = AsyncLLM(EngineConfig.from_kwargs(**engine_kwargs(args) | {"model": MODEL}),
                      preprocess_workers=1)
    with serving(build_app(engine, args)) as url:
        yield Server(engine, url, media)
    engine.shutdown()


@contextlib.contextmanager
def serving(app) -> Iterator[str]:
    """``app`` served by uvicorn on a thread, at the URL given, until the block ends."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    srv = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
    thread = threading.Thread(target=srv.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    for _ in range(200):
        try:
            if httpx.get(url + "/health").status_code == 200:
                break
        except httpx.TransportError:
            time.sleep(0.05)
    try:
        yield url
    finally:
        srv.should_exit = True
        thread.join(10)
        sock.close()


@pytest.fixture(scope="module")
def llm(vlmserve_cache: Path) -> LLM:
    return LLM(MODEL, dtype="float32", device="cpu", max_model_len=MAX_MODEL_LEN,
               max_num_batched_tokens=256)


def greedy(n: int) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)


def chat(server: Server, messages: list[dict], n: int = 12, **kw):
    kw = {"temperature": 0, "extra_body": {"ignore_eos": True}} | kw
    return server.client.chat.completions.create(model="tiny", messages=messages, max_tokens=n,
                                                 **kw)


def stream_text(server: Server, messages: list[dict], n: int, **kw) -> tuple[str, list]:
    chunks = list(chat(server, messages, n, stream=True, **kw))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    return text, chunks


def test_health_and_models(server: Server) -> None:
    assert httpx.get(server.url + "/health").json() == {"status": "ok"}
    models = server.client.models.list().data
    assert [m.id for m in models] == ["tiny"]


def test_chat_with_image_matches_llm_chat(server: Server, llm: LLM) -> None:
    messages = user("What is in this picture?", data_url(make_image(84, 56, 1)))
    expected = llm.chat(messages, greedy(16), use_tqdm=False)[0]
    resp = chat(server, messages, 16)
    assert resp.object == "chat.completion" and resp.model == "tiny"
    assert resp.choices[0].message.content == expected.outputs[0].text
    assert resp.choices[0].message.role == "assistant"
    assert resp.choices[0].finish_reason == "length"
    assert resp.usage.prompt_tokens == len(expected.prompt_token_ids)
    assert resp.usage.completion_tokens == 16
    # max_completion_tokens is the newer name of max_tokens; a local file works like a data URL
    path = server.media_dir / "img.png"
    make_image(84, 56, 1).save(path)
    again = server.client.chat.completions.create(
        model="tiny", messages=user("What is in this picture?", f"file://{path}"),
        max_completion_tokens=16, temperature=0, extra_body={"ignore_eos": True})
    assert again.choices[0].message.content == expected.outputs[0].text


def test_penalties_and_logit_bias_match_llm(server: Server, llm: LLM) -> None:
    """OpenAI's presence / frequency penalties and logit_bias (keys are strings in JSON),
    vLLM's repetition_penalty and min_p: the same tokens as `LLM.chat` with those params."""
    messages = user("What is in this picture?", data_url(make_image(84, 56, 1)))
    plain = llm.chat(messages, greedy(16), use_tqdm=False)[0].outputs[0]
    params = dict(presence_penalty=1.5, frequency_penalty=0.5, repetition_penalty=1.4,
                  min_p=0.1, logit_bias={plain.token_ids[0]: -100.0, 5: 2.0})
    expected = llm.chat(messages, SamplingParams(max_tokens=16, temperature=0.0,
                                                 ignore_eos=True, **params),
                        use_tqdm=False)[0].outputs[0]
    assert expected.token_ids != plain.token_ids
    assert expected.token_ids[0] != plain.token_ids[0]  # its bias of -100
    # min_tokens (vLLM's): the stop token at the front is held back for 4 tokens
    stop = {"stop_token_ids": plain.token_ids[:1]}
    assert chat(server, messages, 16, extra_body=stop).usage.completion_tokens == 1
    held = chat(server, messages, 16, extra_body={"min_tokens": 4, **stop})
    assert held.usage.completion_tokens >= 4 and held.choices[0].finish_reason in (
        "stop", "length")
    resp = chat(server, messages, 16, presence_penalty=1.5, frequency_penalty=0.5,
                logit_bias={str(t): b for t, b in params["logit_bias"].items()},
                extra_body={"ignore_eos": True, "repetition_penalty": 1.4, "min_p": 0.1})
    assert resp.choices[0].message.content == expected.text


def test_structured_outputs_match_llm(server: Server, llm: LLM) -> None:
    """OpenAI's response_format (json_schema, json_object), vLLM's structured_outputs and
    guided_* fields: the same constrained tokens as `LLM.chat` with those
    `StructuredOutputsParams`, streamed or not, chat and completions."""
    from vlmserve.sampling_params import StructuredOutputsParams as SO

    schema = {"type": "object", "properties": {"ok": {"type": "boolean"},
                                               "n": {"type": "integer", "maximum": 9}},
              "required": ["ok", "n"], "additionalProperties": False}
    messages = user("Answer in JSON.", data_url(make_image(84, 56, 1)))

    def want(so: SO, prompt=None) -> str:
        params = SamplingParams(max_tokens=40, temperature=0.0, structured_outputs=so)
        if prompt is not None:
            return llm.generate(prompt, params, use_tqdm=False)[0].outputs[0].text
        return llm.chat(messages, params, use_tqdm=False)[0].outputs[0].text
    fmt = {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema}}
    text = want(SO(json=schema))  # any whitespace (vLLM's default): a random model's go on
    assert text.startswith('{"')
    resp = chat(server, messages, 40, response_format=fmt, extra_body={})
    assert resp.choices[0].message.content == text
    assert stream_text(server, messages, 40, response_format=fmt, extra_body={})[0] == text
    obj = chat(server, messages, 40, response_format={"type": "json_object"},
               extra_body={"structured_outputs": None})
    assert obj.choices[0].message.content == want(SO(json_object=True))
    for body, so in [({"structured_outputs": {"choice": ["yes", "no"]}}, SO(choice=["yes", "no"])),
                     ({"guided_regex": r"\d{3}"}, SO(regex=r"\d{3}")),
                     ({"structured_outputs": {"json": schema, "disable_any_whitespace": True}},
                      SO(json=schema, disable_any_whitespace=True))]:
        comp = server.client.completions.create(model="tiny", prompt="Once upon a time",
                                                max_tokens=40, temperature=0, extra_body=body)
        assert comp.choices[0].text == want(so, "Once upon a time"), body


def test_n_choices(server: Server, llm: LLM) -> None:
    """`n`: that many choices of one prompt (its image preprocessed once), each a request of
    its own; with a seed, choice i samples as a request seeded seed + i (vLLM's rule);
    streamed, each choice's chunks carry its index; usage counts the prompt once."""
    messages = user("What is in this picture?", data_url(make_image(84, 56, 1)))
    sampled = dict(temperature=1.0, max_tokens=8, ignore_eos=True)
    want = [llm.chat(messages, SamplingParams(seed=40 + i, **sampled),
                     use_tqdm=False)[0].outputs[0] for i in range(3)]
    assert len({tuple(w.token_ids) for w in want}) > 1  # the seeds sample differently
    def chat_n(**kw):
        return server.client.chat.completions.create(
            model="tiny", messages=messages, max_tokens=8, n=3, seed=40, temperature=1.0,
            extra_body={"ignore_eos": True}, **kw)
    resp = chat_n()
    assert [c.index for c in resp.choices] == [0, 1, 2]
    assert [c.message.content for c in resp.choices] == [w.text for w in want]
    assert resp.usage.completion_tokens == 24
    assert resp.usage.prompt_tokens == len(llm.chat(messages, greedy(1), use_tqdm=False)[0]
                                           .prompt_token_ids)
    chunks = list(chat_n(stream=True, stream_options={"include_usage": True}))
    texts, finished = ["", "", ""], set()
    for c in chunks:
        for ch in c.choices:
            texts[ch.index] += ch.delta.content or ""
            if ch.finish_reason:
                finished.add(ch.index)
    assert texts == [w.text for w in want] and finished == {0, 1, 2}
    assert chunks[-1].usage.completion_tokens == 24 and not chunks[-1].choices
    comp = server.client.completions.create(model="tiny", prompt="Once upon a time", n=2,
                                            max_tokens=5, temperature=0,
                                            extra_body={"ignore_eos": True})
    greedy_text = llm.generate("Once upon a time", greedy(5), use_tqdm=False)[0].outputs[0]
    assert [c.text for c in comp.choices] == [greedy_text.text] * 2
    assert [c.index for c in comp.choices] == [0, 1]
    streamed = list(server.client.completions.create(
        model="tiny", prompt="Once upon a time", n=2, max_tokens=5, temperature=0,
        stream=True, extra_body={"ignore_eos": True}))
    for i in range(2):
        assert "".join(c.choices[0].text for c in streamed
                       if c.choices and c.choices[0].index == i) == greedy_text.text


def test_streaming_equals_non_streamed(server: Server) -> None:
    messages = user("Describe it.", data_url(make_image(56, 112, 2)))
    full = chat(server, messages, 20).choices[0].message.content
    text, chunks = stream_text(server, messages, 20, stream_options={"include_usage": True})
    assert text == full
    assert chunks[0].choices[0].delta.role == "assistant"
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    # a chunk per output with tokens, text or not (the role comes with the first): one per
    # token while the client keeps up, the tokens that came meanwhile when it falls behind
    content = [c.choices[0].delta.content is not None for c in chunks if c.choices]
    assert 2 <= len(content) <= 21 and all(content[:-1]) and not content[-1]
    finishing = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finishing[-1] == "length" and not any(finishing[:-1])
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 20
    text, chunks = stream_text(server, messages, 20)
    assert text == full and all(c.usage is None for c in chunks)
    # a stop string that straddles two chunks: the streamed text must not have sent its
    # first half before the stop was seen
    pieces = [c.choices[0].delta.content for c in chunks[:-1] if c.choices[0].delta.content]
    at = [sum(map(len, pieces[:k])) for k in range(1, len(pieces))]
    stop = next(full[i - 1:i + 1] for i in at[2:] if full.find(full[i - 1:i + 1]) == i - 1)
    cut = chat(server, messages, 20, stop=[stop]).choices[0]
    assert cut.finish_reason == "stop" and cut.message.content == full[: full.find(stop)]
    text, chunks = stream_text(server, messages, 20, stop=stop)
    assert text == cut.message.content and chunks[-1].choices[0].finish_reason == "stop"


def test_completions(server: Server, llm: LLM) -> None:
    expected = llm.generate("Once upon a time", greedy(10), use_tqdm=False)[0].outputs[0]
    resp = server.client.completions.create(model="tiny", prompt="Once upon a time",
                                            max_tokens=10, temperature=0,
                                            extra_body={"ignore_eos": True})
    assert resp.choices[0].text == expected.text and resp.usage.completion_tokens == 10
    ids = llm.get_tokenizer().encode("Once upon a time")
    by_ids = server.client.completions.create(model="tiny", prompt=ids, max_tokens=10,
                                              temperature=0, extra_body={"ignore_eos": True})
    assert by_ids.choices[0].text == expected.text
    chunks = list(server.client.completions.create(
        model="tiny", prompt="Once upon a time", max_tokens=10, temperature=0, stream=True,
        extra_body={"ignore_eos": True}))
    assert "".join(c.choices[0].text for c in chunks) == expected.text
    assert chunks[-1].choices[0].finish_reason == "length" and 2 <= len(chunks) <= 10 + 1


def test_chat_logprobs_in_openai_format(server: Server, llm: LLM) -> None:
    """logprobs / top_logprobs: OpenAI's objects (the client's typed ones), the values of the
    offline engine (checked against transformers in tests/engine/test_logprobs.py), the top
    ones most likely first; the tokens' bytes make up the decoded output; streamed, each
    token chunk carries its token's entry."""
    from openai.types.chat import ChatCompletionTokenLogprob
    from openai.types.chat.chat_completion import ChoiceLogprobs

    messages = user("What is in this picture?", data_url(make_image(84, 56, 1)))
    k, n = 4, 8
    expected = llm.chat(messages, SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True,
                                                 logprobs=k), use_tqdm=False)[0].outputs[0]
    tok = llm.get_tokenizer()
    assert chat(server, messages, n).choices[0].logprobs is None  # not asked: none
    resp = chat(server, messages, n, logprobs=True, top_logprobs=k)
    assert resp.choices[0].message.content == expected.text
    lp = resp.choices[0].logprobs
    assert isinstance(lp, ChoiceLogprobs) and len(lp.content) == n
    for entry, token, ref in zip(lp.content, expected.token_ids, expected.logprobs):
        assert isinstance(entry, ChatCompletionTokenLogprob)
        assert entry.token == tok.decode([token])
        assert entry.logprob == pytest.approx(ref[token], abs=1e-5)
        top = list(ref)[:k]
        assert [t.token for t in entry.top_logprobs] == [tok.decode([i]) for i in top]
        assert [t.logprob for t in entry.top_logprobs] == pytest.approx(
            [ref[i] for i in top], abs=1e-5)
        assert entry.top_logprobs[0].logprob >= entry.logprob  # greedy: the top one
    assert b"".join(bytes(e.bytes) for e in lp.content).decode("utf-8", "replace") == \
        tok.decode(expected.token_ids, skip_special_tokens=False)
    only = chat(server, messages, n, logprobs=True).choices[0].logprobs.content
    assert [e.logprob for e in only] == [e.logprob for e in lp.content]
    assert all(e.top_logprobs == [] for e in only)

    chunks = list(chat(server, messages, n, logprobs=True, top_logprobs=k, stream=True))
    streamed = [e for c in chunks if c.choices and c.choices[0].logprobs
                for e in c.choices[0].logprobs.content]
    with_logprobs = [c.choices[0].logprobs is not None for c in chunks]  # a merged chunk
    assert len(chunks) <= n + 1 and with_logprobs == [True] * (len(chunks) - 1) + [False]
    assert [e.model_dump() for e in streamed] == [e.model_dump() for e in lp.content]
    assert chunks[0].choices[0].delta.role == "assistant"


def test_completions_logprobs_in_the_legacy_format(server: Server, llm: LLM) -> None:
    from openai.types.completion_choice import Logprobs

    k, n = 3, 6
    expected = llm.generate("Once upon a time", SamplingParams(
        max_tokens=n, temperature=0.0, ignore_eos=True, logprobs=k),
        use_tqdm=False)[0].outputs[0]
    tok = llm.get_tokenizer()
    kw = dict(model="tiny", prompt="Once upon a time", max_tokens=n, temperature=0,
              logprobs=k, extra_body={"ignore_eos": True})
    resp = server.client.completions.create(**kw)
    lp = resp.choices[0].logprobs
    assert isinstance(lp, Logprobs)
    texts = [tok.decode([t]) for t in expected.token_ids]
    assert lp.tokens == texts
    assert lp.token_logprobs == pytest.approx(
        [ref[t] for t, ref in zip(expected.token_ids, expected.logprobs)], abs=1e-5)
    assert lp.text_offset == [sum(map(len, texts[:i])) for i in range(n)]
    for token_text, top, ref in zip(texts, lp.top_logprobs, expected.logprobs):
        assert token_text in top and len(top) == k  # greedy: the sampled token is the top one
        assert list(top.values()) == pytest.approx(list(ref.values())[:k], abs=1e-5)
    chunks = list(server.client.completions.create(stream=True, **kw))
    joined: dict[str, list] = {"tokens": [], "token_logprobs": [], "top_logprobs": [],
                               "text_offset": []}
    for c in chunks[:-1]:
        for key in joined:
            joined[key] += getattr(c.choices[0].logprobs, key)
    assert joined == lp.model_dump() and chunks[-1].choices[0].logprobs is None
    assert server.client.completions.create(
        **{**kw, "logprobs": None}).choices[0].logprobs is None


def test_completions_echo_the_prompt_with_its_logprobs(server: Server, llm: LLM) -> None:
    """echo: the prompt's text before the completion; with logprobs its tokens first, the
    first without a logprob (null, as OpenAI), the others the offline engine's prompt
    logprobs; streamed, the first chunk carries the prompt; token-id prompts decoded."""
    k, n, prompt = 2, 5, "Once upon a time"
    ref = llm.generate(prompt, SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True,
                                              logprobs=k, prompt_logprobs=k),
                       use_tqdm=False)[0]
    tok = llm.get_tokenizer()
    ids = ref.prompt_token_ids
    texts = [tok.decode([t]) for t in [*ids, *ref.outputs[0].token_ids]]
    kw = dict(model="tiny", prompt=prompt, max_tokens=n, temperature=0, echo=True,
              extra_body={"ignore_eos": True})
    assert server.client.completions.create(**kw).choices[0].text == prompt + ref.outputs[0].text
    resp = server.client.completions.create(logprobs=k, **kw)
    choice = resp.choices[0]
    assert choice.text == prompt + ref.outputs[0].text
    lp = choice.logprobs
    assert lp.tokens == texts and lp.text_offset == [sum(map(len, texts[:i]))
                                                     for i in range(len(texts))]
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    want = [lps[t] for t, lps in zip(ids[1:], ref.prompt_logprobs[1:])] + [
        lps[t] for t, lps in zip(ref.outputs[0].token_ids, ref.outputs[0].logprobs)]
    assert lp.token_logprobs[1:] == pytest.approx(want, abs=1e-5)
    for text, top in zip(texts[1:len(ids)], lp.top_logprobs[1:len(ids)]):
        assert text in top and k <= len(top) <= k + 1
    chunks = list(server.client.completions.create(logprobs=k, stream=True, **kw))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == choice.text
    assert chunks[0].choices[0].text.startswith(prompt)
    streamed = [t for c in chunks[:-1] for t in c.choices[0].logprobs.token_logprobs]
    assert streamed == lp.token_logprobs
    by_ids = server.client.completions.create(**{**kw, "prompt": ids})
    assert by_ids.choices[0].text == tok.decode(ids) + ref.outputs[0].text


def test_completions_batch_prompts(server: Server, llm: LLM) -> None:
    """A list of prompts (texts, or token-id lists) in one request, as OpenAI's: n choices
    each, indexed prompt by prompt, each the offline engine's text; usage counts each prompt
    once; streamed alike; echo per prompt; one refused prompt refuses the batch and leaves
    nothing running; an empty list is a 400."""
    tok = llm.get_tokenizer()
    texts_in = ["Once upon a time", "The sky is"]
    ids = [tok.encode("A token prompt"), tok.encode("Another one, longer")]
    greedy4 = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    for batch, prompts in ((texts_in, texts_in),
                           (ids, [{"prompt_token_ids": p} for p in ids])):
        ref = llm.generate(prompts, greedy4, use_tqdm=False)
        want = [r.outputs[0].text for r in ref for _ in range(2)]
        kw = dict(model="tiny", prompt=batch, max_tokens=4, temperature=0, n=2,
                  extra_body={"ignore_eos": True})
        resp = server.client.completions.create(**kw)
        assert [c.index for c in resp.choices] == list(range(4))
        assert [c.text for c in resp.choices] == want
        assert resp.usage.prompt_tokens == sum(len(r.prompt_token_ids) for r in ref)
        assert resp.usage.completion_tokens == 4 * 4
        texts: dict[int, str] = {}
        usage = None
        for c in server.client.completions.create(stream=True, stream_options={
                "include_usage": True}, **kw):
            for choice in c.choices:
                texts[choice.index] = texts.get(choice.index, "") + choice.text
            usage = c.usage or usage
        assert [texts[i] for i in range(4)] == want and usage == resp.usage
        echoed = server.client.completions.create(**{**kw, "echo": True, "n": 1})
        shown = [p if isinstance(p, str) else tok.decode(p) for p in batch]
        assert [c.text for c in echoed.choices] == [
            p + r.outputs[0].text for p, r in zip(shown, ref)]
    for bad, param in (([*ids, [10**9]], None), ([], "prompt")):
        r = httpx.post(server.url + "/v1/completions", json={
            "model": "tiny", "prompt": bad, "max_tokens": 4}, timeout=60)
        assert r.status_code == 400, r.text
        assert param is None or r.json()["error"]["param"] == param
    s = _idle(server)
    assert s["num_running"] == s["num_waiting"] == s["num_streams"] == 0


def test_version_and_ping(server: Server) -> None:
    import vlmserve

    assert httpx.get(server.url + "/version").json() == {"version": vlmserve.__version__}
    for method in ("GET", "POST"):  # SageMaker's health check, as /health
        r = httpx.request(method, server.url + "/ping")
        assert r.status_code == 200 and r.json() == {"status": "ok"}


def test_tokenize_and_detokenize(server: Server, llm: LLM) -> None:
    """vLLM's /tokenize: a text prompt's ids as the tokenizer gives them; a chat's as the
    engine runs it (chat template, each image expanded to its rows: the exact count a request
    would take), with the context length; /detokenize back; bad input a 400."""
    tok = llm.get_tokenizer()
    got = httpx.post(server.url + "/tokenize", json={"prompt": "Once upon a time",
                                                     "return_token_strs": True}).json()
    assert got["tokens"] == tok.encode("Once upon a time") and got["count"] == len(
        got["tokens"])
    assert got["max_model_len"] == MAX_MODEL_LEN
    assert got["token_strs"] == tok.convert_ids_to_tokens(got["tokens"])
    messages = user("What is this?", data_url(make_image(84, 56, 3)))
    chat_ids = httpx.post(server.url + "/tokenize", json={"model": "tiny", "messages": messages}
                          ).json()["tokens"]
    ref = llm.chat(messages, SamplingParams(max_tokens=1), use_tqdm=False)[0]
    assert chat_ids == ref.prompt_token_ids
    back = httpx.post(server.url + "/detokenize", json={"tokens": got["tokens"]}).json()
    assert back == {"prompt": "Once upon a time"}
    for path, body, param in (("/tokenize", {}, None),
                              ("/tokenize", {"prompt": "a", "messages": messages}, None),
                              ("/tokenize", {"prompt": "a", "model": "other"}, "model"),
                              ("/detokenize", {"tokens": [10**9]}, "tokens")):
        r = httpx.post(server.url + path, json=body)
        assert r.status_code in (400, 404), r.text
        assert param is None or r.json()["error"]["param"] == param


def test_mm_processor_kwargs_resize_a_requests_images(server: Server, llm: LLM) -> None:
    """vLLM's `mm_processor_kwargs` of a chat request: its images resized into that pixel
    range, as `LLM.chat` given the same; the same image without them is another image (its
    own cache entry); bad options are a 400 naming the problem."""
    messages = user("What is this?", data_url(make_image(224, 168, 5)))
    small = {"max_pixels": 56 * 56}
    expected = llm.chat(messages, greedy(8), use_tqdm=False, mm_processor_kwargs=small)[0]
    plain = llm.chat(messages, greedy(8), use_tqdm=False)[0]
    assert len(expected.prompt_token_ids) < len(plain.prompt_token_ids)
    for kw, ref in ((small, expected), (None, plain), (small, expected)):
        extra = {"ignore_eos": True} | ({"mm_processor_kwargs": kw} if kw else {})
        resp = chat(server, messages, 8, extra_body=extra)
        assert resp.choices[0].message.content == ref.outputs[0].text
        assert resp.usage.prompt_tokens == len(ref.prompt_token_ids)
    counted = httpx.post(server.url + "/tokenize", json={
        "messages": messages, "mm_processor_kwargs": small}).json()["count"]
    assert counted == len(expected.prompt_token_ids)
    r = httpx.post(server.url + "/v1/chat/completions", json={
        "messages": messages, "max_tokens": 2, "mm_processor_kwargs": {"max_pixels": "big"}})
    assert r.status_code == 400 and "max_pixels must be a positive integer" in r.text


def test_chat_template_options_and_the_servers_own_template(server: Server, llm: LLM,
                                                             tmp_path: Path) -> None:
    """vLLM's per-request add_generation_prompt, continue_final_message and
    chat_template_kwargs give the offline engine's prompt and answer; bad combinations are a
    400; --chat-template (a file) replaces the model's template."""
    partial = [{"role": "user", "content": "Count to three."},
               {"role": "assistant", "content": "One, two,"}]
    options = {"add_generation_prompt": False, "continue_final_message": True}
    want = llm.chat(partial, SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True),
                    use_tqdm=False, **options)[0]
    ids = httpx.post(server.url + "/tokenize", json={"messages": partial, **options}).json()
    assert ids["tokens"] == want.prompt_token_ids
    got = chat(server, partial, 6, extra_body={**options, "ignore_eos": True})
    assert got.choices[0].message.content == want.outputs[0].text
    # vLLM's echo: the continued message comes back whole (streamed: in the first chunk)
    for stream in (False, True):
        out = chat(server, partial, 6, stream=stream,
                   extra_body={**options, "ignore_eos": True, "echo": True})
        text = ("".join(c.choices[0].delta.content or "" for c in out if c.choices) if stream
                else out.choices[0].message.content)
        assert text == "One, two," + want.outputs[0].text
    assert chat(server, partial[:1], 2, extra_body={"echo": False}).choices[0].message.content
    for bad in ({"continue_final_message": True},
                {"chat_template_kwargs": {"tokenize": True}}):
        r = httpx.post(server.url + "/v1/chat/completions", json={
            "model": "tiny", "messages": partial, "max_tokens": 2, **bad})
        assert r.status_code == 400, r.text
    from fastapi.testclient import TestClient

    template = tmp_path / "t.jinja"
    template.write_text("{% for m in messages %}<{{ m['content'] }}>{% endfor %}")
    args = make_parser().parse_args(["serve", MODEL, *ENGINE_FLAGS, "--chat-template",
                                     str(template)])
    with TestClient(build_app(server.engine, args)) as client:
        out = client.post("/tokenize", json={"messages": partial}).json()
    tok = llm.get_tokenizer()
    assert out["tokens"] == tok.encode("<Count to three.><One, two,>")


def test_prompt_logprobs_as_vllm_gives_them(server: Server, llm: LLM) -> None:
    """`prompt_logprobs` (vLLM's extension): per prompt token null (the first) or {token id:
    {logprob, rank, decoded_token}}, the k most likely and the prompt's own token, with the
    offline engine's values; at the top of a chat response, in a completion's choice; with
    stream a 400 naming it."""
    k = 2
    messages = user("Score this.", data_url(make_image(56, 56, 7)))
    ref = llm.chat(messages, SamplingParams(max_tokens=2, temperature=0.0, prompt_logprobs=k),
                   use_tqdm=False)[0]
    tok = llm.get_tokenizer()
    body = {"model": "tiny", "messages": messages, "max_tokens": 2, "temperature": 0,
            "prompt_logprobs": k}
    got = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=60).json()
    scores = got["prompt_logprobs"]
    ids = ref.prompt_token_ids
    assert len(scores) == len(ids) and scores[0] is None
    for token, entry, lps, rank in zip(ids[1:], scores[1:], ref.prompt_logprobs[1:],
                                       ref.prompt_logprob_ranks[1:]):
        assert list(entry) == [str(t) for t in lps]
        assert entry[str(token)]["rank"] == rank >= 1
        for tid, lp in lps.items():
            assert entry[str(tid)]["logprob"] == pytest.approx(lp, abs=1e-5)
            assert entry[str(tid)]["decoded_token"] == tok.decode([tid])
        assert [e["rank"] for t, e in entry.items() if int(t) != token] == [
            i + 1 for i, t in enumerate(list(lps)[:k]) if t != token]
    plain = httpx.post(server.url + "/v1/chat/completions",
                       json={**body, "prompt_logprobs": None}, timeout=60).json()
    assert plain["prompt_logprobs"] is None
    completion = httpx.post(server.url + "/v1/completions", json={
        "model": "tiny", "prompt": "Once upon a time", "max_tokens": 2,
        "prompt_logprobs": 0}, timeout=60).json()["choices"][0]["prompt_logprobs"]
    assert completion[0] is None and all(len(e) == 1 for e in completion[1:])
    for path, extra in (("/v1/chat/completions", {"messages": messages}),
                        ("/v1/completions", {"prompt": "Hi."})):
        r = httpx.post(server.url + path, json={"model": "tiny", "max_tokens": 2, "stream": True,
                                                "prompt_logprobs": 1, **extra}, timeout=60)
        assert r.status_code == 400 and "prompt_logprobs" in r.json()["error"]["message"]


@pytest.mark.parametrize("path, kw, param", [
    ("/v1/chat/completions", {"prompt_logprobs": 21}, "prompt_logprobs"),
    ("/v1/completions", {"prompt_logprobs": -1}, "prompt_logprobs"),
    ("/v1/chat/completions", {"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ("/v1/chat/completions", {"logprobs": True, "top_logprobs": -1}, "top_logprobs"),
    ("/v1/chat/completions", {"top_logprobs": 2}, "top_logprobs"),
    ("/v1/chat/completions", {"logprobs": 1}, "logprobs"),
    ("/v1/completions", {"logprobs": 6}, "logprobs"),
    ("/v1/completions", {"logprobs": -1}, "logprobs"),
    ("/v1/completions", {"logprobs": True}, "logprobs"),
])
def test_bad_logprobs_are_a_400_naming_the_field(server: Server, path, kw, param) -> None:
    body = {"model": "tiny", "max_tokens": 2, **kw}
    body |= ({"messages": user("Hi.")} if "chat" in path else {"prompt": "Hi."})
    r = httpx.post(server.url + path, json=body)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and param in error["message"]


def test_sixteen_concurrent_streams(server: Server, llm: LLM) -> None:
    convs = [user(f"Request {i}: what do you see?" + " more" * (i % 5),
                  *[data_url(make_image(56 + 28 * (i % 3), 56 + 28 * j, 100 * i + j))
                    for j in range(i % 3)])
             for i in range(16)]
    expected = [o.outputs[0].text for o in llm.chat(convs, greedy(24), use_tqdm=False)]

    async def one(client: openai.AsyncOpenAI, messages: list[dict]) -> str:
        stream = await client.chat.completions.create(
            model="tiny", messages=messages, max_tokens=24, temperature=0, stream=True,
            extra_body={"ignore_eos": True})
        return "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])

    async def run_all() -> list[str]:
        async with openai.AsyncOpenAI(**server.aclient_kwargs) as client:
            return await asyncio.gather(*(one(client, m) for m in convs))

    assert asyncio.run(run_all()) == expected


def _idle(server: Server) -> dict:
    """The server's stats once nothing runs, waits or streams (or the last ones seen)."""
    seen: list[dict] = []

    def idle() -> bool:
        seen.append(server.stats())
        return seen[-1]["num_running"] == seen[-1]["num_waiting"] == seen[-1]["num_streams"] == 0

    wait_until(idle, step_s=0.05)
    return seen[-1]


def test_client_disconnect_frees_blocks_and_cache_references(server: Server) -> None:
    before = server.metrics()
    messages = user("Talk for a long time.", data_url(make_image(112, 112, 3)))
    stream = chat(server, messages, MAX_MODEL_LEN - 100, stream=True)
    got = [next(stream) for _ in range(3)]  # three tokens (the role comes with the first)
    assert server.stats()["num_running"] == 1
    stream.close()
    s = _idle(server)
    assert s["num_running"] == s["num_waiting"] == s["num_streams"] == 0
    assert s["num_free_kv_blocks"] == s["num_kv_blocks"]
    assert s["encoder_cache_referenced"] == 0
    after = server.metrics()
    key = 'vlmserve_requests_finished_total{finish_reason=abort}'
    assert after[key] == before.get(key, 0) + 1
    generated = after["vlmserve_generation_tokens_total"] - before[
        "vlmserve_generation_tokens_total"]
    assert 2 <= generated < MAX_MODEL_LEN - 200, "aborted long before max_tokens"
    assert len(got) == 3
    # a non-streamed request whose client gives up is aborted too
    with pytest.raises(httpx.TimeoutException):
        httpx.post(server.url + "/v1/chat/completions", timeout=0.5, json={
            "messages": messages, "max_tokens": MAX_MODEL_LEN - 100, "ignore_eos": True})
    s = _idle(server)
    assert s["num_running"] == 0 and s["num_free_kv_blocks"] == s["num_kv_blocks"]
    assert server.metrics()[key] == before.get(key, 0) + 2
    # n choices: every one of them aborted, streamed or not
    stream = server.client.chat.completions.create(
        model="tiny", messages=messages, max_tokens=MAX_MODEL_LEN - 100, n=3, stream=True,
        extra_body={"ignore_eos": True})
    [next(stream) for _ in range(6)]
    assert server.stats()["num_running"] == 3
    stream.close()
    with pytest.raises(httpx.TimeoutException):
        httpx.post(server.url + "/v1/chat/completions", timeout=0.5, json={
            "messages": messages, "max_tokens": MAX_MODEL_LEN - 100, "ignore_eos": True,
            "n": 3})
    s = _idle(server)
    assert s["num_running"] == s["num_streams"] == 0
    assert s["num_free_kv_blocks"] == s["num_kv_blocks"] and s["encoder_cache_referenced"] == 0
    assert server.metrics()[key] == before.get(key, 0) + 8


BAD_IMAGE = "data:image/png;base64," + base64.b64encode(b"definitely not a png").decode()


def _bad_cases(server: Server) -> list[tuple[dict, int, str]]:
    img = data_url(make_image(56, 56, 4))
    outside = server.media_dir.parent / "outside.png"
    make_image(56, 56, 5).save(outside)
    ok = {"model": "tiny", "max_tokens": 4}
    return [
        ({**ok, "messages": user("x", BAD_IMAGE)}, 400, "could not decode image"),
        ({**ok, "messages": user("x", img, img, img)}, 400, "at most 2"),
        ({**ok, "messages": [{"role": "user", "content": [
            {"type": "input_audio", "input_audio": {"data": "", "format": "wav"}}]}]},
         400, "input_audio"),
        ({**ok, "messages": user("word " * 2000)}, 400, "maximum context length"),
        ({**ok, "messages": user("x"), "temperature": -1}, 400, "temperature"),
        ({**ok, "messages": user("x"), "n": 129}, 400, "n must be in [1, 128]"),
        ({**ok, "messages": user("x"), "n": 0}, 400, "n must be in"),
        ({**ok, "messages": user("x"), "max_tokens": 0}, 400, "max_tokens"),
        ({**ok, "messages": user("x"), "top_p": "high"}, 400, "top_p"),
        ({**ok, "messages": user("x", str(outside))}, 400, "outside the allowed directory"),
        ({**ok, "messages": user("x", "http://127.0.0.1:1/x.png")}, 400,
         "remote image URLs are not allowed"),
        ({**ok, "messages": user("x", data_url(Image.new("RGB", (500, 500))))}, 400,
         "exceeds the limit"),
        ({**ok, "messages": []}, 400, "messages"),
        ({**ok, "model": "gpt-4o", "messages": user("x")}, 404, "gpt-4o"),
        ({**ok, "messages": user("x" * 1_100_000)}, 413, "exceeds the limit"),
    ]


def test_bad_requests_get_errors_while_others_complete(server: Server, llm: LLM) -> None:
    good = [user(f"Good request {i}.", data_url(make_image(56, 84, 40 + i))) for i in range(3)]
    expected = [o.outputs[0].text for o in llm.chat(good, greedy(500), use_tqdm=False)]
    with ThreadPoolExecutor(3) as pool:
        futures = [pool.submit(stream_text, server, m, 500) for m in good]
        deadline = time.monotonic() + 30
        while server.stats()["num_running"] < 3 and time.monotonic() < deadline:
            time.sleep(0.01)
        for body, status, words in _bad_cases(server):
            r = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=30)
            assert r.status_code == status, (words, r.text)
            err = r.json()["error"]
            assert words in err["message"] and err["type"] and "param" in err and "code" in err
        r = httpx.post(server.url + "/v1/chat/completions", content=b"{not json",
                       headers={"content-type": "application/json"})
        assert r.status_code == 400 and "JSON" in r.json()["error"]["message"]
        with pytest.raises(openai.BadRequestError, match="temperature"):
            chat(server, user("x"), temperature=-1)
        with pytest.raises(openai.NotFoundError, match="does not exist"):
            server.client.chat.completions.create(model="nope", messages=user("x"))
        assert server.stats()["num_running"] == 3, "the good requests were still running"
        assert [f.result()[0] for f in futures] == expected
    assert httpx.get(server.url + "/health").status_code == 200
    s = _idle(server)
    assert s["num_free_kv_blocks"] == s["num_kv_blocks"]


def test_metrics_parse_and_move(server: Server) -> None:
    before = server.metrics()
    for name in ("vlmserve_num_requests_running", "vlmserve_num_requests_waiting",
                 "vlmserve_kv_cache_usage_ratio", "vlmserve_encoder_cache_usage_rows",
                 "vlmserve_encoder_cache_entries"):
        assert name in before
    resp = chat(server, user("Count.", data_url(make_image(56, 56, 6))), 8)
    after = server.metrics()

    def moved(name: str) -> float:
        return after[name] - before.get(name, 0.0)

    assert moved("vlmserve_prompt_tokens_total") == resp.usage.prompt_tokens
    assert moved("vlmserve_generation_tokens_total") == 8
    assert moved("vlmserve_requests_finished_total{finish_reason=length}") == 1
    assert moved("vlmserve_time_to_first_token_seconds_count") == 1
    assert moved("vlmserve_inter_token_latency_seconds_count") == 7
    assert moved("vlmserve_e2e_request_latency_seconds_count") == 1
    assert after["vlmserve_e2e_request_latency_seconds_sum"] > before.get(
        "vlmserve_e2e_request_latency_seconds_sum", 0.0)


def test_bench_client_records_refusals_and_reads_streams(server: Server) -> None:
    """The benchmarks' client: a refused request is an error naming its status (never an
    exception), a served one its tokens, usage and one arrival time per token chunk."""
    from vlmserve.benchmarks.client import chat_body, first_model, open_session, stream_chat

    async def main():
        async with open_session(server.url) as session:
            model = await first_model(session)
            ok = await stream_chat(session, chat_body(model, user("Hi."), 5))
            bad = await stream_chat(session, chat_body("no-such-model", user("Hi."), 5))
        return ok, bad

    ok, bad = asyncio.run(main())
    assert ok.error is None and ok.completion_tokens == 5 and ok.prompt_tokens > 0
    assert len(ok.stamps) == len(ok.text) >= 1 and 0 < ok.ttft <= ok.e2e
    assert bad.error.startswith("HTTP 404") and "no-such-model" in bad.error and not bad.stamps


def test_bench_serve_against_the_server(server: Server, tmp_path: Path) -> None:
    from vlmserve.entrypoints.cli import main

    out = tmp_path / "bench"
    main(["bench", "serve", "--base-url", server.url, "--num-requests", "6",
          "--concurrency", "1,3", "--image-sizes", "56,84", "--output-len", "4",
          "--prompt-words", "5", "--request-rate", "50", "--out-dir", str(out)])
    runs = json.loads((out / "serve.json").read_text())["runs"]
    assert [r["concurrency"] for r in runs] == [1, 3]
    for r in runs:
        assert r["completed"] == 6 and r["failed"] == 0
        assert len(r["ttfts_ms"]) == 6 and r["median_ttft_ms"] > 0
        assert r["output_tokens_per_s"] > 0 and len(r["tpots_ms"]) == 6
        # the server's own view of the same requests, from its metrics endpoint
        assert 0 < r["server_mean_ttft_ms"] <= max(r["ttfts_ms"])
        assert 0 < r["server_mean_itl_ms"] and 0 < r["server_mean_step_ms"]
        assert 0 < r["server_mean_frontend_ms"] < r["server_mean_ttft_ms"]
        # the bucket of the server's 99th-percentile gap and step bounds their means
        assert r["server_p99_itl_le_ms"] >= r["server_mean_itl_ms"]
        assert r["server_p99_step_le_ms"] >= r["server_mean_step_ms"]
        assert 0 <= r["client_loop_lag_p99_ms"] <= r["client_loop_lag_max_ms"]
    for png in ("latency.png", "throughput_vs_concurrency.png"):
        assert (out / png).read_bytes()[:4] == b"\x89PNG"


def test_bench_serve_sends_videos(server: Server, tmp_path: Path) -> None:
    """`--videos-per-request`: each request a video_url part (an MP4 made by the client),
    which the server answers (the fixture's --limit-mm-per-prompt 2: a video and an image)."""
    from vlmserve.entrypoints.cli import main

    before = server.stats()["num_images_encoded"]
    out = tmp_path / "bench"
    main(["bench", "serve", "--base-url", server.url, "--num-requests", "2",
          "--concurrency", "2", "--image-sizes", "56", "--videos-per-request", "1",
          "--video-frames", "4", "--video-size", "56", "--output-len", "4",
          "--prompt-words", "5", "--warmup-requests", "0", "--out-dir", str(out)])
    (run,) = json.loads((out / "serve.json").read_text())["runs"]
    assert run["completed"] == 2 and run["failed"] == 0
    assert server.stats()["num_images_encoded"] == before + 4  # two images, two videos


def test_token_chunks_from_the_template_are_the_pydantic_bytes() -> None:
    from vlmserve.entrypoints.openai.responses import DeltaMessage
    from vlmserve.entrypoints.openai.streaming import _chat_chunk, _TextChunk

    def built(text: str) -> str:  # the chunk as the role and finish chunks are still made
        return _chat_chunk("chatcmpl-1", 7, "m", False, DeltaMessage(content=text))

    chunk = _TextChunk(built(_TextChunk.MARK))
    for text in ["", " word", 'a "quote" \\ and\nnewline', "é 中 \u2028 \x00 \ufffd"]:
        assert chunk(text) == built(text)


def test_api_key(server: Server, monkeypatch) -> None:
    from fastapi.testclient import TestClient

    from vlmserve.entrypoints.args import ServerConfig

    for cfg, env in [(ServerConfig(api_key="sekret"), None),
                     (ServerConfig(), "sekret")]:  # the flag, or VLMSERVE_API_KEY
        if env:
            monkeypatch.setenv("VLMSERVE_API_KEY", env)
        with TestClient(build_app(server.engine, cfg)) as client:
            assert client.get("/health").status_code == 200  # probes need no key
            r = client.get("/v1/models")
            assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
            # ignore_eos: sampled at temperature 1, the tiny model ends 1 answer in ~300 at
            # its first token
            body = {"model": MODEL, "max_tokens": 2, "messages": user("hi"), "ignore_eos": True}
            r = client.post("/v1/chat/completions", json=body,
                            headers={"Authorization": "Bearer wrong"})
            assert r.status_code == 401 and "API key" in r.json()["error"]["message"]
            ok = {"Authorization": "Bearer sekret"}
            assert client.get("/v1/models", headers=ok).status_code == 200
            # the server's internals and schema too; probes and scrapers need no key
            for path in ("/stats", "/docs", "/openapi.json"):
                r = client.get(path)
                assert r.status_code == 401, path
                assert r.json()["error"]["code"] == "invalid_api_key"
                assert client.get(path, headers={"Authorization": "Bearer no"}
                                  ).status_code == 401
                assert client.get(path, headers=ok).status_code == 200, path
            for path in ("/health", "/ping", "/version", "/metrics"):
                assert client.get(path).status_code == 200, path
            r = client.post("/v1/chat/completions", json=body, headers=ok)
            assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2


def test_default_max_tokens(server: Server) -> None:
    from fastapi.testclient import TestClient

    from vlmserve.entrypoints.args import ServerConfig

    with TestClient(build_app(server.engine, ServerConfig(default_max_tokens=3))) as client:
        body = {"model": MODEL, "messages": user("hi"), "ignore_eos": True}
        r = client.post("/v1/chat/completions", json=body)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3
        r = client.post("/v1/chat/completions", json=body | {"max_tokens": 5})
        assert r.json()["usage"]["completion_tokens"] == 5


def test_generation_config_defaults_fill_unset_fields(server: Server, llm: LLM,
                                                     monkeypatch) -> None:
    """The model's generation config (here set on the running engine) is the default of every
    field a request leaves unset, max_tokens included; fields it sets win."""
    from fastapi.testclient import TestClient

    from vlmserve.entrypoints.args import ServerConfig

    monkeypatch.setattr(server.engine, "sampling_defaults",
                        {"temperature": 0.5, "top_k": 1, "repetition_penalty": 1.6,
                         "max_tokens": 6})
    messages = user("hi hi hi hi")
    want = llm.chat(messages, SamplingParams(temperature=0.5, top_k=1, repetition_penalty=1.6,
                                             max_tokens=6, ignore_eos=True),
                    use_tqdm=False)[0].outputs[0]
    plain = llm.chat(messages, greedy(6), use_tqdm=False)[0].outputs[0]
    assert want.token_ids != plain.token_ids  # the penalty changes the path
    with TestClient(build_app(server.engine, ServerConfig())) as client:
        body = {"model": MODEL, "messages": messages, "ignore_eos": True}
        r = client.post("/v1/chat/completions", json=body).json()
        assert r["usage"]["completion_tokens"] == 6
        assert r["choices"][0]["message"]["content"] == want.text
        r = client.post("/v1/chat/completions", json=body | {"repetition_penalty": 1.0,
                                                             "max_tokens": 6}).json()
        assert r["choices"][0]["message"]["content"] == plain.text  # top_k 1: greedy


def test_prefix_cache_metrics_and_reset(server: Server) -> None:
    messages = user("The same question, twice.", data_url(make_image(84, 56, 31)))
    chat(server, messages, 4)
    before = server.metrics()
    resp = chat(server, messages, 4)
    after = server.metrics()
    hits = after["vlmserve_prefix_cache_hit_tokens"] - before["vlmserve_prefix_cache_hit_tokens"]
    assert resp.usage.prompt_tokens - 16 <= hits < resp.usage.prompt_tokens
    assert after["vlmserve_prefix_cache_queried_tokens"] - before[
        "vlmserve_prefix_cache_queried_tokens"] == resp.usage.prompt_tokens
    assert 0 < after["vlmserve_prefix_cache_hit_rate"] < 1
    r = httpx.post(server.url + "/reset_prefix_cache")
    assert r.status_code == 200
    chat(server, messages, 4)
    assert server.metrics()["vlmserve_prefix_cache_hit_tokens"] == after[
        "vlmserve_prefix_cache_hit_tokens"]


def test_multiturn_bench_reuses_each_turns_prefix(server: Server) -> None:
    from vlmserve.benchmarks.multiturn import main

    before = server.metrics()["vlmserve_prefix_cache_hit_tokens"]
    r = main(["--base-url", server.url, "--conversations", "3", "--turns", "3", "--images", "2",
              "--image-sizes", "56,84", "--words", "8", "--output-len", "4"])
    assert r["conversations"] == 3 and len(r["mean_ttft_ms_by_turn"]) == 3
    prompts = r["mean_prompt_tokens_by_turn"]
    assert prompts[0] < prompts[1] < prompts[2]  # each turn adds the reply and a question
    assert r["ttft_turns_2_up"]["mean_ms"] > 0 and r["total_tokens_per_s"] > 0
    hits = server.metrics()["vlmserve_prefix_cache_hit_tokens"] - before
    assert hits >= 3 * (prompts[0] + prompts[1]) - 3 * 2 * 16  # turns 2, 3: all but a block


def test_auto_tool_calls_read_from_the_models_text(server: Server, llm: LLM) -> None:
    """tool_choice "auto" (the default with tools; the server runs the hermes parser): the
    answer's text, and the calls the model wrote in its own format as `tool_calls` with
    finish_reason "tool_calls" (a random model writes none unless a regex makes it);
    streamed, the content first, then each call whole."""
    tools = [{"type": "function", "function": {"name": "weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}}}}]
    messages = user("What is the weather in Paris?")
    free = chat(server, messages, 8, tools=tools, extra_body={})
    want = llm.chat(messages, SamplingParams(max_tokens=8, temperature=0.0), use_tqdm=False)
    assert free.choices[0].message.content == want[0].outputs[0].text
    assert not free.choices[0].message.tool_calls and free.choices[0].finish_reason == "length"
    forced = {"structured_outputs": {"regex": r'Sure\.\n<tool_call>\n\{"name": "weather", '
                                               r'"arguments": \{"city": "(Paris|Rome)"\}\}'
                                               r'\n</tool_call>'}}
    resp = chat(server, messages, 80, tools=tools, tool_choice="auto", extra_body=forced)
    choice = resp.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content == "Sure.\n"
    (call,) = choice.message.tool_calls
    assert call.id and call.function.name == "weather"
    assert json.loads(call.function.arguments)["city"] in ("Paris", "Rome")
    chunks = list(chat(server, messages, 80, tools=tools, stream=True, extra_body=forced))
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    deltas = [d for c in chunks if c.choices for d in c.choices[0].delta.tool_calls or []]
    assert content == "Sure.\n" and len(deltas) == 1
    assert deltas[0].function.arguments == call.function.arguments
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


def test_tools_and_grammars_past_their_limits_are_400s_naming_the_option(server: Server
                                                                         ) -> None:
    """Tools are capped (--max-tools, OpenAI's 128), and a grammar's size, nesting and
    choices are checked before anything compiles: a 400 naming the option that raises the
    limit, also for a schema nested past what a JSON reader recurses; the server serves on."""
    from vlmserve.config import StructuredOutputsConfig

    cfg = StructuredOutputsConfig()
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    body = {"model": "tiny", "messages": user("Hi"), "max_tokens": 2}
    for extra, option in [
        ({"tools": [tool] * 129, "tool_choice": "required"}, "--max-tools"),
        ({"tools": [tool] * 129, "tool_choice": "none"}, "--max-tools"),
        ({"structured_outputs": {"choice": [f"c{i}" for i in range(
            cfg.max_grammar_choices + 1)]}}, "--max-grammar-choices"),
        ({"structured_outputs": {"regex": "a" * (cfg.max_grammar_bytes + 1)}},
         "--max-grammar-bytes"),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
            "type": "object", "properties": {f"p{i}": {"type": "string"} for i in range(
                cfg.max_grammar_bytes // 20)}}}}}, "--max-grammar-bytes"),
        ({"structured_outputs": {"json": '{"a": ' * 600 + "1" + "}" * 600}},
         "--max-grammar-nesting"),
    ]:
        for stream in (False, True):
            r = httpx.post(server.url + "/v1/chat/completions",
                           json=body | extra | {"stream": stream}, timeout=60)
            assert r.status_code == 400, (option, r.text)
            assert option in r.json()["error"]["message"], r.text
    ok = httpx.post(server.url + "/v1/chat/completions", timeout=60, json=body | {
        "tools": [tool] * 128, "tool_choice": {"type": "function", "function": {"name": "f"}}})
    assert ok.status_code == 200, ok.text


def test_tool_calls_named_and_required(server: Server, llm: LLM) -> None:
    """tool_choice naming a function, or "required": the answer is a tool call whose
    arguments follow the function's parameter schema (structured outputs, compact JSON): the
    same tokens as `LLM.chat` with that schema; streamed, the arguments arrive in deltas
    after a first chunk with the call's id and name; a conversation with earlier tool calls
    and a tool's answer is accepted."""
    from vlmserve.sampling_params import StructuredOutputsParams as SO

    params = {"type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]},
                                               "days": {"type": "integer", "minimum": 1,
                                                        "maximum": 9}},
              "required": ["city", "days"], "additionalProperties": False}
    tools = [{"type": "function", "function": {"name": "weather", "parameters": params}},
             {"type": "function", "function": {"name": "noop"}}]
    messages = user("What is the weather?", data_url(make_image(84, 56, 1)))
    named = {"type": "function", "function": {"name": "weather"}}
    want = llm.chat(messages, SamplingParams(max_tokens=40, temperature=0.0, structured_outputs=(
        SO(json=params, disable_any_whitespace=True))), use_tqdm=False)[0].outputs[0].text
    resp = chat(server, messages, 40, tools=tools, tool_choice=named, extra_body={})
    msg = resp.choices[0].message
    assert msg.content is None and len(msg.tool_calls) == 1
    call = msg.tool_calls[0]
    assert call.type == "function" and call.function.name == "weather" and call.id
    assert call.function.arguments == want
    args = json.loads(want)
    assert args["city"] in ("Paris", "Rome") and 1 <= args["days"] <= 9
    chunks = list(chat(server, messages, 40, tools=tools, tool_choice=named, stream=True,
                       extra_body={}))
    deltas = [d for c in chunks if c.choices for d in c.choices[0].delta.tool_calls or []]
    assert deltas[0].id and deltas[0].function.name == "weather"
    assert "".join(d.function.arguments or "" for d in deltas) == want
    assert all(not (c.choices and c.choices[0].delta.content) for c in chunks)
    # "required": a list of calls of the tools ("]" favoured: a random model's list ends)
    close = {str(llm.get_tokenizer().convert_tokens_to_ids("]")): 10}
    for stream in (False, True):
        out = chat(server, messages, 60, tools=tools[:1], tool_choice="required", stream=stream,
                   logit_bias=close, extra_body={})
        if stream:  # a call's id and name first, then its arguments in deltas
            deltas = [d for c in out if c.choices for d in c.choices[0].delta.tool_calls or []]
            assert {d.index for d in deltas} == {0} and len(deltas) > 2
            assert deltas[0].id and deltas[0].function.name == "weather"
            names = [d.function.name for d in deltas if d.function.name]
            args = "".join(d.function.arguments or "" for d in deltas)
        else:
            assert out.choices[0].finish_reason == "stop"
            assert out.choices[0].message.content is None
            calls = out.choices[0].message.tool_calls
            names, args = [c.function.name for c in calls], calls[0].function.arguments
        assert names == ["weather"] and json.loads(args)["city"] in ("Paris", "Rome")
    cut = chat(server, messages, 5, tools=tools, tool_choice="required", extra_body={})
    assert cut.choices[0].finish_reason == "length"  # not a whole call: the text as it is
    assert cut.choices[0].message.content.startswith('[{"name')
    # the next turn: the assistant's call and the tool's answer in the history
    history = messages + [
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": '{"sky": "clear"}'}]
    again = chat(server, history, 8, tools=tools, tool_choice="none")
    assert again.choices[0].message.content and not again.choices[0].message.tool_calls


def test_chat_with_a_video_url_matches_llm_chat(server: Server, llm: LLM) -> None:
    """A video_url part (a data URL of an MP4 file): decoded in the preprocessing process,
    sampled as the Python API samples the same file, the same text; a file that is not a
    video is a 400 naming it."""
    clip = make_mp4()
    url = "data:video/mp4;base64," + base64.b64encode(clip).decode()
    r = server.client.chat.completions.create(model="tiny", max_tokens=8, temperature=0,
                                              messages=[{"role": "user", "content": [
                                                  {"type": "video_url", "video_url": {"url": url}},
                                                  {"type": "text", "text": "What happens?"}]}])
    want = llm.chat([{"role": "user", "content": [{"type": "video", "video": clip},
                                                  {"type": "text", "text": "What happens?"}]}],
                    SamplingParams(max_tokens=8, temperature=0), use_tqdm=False)
    assert r.choices[0].message.content == want[0].outputs[0].text
    assert r.usage.prompt_tokens == len(want[0].prompt_token_ids)
    bad = httpx.post(server.url + "/v1/chat/completions", timeout=60, json={
        "model": "tiny", "max_tokens": 4, "messages": [{"role": "user", "content": [
            {"type": "video_url", "video_url": {"url": "data:video/mp4;base64,AAAAAAAA"}},
            {"type": "text", "text": "Hi"}]}]})
    assert bad.status_code == 400 and "video 0" in bad.json()["error"]["message"], bad.text


def test_a_video_of_more_rows_than_a_step_is_served(server: Server) -> None:
    """A video is one encoder item (Qwen2-VL): 6 frames of 440x420 become 720 rows, more than
    the server's step budget of 256; the encoder budget holds the model's largest video
    within its context (1,024), so it is served, its prompt in chunks."""
    clip = make_smooth_mp4(6, 440, 420)
    url = "data:video/mp4;base64," + base64.b64encode(clip).decode()
    r = server.client.chat.completions.create(
        model="tiny", max_tokens=2, temperature=0, extra_body={"ignore_eos": True}, messages=[
            {"role": "user", "content": [{"type": "video_url", "video_url": {"url": url}},
                                         {"type": "text", "text": "What happens?"}]}])
    assert r.usage.completion_tokens == 2 and r.usage.prompt_tokens > 720
