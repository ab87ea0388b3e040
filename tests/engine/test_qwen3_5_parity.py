"""Qwen3.5 and Qwen3.5-MoE through the engine (linear-attention layers on the state pool,
full-attention layers on the paged KV): greedy output token-for-token identical to
transformers `generate` for text, images, a video, batches, chunked prefill cutting through
images and through the linear layers' 64-token chunks, preemption, prefix caching on a
multi-turn chat (turn 2 equal to a cold run); the state pool holds max_num_seqs running
states (plus the snapshot slots prefix caching asks for) and no more."""

from __future__ import annotations

import numpy as np
import pytest

from tests.engine.helpers import (
    HFOracle,
    chat_prompt,
    check_second_turn,
    make_image,
    mixed_prompts,
)
from tests.engine.test_parity import DEVICE, MAX_TOKENS, check
from vlmserve import LLM, SamplingParams

MODELS = {"qwen3.5": ("tiny-qwen3.5", "Qwen3_5ForConditionalGeneration"),
          "qwen3.5-moe": ("tiny-qwen3.5-moe", "Qwen3_5MoeForConditionalGeneration")}
GREEDY = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module", params=list(MODELS))
def setup(request, vlmserve_cache):
    from vlmserve.models.builtin import resolve_model

    name, arch = MODELS[request.param]
    llm = LLM(name, dtype="float32", device=DEVICE, enable_prefix_caching=False)
    return name, llm, HFOracle(resolve_model(name), arch, DEVICE)


def engine(name: str, **kw) -> LLM:
    return LLM(name, dtype="float32", device=DEVICE, **kw)


def test_text_images_and_a_batch(setup):
    """Eight requests of 0-3 images of different sizes in one batch."""
    _, llm, oracle = setup
    check(llm, oracle, mixed_prompts(llm))


@pytest.mark.parametrize("budget", [7, 23])
def test_chunks_cut_through_images_and_linear_chunks(setup, budget):
    """Chunks of 7 or 23 tokens: through images, and a 100-token text prompt computed in
    pieces that cross the linear layers' 64-token chunks."""
    name, llm, oracle = setup
    long = chat_prompt(llm, " ".join(f"word{i}" for i in range(60)), [])
    check(llm, oracle, [long, *mixed_prompts(llm)[1:4]], max_num_batched_tokens=budget,
          enable_prefix_caching=False)


def test_a_video_beside_an_image(setup):
    """Four frames (two temporal patches, each after its time as text) and an image."""
    _, llm, oracle = setup
    frames = np.random.default_rng(3).integers(0, 256, (4, 64, 96, 3), np.uint8)
    prompt = {"prompt": "<|im_start|>user\n<|vision_start|><|video_pad|><|vision_end|>"
                        "<|vision_start|><|image_pad|><|vision_end|>What happens?<|im_end|>\n"
                        "<|im_start|>assistant\n",
              "multi_modal_data": {"video": [(frames, {"fps": 2.0})],
                                   "image": [make_image(64, 64, 4)]}}
    check(llm, oracle, [prompt])


def test_preemption_and_resumption(setup):
    """A KV cache of 24 blocks of 8 tokens: requests are preempted (their state slots freed)
    and recomputed from zeros when they resume."""
    name, llm, oracle = setup
    out = check(llm, oracle, mixed_prompts(llm), num_kv_blocks=24, block_size=8,
                max_num_batched_tokens=64, enable_prefix_caching=False)
    assert out.engine.scheduler.num_preemptions > 0


def test_turn_two_of_a_chat_resumes_from_a_snapshot(setup):
    """Turn 2 of a chat about an image hits the prefix cache (the linear layers resume from
    the snapshot at the last block boundary turn 1 reached) and equals a cold run, and
    transformers."""
    name, _, oracle = setup
    llm = engine(name, max_num_batched_tokens=23, enable_prefix_caching=True)
    turn2 = check_second_turn(llm, check, oracle, make_image(112, 84, 9), GREEDY)
    cold = engine(name, max_num_batched_tokens=23, enable_prefix_caching=False)
    again = cold.generate(turn2, GREEDY, use_tqdm=False)[0]
    assert again.outputs[0].token_ids == llm.generate(
        turn2, GREEDY, use_tqdm=False)[0].outputs[0].token_ids


def test_the_state_pool_holds_max_num_seqs_states(setup):
    """Three running states (and a scratch slot for graph padding) with max_num_seqs 3;
    prefix caching adds as many snapshot slots. Eight requests still all finish."""
    name, llm, oracle = setup
    small = check(llm, oracle, mixed_prompts(llm), max_num_seqs=3, enable_prefix_caching=False)
    runner = small.engine.executor.runner
    assert runner.linear.num_slots == 3
    conv, ssm = runner.kv_caches[0]
    assert conv.shape[0] == ssm.shape[0] == 4
    assert len(runner.linear.pools) == 2  # the two linear layers; the full one holds KV
    cached = engine(name, max_num_seqs=3, enable_prefix_caching=True)
    assert cached.engine.executor.runner.linear.num_slots == 6
    assert cached.engine.scheduler.kv.states.max_num_seqs == 3
