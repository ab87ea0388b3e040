"""LLaVA-1.5 greedy output token-for-token identical to transformers `generate` on
`tiny-llava-1.5` (plain 1-D positions, a fixed 36 tokens per image), through batching,
chunked prefill through image placeholder runs, preemption, embedding offload with the
encoder cache, and prefix-cache hits."""

from __future__ import annotations

import pytest
import torch

from tests.engine.helpers import HFOracle, chat_prompt, make_image, mixed_prompts
from tests.engine.test_parity import MAX_TOKENS, check
from vlmserve import LLM
from vlmserve.multimodal.inputs import pixel_values


class LlavaOracle(HFOracle):
    """`LlavaForConditionalGeneration.generate` on our token ids and our pixel values."""

    def _inputs(self, processed, extra_ids: list[int] = ()):
        ids = torch.tensor([processed.prompt_token_ids + list(extra_ids)])
        kwargs = {"pixel_values": pixel_values(processed.images)} if processed.images else {}
        return ids.to(self.device), {k: v.to(self.device) for k, v in kwargs.items()}


@pytest.fixture(scope="module")
def setup(vlmserve_cache):
    from vlmserve.models.builtin import resolve_model

    llm = LLM("tiny-llava-1.5", dtype="float32", device="cpu")
    return llm, LlavaOracle(resolve_model("tiny-llava-1.5"), "LlavaForConditionalGeneration")


def test_text_only(setup):
    llm, oracle = setup
    check(llm, oracle, [chat_prompt(llm, "Write a haiku about the sea.", [])])


def test_one_image(setup):
    llm, oracle = setup
    prompt = chat_prompt(llm, "What is this?", [make_image(112, 84, 1)])
    check(llm, oracle, [prompt])
    out = llm.engine.input_processor.process(prompt)
    assert out.images[0].length == 36
    image_token_id = llm.engine.input_processor.model_processor.image_token_id
    assert out.prompt_token_ids.count(image_token_id) == 36


def test_three_images_of_different_sizes(setup):
    llm, oracle = setup
    imgs = [make_image(56, 56, 2), make_image(300, 84, 3), make_image(90, 224, 4)]
    prompt = chat_prompt(llm, "Compare the three.", imgs)
    check(llm, oracle, [prompt])
    # the images matter: another third image changes the greedy output
    other = chat_prompt(llm, "Compare the three.", imgs[:2] + [make_image(90, 224, 5)])
    outs = llm.generate([prompt, other], _params(), use_tqdm=False)
    assert outs[0].outputs[0].token_ids != outs[1].outputs[0].token_ids


def test_eight_requests_together(setup):
    llm, oracle = setup
    check(llm, oracle, mixed_prompts(llm))


@pytest.mark.parametrize("budget", [16, 37, 64])
def test_chunks_cut_through_images(setup, budget):
    llm, oracle = setup
    engine = check(llm, oracle, mixed_prompts(llm), max_num_batched_tokens=budget).engine
    assert engine.num_steps > 8


def test_preemption_keeps_output(setup):
    llm, oracle = setup
    engine = check(llm, oracle, mixed_prompts(llm), num_kv_blocks=24, block_size=8,
                   max_num_batched_tokens=128).engine
    assert engine.scheduler.num_preemptions > 0


def test_offload_cache_and_repeated_images(setup):
    """Embedding offload and the encoder cache: each distinct image encoded once."""
    llm, oracle = setup
    a, b = make_image(112, 84, 21), make_image(84, 112, 22)
    prompts = [chat_prompt(llm, "Twice the same?", [a, b, a]),
               chat_prompt(llm, "And again.", [a]),
               chat_prompt(llm, "Only b.", [b, b])]
    engine = check(llm, oracle, prompts, max_num_batched_tokens=37, max_num_seqs=2,
                   mm_embedding_offload=True).engine
    stats = engine.get_stats()
    assert stats["num_images_encoded"] == 2
    assert stats["prefetch_hit_rows"] > 0


def test_prefix_cache_hits_match(setup):
    llm, oracle = setup
    prompts = mixed_prompts(llm)[:5]
    llm = check(llm, oracle, prompts, max_num_batched_tokens=23, max_num_seqs=4,
                enable_prefix_caching=True)
    encoded = llm.engine.get_stats()["num_images_encoded"]
    check(llm, oracle, prompts)
    s = llm.engine.get_stats()
    assert s["prefix_cache_hit_tokens"] > 0.8 * sum(
        len(llm.engine.input_processor.process(p).prompt_token_ids) for p in prompts)
    assert s["num_images_encoded"] == encoded  # every image lay inside a hit


def _params():
    from vlmserve import SamplingParams

    return SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
