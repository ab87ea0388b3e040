"""LLaVA-NeXT greedy output token-for-token identical to transformers `generate` on
`tiny-llava-next` (anyres tiles, a per-image token count from the picked grid and unpadding,
Mistral decoder), through batching of tile stacks of different counts, chunked prefill
through image placeholder runs, preemption, embedding offload with the encoder cache,
prefix-cache hits, and an engine-core process with preprocessing workers."""

from __future__ import annotations

import pytest
import torch

from tests.engine.helpers import HFOracle, chat_prompt, make_image, mixed_prompts
from tests.engine.llava_shared import (  # noqa: F401  (run here on this module's setup)
    test_chunks_cut_through_images,
    test_eight_requests_together,
    test_offload_cache_and_repeated_images,
    test_preemption_keeps_output,
    test_prefix_cache_hits_match,
)
from tests.engine.test_parity import MAX_TOKENS, check
from vlmserve import LLM, SamplingParams
from vlmserve.multimodal.inputs import pixel_values


class LlavaNextOracle(HFOracle):
    """`LlavaNextForConditionalGeneration.generate` on our token ids and our tiles, padded
    per image to the most tiles as the HF processor pads them, with the original sizes."""

    def _inputs(self, processed, extra_ids: list[int] = ()):
        ids = torch.tensor([processed.prompt_token_ids + list(extra_ids)])
        kwargs = {}
        if processed.images:
            tiles = [pixel_values([img]) for img in processed.images]
            batch = torch.zeros(len(tiles), max(t.shape[0] for t in tiles), *tiles[0].shape[1:])
            for i, t in enumerate(tiles):
                batch[i, :t.shape[0]] = t
            sizes = [img.encoder_meta[1:] for img in processed.images]  # original (h, w)
            kwargs = {"pixel_values": batch, "image_sizes": torch.tensor(sizes)}
        return ids.to(self.device), {k: v.to(self.device) for k, v in kwargs.items()}


@pytest.fixture(scope="module")
def setup(vlmserve_cache):
    from vlmserve.models.builtin import resolve_model

    llm = LLM("tiny-llava-next", dtype="float32", device="cpu")
    return llm, LlavaNextOracle(resolve_model("tiny-llava-next"),
                                "LlavaNextForConditionalGeneration")


def test_text_only(setup):
    llm, oracle = setup
    check(llm, oracle, [chat_prompt(llm, "Write a haiku about the sea.", [])])


def test_one_image(setup):
    llm, oracle = setup
    prompt = chat_prompt(llm, "What is this?", [make_image(112, 84, 1)])
    check(llm, oracle, [prompt])
    out = llm.engine.input_processor.process(prompt)
    image_token_id = llm.engine.input_processor.model_processor.image_token_id
    assert out.prompt_token_ids.count(image_token_id) == out.images[0].length == 16 + 6 * 9


def test_three_images_pick_different_grids(setup):
    llm, oracle = setup
    # width x height: wide 1x3, tall 2x1, square 2x2 grids
    imgs = [make_image(300, 90, 2), make_image(50, 100, 3), make_image(130, 120, 4)]
    prompt = chat_prompt(llm, "Compare the three.", imgs)
    check(llm, oracle, [prompt])
    out = llm.engine.input_processor.process(prompt)
    assert [img.pixels.shape[0] for img in out.images] == [4, 3, 5]
    assert len({img.length for img in out.images}) == 3
    # the images matter: another third image changes the greedy output
    other = chat_prompt(llm, "Compare the three.", imgs[:2] + [make_image(130, 120, 5)])
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    outs = llm.generate([prompt, other], params, use_tqdm=False)
    assert outs[0].outputs[0].token_ids != outs[1].outputs[0].token_ids


@pytest.fixture
def preemption_kv_blocks():
    return 40


@pytest.fixture
def second_image_size():
    return (50, 100)


def test_engine_core_process_and_preprocessing_workers(setup):
    """Tile stacks as zero-copy frames to an engine-core process, preprocessed in a worker
    process: the same tokens as in-process."""
    import asyncio

    from vlmserve.config import EngineConfig
    from vlmserve.frontend.async_llm import AsyncLLM

    llm, _ = setup
    prompts = mixed_prompts(llm)[1:5]
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    expected = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    engine = AsyncLLM(EngineConfig.from_kwargs(model="tiny-llava-next", dtype="float32",
                                               device="cpu", max_num_batched_tokens=64),
                      preprocess_workers=1)
    try:
        async def run(p):
            return [o async for o in engine.generate(p, params)][-1].outputs[0].token_ids

        async def together():
            return await asyncio.gather(*(run(p) for p in prompts))

        assert asyncio.run(together()) == expected
    finally:
        engine.shutdown()
