"""Incremental detokenization against the plain algorithm it shortcuts."""

from __future__ import annotations

import random

import pytest
from transformers import AutoTokenizer

from vlmserve.engine.output import OutputProcessor
from vlmserve.multimodal.inputs import ProcessedPrompt
from vlmserve.request import Request
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
