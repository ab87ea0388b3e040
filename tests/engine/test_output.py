"""Incremental detokenization against the plain algorithm it shortcuts."""

from __future__ import annotations

import random

import pytest
from transformers import AutoTokenizer

from vlmserve.frontend.output import OutputProcessor
from vlmserve.multimodal.inputs import ProcessedPrompt
from vlmserve.request import Request, RequestStatus
from vlmserve.sampling_params import SamplingParams


@pytest.fixture(scope="module")
def tokenizer(tiny_qwen2_vl_path):
    return AutoTokenizer.from_pretrained(str(tiny_qwen2_vl_path))


def plain_texts(tok, ids, skip):
    """Text after each token, decoding both windows every time (no caching, no skipping),
    then the text after the final flush."""
    text, prefix_offset, read_offset, texts = "", 0, 0, []
    for n in range(1, len(ids) + 1):
        prefix = tok.decode(ids[prefix_offset:read_offset], skip_special_tokens=skip)
        full = tok.decode(ids[prefix_offset:n], skip_special_tokens=skip)
        if len(full) > len(prefix) and not full.endswith("\ufffd"):
            text += full[len(prefix):]
            prefix_offset, read_offset = read_offset, n
        texts.append(text)
    prefix = tok.decode(ids[prefix_offset:read_offset], skip_special_tokens=skip)
    full = tok.decode(ids[prefix_offset:], skip_special_tokens=skip)
    texts.append(text + full[len(prefix):] if len(full) > len(prefix) else text)
    return texts


def random_ids(tokenizer, seed, n=300):
    """Pieces of multi-byte characters, special tokens, ids beyond the vocabulary, plain ids."""
    multibyte = tokenizer.encode("héllo wörld ✓ 日本語 😀 🙂", add_special_tokens=False)
    special = sorted(tokenizer.all_special_ids)
    assert special and max(multibyte) < len(tokenizer)
    rng = random.Random(seed)
    kinds = [lambda: rng.choice(multibyte), lambda: rng.choice(special),
             lambda: rng.randrange(len(tokenizer), len(tokenizer) + 1000),
             lambda: rng.randrange(len(tokenizer))]
    return [rng.choice(kinds)() for _ in range(n)]


@pytest.mark.parametrize("skip", [True, False])
@pytest.mark.parametrize("seed", range(4))
def test_incremental_text_matches_plain_decoding(tokenizer, skip, seed):
    ids = random_ids(tokenizer, seed)
    op = OutputProcessor(tokenizer)
    req = Request("r", ProcessedPrompt(None, [1], []),
                  SamplingParams(max_tokens=len(ids), skip_special_tokens=skip))
    op.add("r")
    texts = []
    for token in ids:
        req.output_token_ids.append(token)
        assert not op.update(req)
        texts.append(op.make_output(req).outputs[0].text)
    op.flush(req)
    texts.append(op.make_output(req).outputs[0].text)
    assert texts == plain_texts(tokenizer, ids, skip)


@pytest.mark.parametrize("skip", [True, False])
@pytest.mark.parametrize("seed", range(4))
def test_final_only_text_is_the_incremental_final_text(tokenizer, skip, seed):
    """Without stop strings a final-only request is decoded once at the end: same text."""
    ids = random_ids(tokenizer, seed)
    op = OutputProcessor(tokenizer)
    reqs = {kind: Request(kind, ProcessedPrompt(None, [1], []), SamplingParams(
        max_tokens=len(ids), skip_special_tokens=skip, output_kind=kind))
        for kind in ("cumulative", "final_only")}
    for req in reqs.values():
        op.add(req.request_id)
        for token in ids:
            req.output_token_ids.append(token)
            assert not op.update(req)
        op.flush(req)
    texts = {kind: op.make_output(req).outputs[0].text for kind, req in reqs.items()}
    assert texts["final_only"] == texts["cumulative"] == plain_texts(tokenizer, ids, skip)[-1]


def _run(op, req, ids, length_at_end=True):
    """Feed `ids` through `op.process` as the engine does; the outputs it returns."""
    def stopped(r):
        r.status = RequestStatus.FINISHED_STOPPED

    op.add(req.request_id)
    outs = []
    for i, token in enumerate(ids):
        req.output_token_ids.append(token)
        if req.output_logprobs is not None:
            req.output_logprobs.append({token: -float(i)})
        if i == len(ids) - 1 and length_at_end:
            req.status = RequestStatus.FINISHED_LENGTH
        out = op.process(req, stopped)
        if out is not None:
            outs.append(out)
        if req.status.finished:
            break
    return outs


@pytest.mark.parametrize("skip", [True, False])
@pytest.mark.parametrize("seed", range(6))
def test_delta_outputs_join_to_the_cumulative_output(tokenizer, skip, seed):
    """Delta outputs (what the server streams) carry each token once and, joined, the
    cumulative output's text, also when a stop string ends the request across outputs; no
    delta ever carries text that the stop string later cut."""
    ids = random_ids(tokenizer, seed, n=120)
    final_text = plain_texts(tokenizer, ids, skip)[-1]
    rng = random.Random(seed)
    stops = []
    if seed % 3 and len(final_text) > 8:  # a stop string from the text: it ends the request
        start = rng.randrange(len(final_text) // 2, len(final_text) - 4)
        stops = [final_text[start:start + rng.randint(2, 4)], "\x01never"]
    outs = {}
    for kind in ("cumulative", "delta"):
        params = SamplingParams(max_tokens=len(ids), skip_special_tokens=skip, stop=stops,
                                include_stop_str_in_output=seed % 2 == 0, logprobs=1,
                                output_kind=kind)
        outs[kind] = _run(OutputProcessor(tokenizer), Request(kind, ProcessedPrompt(
            None, [1], []), params), ids)
    cumulative, delta = outs["cumulative"], outs["delta"]
    assert len(delta) == len(cumulative) and delta[-1].finished
    last = cumulative[-1].outputs[0]
    joined = "".join(o.outputs[0].text for o in delta)
    assert joined == last.text
    assert [t for o in delta for t in o.outputs[0].token_ids] == last.token_ids
    assert [lp for o in delta for lp in o.outputs[0].logprobs] == last.logprobs
    assert delta[-1].outputs[0].finish_reason == last.finish_reason
    so_far = ""
    for o in delta:
        so_far += o.outputs[0].text
        assert last.text.startswith(so_far)
    if stops:
        assert last.finish_reason == "stop"
