"""AsyncLLMEngine: streaming, admission errors up front, abort on cancel, timing, shutdown."""

from __future__ import annotations

import asyncio
import gc
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.engine.helpers import busy_twice, make_image, trace_preprocessing
from vlmserve import SamplingParams
from vlmserve.engine.async_engine import AsyncLLMEngine, EngineDeadError, RequestTiming
from vlmserve.errors import InvalidImageError, InvalidRequestError, PromptTooLongError

OPTS = dict(model="tiny-qwen2-vl", dtype="float32", device="cpu", max_model_len=512,
            max_num_batched_tokens=128)


@pytest.fixture(scope="module")
def engine(vlmserve_cache: Path) -> Iterator[AsyncLLMEngine]:
    eng = AsyncLLMEngine.from_kwargs(**OPTS)
    yield eng
    eng.shutdown()


def greedy(n: int) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)


def prompts(n: int) -> list[dict]:
    """Raw chat-formatted prompts, every other one with an image."""
    pad = "<|vision_start|><|image_pad|><|vision_end|>"
    return [{"prompt": f"<|im_start|>user\n{pad * (i % 2)}Prompt {i}.<|im_end|>\n"
                       "<|im_start|>assistant\n",
             "multi_modal_data": {"image": [make_image(56, 56 + 28 * i, i)] * (i % 2)}}
            for i in range(n)]


def wait_idle(engine: AsyncLLMEngine) -> dict:
    for _ in range(200):
        s = engine.get_stats()
        if s["num_running"] == s["num_waiting"] == s["num_streams"] == 0:
            return s
        time.sleep(0.01)
    return s


def test_streams_cumulative_outputs_and_concurrency_does_not_change_them(engine) -> None:
    ps = prompts(4)

    async def run(p) -> list:
        return [out async for out in engine.generate(p, greedy(10))]

    async def concurrently() -> list[list]:
        return await asyncio.gather(*(run(p) for p in ps))

    sequential = [asyncio.run(run(p)) for p in ps]
    together = asyncio.run(concurrently())
    for seq, tog in zip(sequential, together):
        assert [o.outputs[0].token_ids for o in seq] == [o.outputs[0].token_ids for o in tog]
        assert [len(o.outputs[0].token_ids) for o in seq] == list(range(1, 11))
        assert [o.finished for o in seq] == [False] * 9 + [True]
        assert seq[-1].outputs[0].finish_reason == "length"


def test_a_step_hands_its_outputs_to_an_event_loop_at_once(engine) -> None:
    from vlmserve.engine import async_engine

    handed: list[int] = []

    async def main() -> None:
        loop = asyncio.get_running_loop()
        plain = loop.call_soon_threadsafe

        def counting(fn, *args, **kw):
            if fn is async_engine._put_all:
                handed.append(len(args[0]))
            return plain(fn, *args, **kw)

        loop.call_soon_threadsafe = counting
        steps = engine.get_stats()["num_steps"]

        async def run(p) -> int:
            return len([o async for o in engine.generate(p, greedy(10))])

        assert await asyncio.gather(*(run(p) for p in prompts(8))) == [10] * 8
        assert len(handed) <= engine.get_stats()["num_steps"] - steps  # one per step at most

    asyncio.run(main())
    assert sum(handed) == 80 and max(handed) > 1  # every output, several per hand-over


def test_admission_errors_are_raised_before_streaming(engine) -> None:
    async def main() -> None:
        with pytest.raises(InvalidRequestError, match="vocabulary"):
            await engine.add_request({"prompt_token_ids": [10**9]}, greedy(4))
        with pytest.raises(PromptTooLongError, match="maximum context length"):
            async for _ in engine.generate({"prompt_token_ids": [5] * 600}, greedy(4)):
                pytest.fail("no output expected")
        bad_image = {"prompt": prompts(2)[1]["prompt"],
                     "multi_modal_data": {"image": b"junk"}}
        with pytest.raises(InvalidImageError):
            await engine.add_request(bad_image, greedy(4))
        outs = [o async for o in engine.generate("still fine", greedy(3))]
        assert outs[-1].finished and len(outs[-1].outputs[0].token_ids) == 3

    asyncio.run(main())
    assert wait_idle(engine)["num_streams"] == 0


def test_requests_are_preprocessed_on_the_engine_thread_while_it_steps(vlmserve_cache: Path,
                                                                       monkeypatch) -> None:
    """Requests arriving while the device runs a step (simulated: each step reports busy
    twice) are preprocessed there, on the engine thread, with the same outputs; bad input among
    them fails its caller only."""
    from vlmserve.worker.model_runner import StepResult

    ps = prompts(6)
    bad = {"prompt": ps[1]["prompt"], "multi_modal_data": {"image": b"junk"}}

    async def run(eng, p):
        return [o async for o in eng.generate(p, greedy(8))][-1].outputs[0].token_ids

    async def all_at_once(eng):
        return await asyncio.gather(*(run(eng, p) for p in ps[:3] + [bad] + ps[3:]),
                                    return_exceptions=True)

    ref = AsyncLLMEngine.from_kwargs(**OPTS)
    try:
        expected = [asyncio.run(run(ref, p)) for p in ps]
    finally:
        ref.shutdown()

    monkeypatch.setattr(StepResult, "ready", busy_twice)
    # a small step: only the first requests are admitted before it, the rest during steps
    eng = AsyncLLMEngine.from_kwargs(**{**OPTS, "max_num_batched_tokens": 16})
    try:
        where = asyncio.run(eng.call(trace_preprocessing))
        results = asyncio.run(all_at_once(eng))
    finally:
        eng.shutdown()
    assert isinstance(results[3], InvalidImageError)
    assert results[:3] + results[4:] == expected
    assert len(where) == 7 and all(thread is eng._thread for _, thread in where)
    assert any(in_step for in_step, _ in where), "some requests should arrive during a step"


@pytest.mark.parametrize("how", ["cancel", "break", "aclose"])
def test_consumer_leaving_aborts_the_request(engine, how: str) -> None:
    finished: list[RequestTiming] = []
    engine.add_finish_callback(finished.append)
    p = prompts(2)[1]

    seen = asyncio.Event()

    async def consume() -> None:
        gen = engine.generate(p, greedy(400))
        async for out in gen:
            if len(out.outputs[0].token_ids) == 3:
                seen.set()
                if how == "aclose":
                    await gen.aclose()
                if how != "cancel":
                    break

    async def main() -> dict:
        task = asyncio.create_task(consume())
        await seen.wait()
        if how == "cancel":
            task.cancel()  # the consumer is waiting for its next output
        await asyncio.gather(task, return_exceptions=True)
        gc.collect()
        for _ in range(100):  # the loop stays open: nothing but the abort ends the request
            s = engine.get_stats()
            if s["num_running"] == s["num_streams"] == 0:
                break
            await asyncio.sleep(0.01)
        return s

    s = asyncio.run(main())
    engine._finish_callbacks.remove(finished.append)
    assert s["num_running"] == s["num_waiting"] == s["num_streams"] == 0
    assert s["num_free_kv_blocks"] == s["num_kv_blocks"] and s["encoder_cache_referenced"] == 0
    assert [t.finish_reason for t in finished] == ["abort"]
    assert 0 < len(finished[0].token_times) < 400


def test_timing(engine) -> None:
    finished: list[RequestTiming] = []
    engine.add_finish_callback(finished.append)

    async def main():
        stream = await engine.add_request("time me", greedy(6))
        return [o async for o in stream], stream.timing

    outs, timing = asyncio.run(main())
    engine._finish_callbacks.remove(finished.append)
    assert finished == [timing] and timing.finish_reason == "length"
    assert len(timing.token_times) == 6
    assert timing.num_prompt_tokens == len(outs[0].prompt_token_ids)
    assert 0 <= timing.ttft <= timing.e2e_latency
    assert len(timing.inter_token_latencies) == 5 and min(timing.inter_token_latencies) >= 0


def test_step_failure_and_shutdown_end_every_stream(vlmserve_cache: Path) -> None:
    eng = AsyncLLMEngine.from_kwargs(**OPTS)

    def boom(*args):
        raise RuntimeError("kaput")

    async def main() -> None:
        stream = await eng.add_request("hello", greedy(50))
        await eng.call(lambda e: setattr(e, "step", boom))
        with pytest.raises(EngineDeadError, match="kaput"):
            async for _ in stream:
                pass
        with pytest.raises(EngineDeadError):
            await eng.add_request("again", greedy(2))

    try:
        asyncio.run(main())
        assert not eng.is_running
    finally:
        eng.shutdown()
    eng2 = AsyncLLMEngine.from_kwargs(**OPTS)
    eng2.shutdown()
    assert not eng2.is_running
    with pytest.raises(EngineDeadError):
        asyncio.run(eng2.add_request("x", greedy(2)))
