"""Greedy output identical to transformers when prefix caching hits (issue 15), both tiny
models: the same prompts again, a two-turn chat about one image, a cached prefix ending
inside an image's placeholder run, preemption of requests holding cached blocks, and chunk
budgets of 7, 23 and 64 tokens."""

from __future__ import annotations

import pytest

from tests.engine.helpers import (
    assert_prompts_hit,
    chat_prompt,
    check_second_turn,
    make_image,
    mixed_prompts,
)
from tests.engine.test_parity import DEVICE, MAX_TOKENS, check, setup  # noqa: F401
from vlmserve import LLM, SamplingParams

GREEDY = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)


def fresh(llm: LLM, **kw) -> LLM:
    return LLM(llm.engine.config.model_config.model, dtype="float32", device=DEVICE, **kw)


@pytest.mark.parametrize("budget", [7, 23, 64])
def test_the_same_prompts_again_hit_and_match(setup, budget):  # noqa: F811
    _, llm, oracle = setup
    llm = fresh(llm, max_num_batched_tokens=budget, max_num_seqs=4)
    prompts = mixed_prompts(llm)[:5]
    check(llm, oracle, prompts)
    encoded = llm.engine.get_stats()["num_images_encoded"]
    check(llm, oracle, prompts)
    assert_prompts_hit(llm, prompts, encoded)


def test_two_turn_chat_about_one_image(setup):  # noqa: F811
    _, llm, oracle = setup
    check_second_turn(fresh(llm, max_num_batched_tokens=23), check, oracle,
                      make_image(140, 112, 7), GREEDY)


def test_a_cached_prefix_ending_inside_an_image(setup):  # noqa: F811
    """A request aborted after a chunk that ended inside its image leaves the blocks before
    the cut cached; the same prompt again starts inside the image, encodes it and reads
    only its uncached rows."""
    _, llm, oracle = setup
    llm = fresh(llm, max_num_batched_tokens=40, enable_mm_cache=False)
    prompt = chat_prompt(llm, "Look.", [make_image(224, 168, 8)])
    image = llm.engine.input_processor.process(prompt).images[0]
    assert image.offset < 40 < image.offset + image.length
    engine = llm.engine
    engine.add_request(prompt, GREEDY, request_id="cut")
    engine.step()  # the first chunk: 40 tokens, through part of the image
    engine.step()  # its step is read back: its full blocks are keyed
    engine.abort_request("cut")
    engine.step()
    check(llm, oracle, [prompt])
    s = engine.get_stats()
    hit = s["prefix_cache_hit_tokens"]
    assert image.offset < hit < image.offset + image.length
    assert s["num_images_encoded"] == 2


def test_preemption_of_requests_holding_cached_blocks(setup):  # noqa: F811
    _, llm, oracle = setup
    llm = fresh(llm, num_kv_blocks=24, block_size=8, max_num_batched_tokens=64)
    prompts = mixed_prompts(llm)
    check(llm, oracle, prompts[:4] + prompts[:4])
    s = llm.engine.get_stats()
    assert s["num_preemptions"] > 0 and s["prefix_cache_hit_tokens"] > 0


def test_reset_prefix_cache(setup):  # noqa: F811
    _, llm, oracle = setup
    llm = fresh(llm)
    prompt = chat_prompt(llm, "Again and again.", [make_image(56, 56, 9)])
    check(llm, oracle, [prompt])
    llm.reset_prefix_cache()
    check(llm, oracle, [prompt])
    assert llm.engine.get_stats()["prefix_cache_hit_tokens"] == 0
    check(llm, oracle, [prompt])
    assert llm.engine.get_stats()["prefix_cache_hit_tokens"] > 0
