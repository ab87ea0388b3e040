"""LLaVA-1.5 greedy output token-for-token identical to transformers `generate` on
`tiny-llava-1.5` (plain 1-D positions, a fixed 36 tokens per image), through batching,
chunked prefill through image placeholder runs, preemption, embedding offload with the
encoder cache, and prefix-cache hits."""

from __future__ import annotations

import pytest
import torch

from tests.engine.helpers import HFOracle, chat_prompt, make_image
from tests.engine.llava_shared import (  # noqa: F401  (run here on this module's setup)
    test_chunks_cut_through_images,
    test_eight_requests_together,
    test_offload_cache_and_repeated_images,
    test_preemption_keeps_output,
    test_prefix_cache_hits_match,
)
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


@pytest.fixture
def preemption_kv_blocks():
    return 24


@pytest.fixture
def second_image_size():
    return (84, 112)


def _params():
    from vlmserve import SamplingParams

    return SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
