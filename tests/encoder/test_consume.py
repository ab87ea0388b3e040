"""The LLM consumes embeddings an encoder service made (issue 22, item 3): output
token-identical to the in-process path (which is itself at parity with transformers), through
chunked prefill and offload; every handle opened once and released, nothing left live."""

from __future__ import annotations

import time

import pytest

from tests.engine.helpers import chat_prompt, make_image
from vlmserve import LLM, SamplingParams
from vlmserve.encoder import MultimodalEncoder
from vlmserve.errors import InvalidRequestError
from vlmserve.transfer.consumer_ledger import consumer_ledger

GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
MODELS = ["tiny-qwen2-vl", "tiny-qwen2.5-vl", "tiny-qwen3-vl", "tiny-llava-1.5",
          "tiny-llava-next"]


def prompts(llm: LLM) -> list[dict]:
    return [chat_prompt(llm, "Describe.", [make_image(112, 84, 1)]),
            chat_prompt(llm, "Compare these.", [make_image(56, 56, 2), make_image(140, 112, 3),
                                                make_image(56, 56, 2)]),
            chat_prompt(llm, "No image here.", [])]


@pytest.mark.parametrize("model", MODELS)
@pytest.mark.parametrize("engine_kw", [
    {}, {"max_num_batched_tokens": 23, "enable_mm_cache": False},
    {"max_num_batched_tokens": 37, "mm_embedding_offload": True, "enable_mm_cache": False}])
def test_embeddings_from_the_encoder_give_the_same_tokens(vlmserve_cache, model, engine_kw):
    llm = LLM(model, dtype="float32", device="cpu", **engine_kw)
    ps = prompts(llm)
    expected = [o.outputs[0].token_ids for o in llm.generate(ps, GREEDY, use_tqdm=False)]
    llm.reset_prefix_cache()
    enc = MultimodalEncoder(model, dtype="float32", device="cpu", lease_s=30)
    try:
        encoded = enc.encode(ps)
        tower = llm.engine.core.executor.runner.encoder
        batches, stored = tower.num_batches, llm.engine.get_stats()["num_images_encoded"]
        outs = llm.generate([{"prompt": p["prompt"], "multi_modal_embeddings": e}
                             for p, e in zip(ps, encoded)], GREEDY, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outs] == expected
        assert [o.prompt_token_ids for o in outs] == [e.prompt_token_ids for e in encoded]
        assert tower.num_batches == batches  # the LLM's vision tower ran for none of them
        if not llm.engine.config.cache_config.enable_mm_cache:  # so each image was copied in
            assert llm.engine.get_stats()["num_images_encoded"] == stored + 3
        deadline = time.monotonic() + 10  # releases reach the producer asynchronously
        while enc.get_stats().ledger.live_handles and time.monotonic() < deadline:
            time.sleep(0.05)
        stats = enc.get_stats().ledger
        assert stats.live_handles == 0 and stats.released == stats.exported == 4
        assert stats.double_opens == stats.reclaimed == 0
    finally:
        enc.shutdown()


def test_a_handle_is_opened_once_and_bad_input_is_refused(vlmserve_cache):
    llm = LLM("tiny-qwen2-vl", dtype="float32", device="cpu")
    enc = MultimodalEncoder("tiny-qwen2-vl", dtype="float32", device="cpu", lease_s=30)
    try:
        p = chat_prompt(llm, "Once.", [make_image(84, 84, 5)])
        (out,) = enc.encode([p])
        llm.generate({"multi_modal_embeddings": out}, GREEDY, use_tqdm=False)
        with pytest.raises(Exception, match="(?i)twice|opened|released"):
            llm.generate({"multi_modal_embeddings": out}, GREEDY, use_tqdm=False)
        (out2,) = enc.encode([p])
        with pytest.raises(InvalidRequestError, match="differs"):
            llm.generate({"prompt": "something else", "multi_modal_embeddings": out2}, GREEDY,
                         use_tqdm=False)
        with pytest.raises(InvalidRequestError, match="EncoderOutput"):
            llm.generate({"multi_modal_embeddings": {"x": 1}}, GREEDY, use_tqdm=False)
        assert consumer_ledger().stats().live == 0
        assert not llm.engine.has_unfinished_requests()
    finally:
        enc.shutdown()


def test_the_engine_core_process_takes_embeddings_too(vlmserve_cache):
    """Through the server's path: a front end (`AsyncLLM`, preprocessing processes) opens the
    handles and sends the rows to the engine-core process as frames."""
    import asyncio

    from vlmserve.frontend.async_llm import AsyncLLM

    opts = dict(model="tiny-qwen2-vl", dtype="float32", device="cpu", max_model_len=512,
                max_num_batched_tokens=37)
    llm = LLM(**opts)
    ps = prompts(llm)
    expected = [o.outputs[0].token_ids for o in llm.generate(ps, GREEDY, use_tqdm=False)]
    enc = MultimodalEncoder("tiny-qwen2-vl", dtype="float32", device="cpu", lease_s=30)
    engine = AsyncLLM.from_kwargs(**opts)

    async def run(p) -> list[int]:
        final = None
        async for out in engine.generate(p, GREEDY):
            final = out
        return final.outputs[0].token_ids

    async def all_of_them() -> list[list[int]]:
        return await asyncio.gather(*(run({"multi_modal_embeddings": e})
                                      for e in enc.encode(ps)))

    try:
        assert asyncio.run(all_of_them()) == expected
        deadline = time.monotonic() + 10
        while enc.get_stats().ledger.live_handles and time.monotonic() < deadline:
            time.sleep(0.05)
        assert enc.get_stats().ledger.live_handles == 0
        assert enc.get_stats().ledger.released == 4
    finally:
        engine.shutdown()
        enc.shutdown()
