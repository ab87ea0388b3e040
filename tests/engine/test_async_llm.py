"""AsyncLLM (the front end) with a real engine-core process: streaming, admission errors up
front, abort on cancel, stop strings, timing, the core's death."""

from __future__ import annotations

import asyncio
import gc
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.engine.helpers import make_image
from tests.wait import wait_until
from vlmserve import SamplingParams
from vlmserve.config import EngineConfig
from vlmserve.errors import InvalidImageError, InvalidRequestError, PromptTooLongError
from vlmserve.frontend.async_llm import AsyncLLM, EngineDeadError, RequestTiming

OPTS = dict(model="tiny-qwen2-vl", dtype="float32", device="cpu", max_model_len=512,
            max_num_batched_tokens=128)


@pytest.fixture(scope="module")
def engine(vlmserve_cache: Path) -> Iterator[AsyncLLM]:
    eng = AsyncLLM.from_kwargs(**OPTS)
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


def wait_idle(engine: AsyncLLM) -> dict:
    """The engine's stats once nothing runs, waits or streams (or the last ones seen)."""
    seen: list[dict] = []

    def idle() -> bool:
        seen.append(asyncio.run(engine.get_stats()))
        return seen[-1]["num_running"] == seen[-1]["num_waiting"] == seen[-1]["num_streams"] == 0

    wait_until(idle, step_s=0.01)
    return seen[-1]


def test_streams_cumulative_outputs_and_concurrency_does_not_change_them(engine) -> None:
    ps = prompts(4)

    async def run(p) -> list:
        return [out async for out in engine.generate(p, greedy(10))]

    async def concurrently() -> list[list]:
        return await asyncio.gather(*(run(p) for p in ps))

    sequential = [asyncio.run(run(p)) for p in ps]
    together = asyncio.run(concurrently())
    for seq, tog in zip(sequential, together):
        assert seq[-1].outputs[0].token_ids == tog[-1].outputs[0].token_ids
        for outs in (seq, tog):  # cumulative: each a longer prefix of the last (a reader
            # that fell behind a step or more gets the newest)
            final = outs[-1].outputs[0].token_ids
            lengths = [len(o.outputs[0].token_ids) for o in outs]
            assert lengths == sorted(set(lengths)) and lengths[-1] == 10
            assert all(o.outputs[0].token_ids == final[:n] for o, n in zip(outs, lengths))
            assert [o.finished for o in outs] == [False] * (len(outs) - 1) + [True]
            assert outs[-1].outputs[0].finish_reason == "length"


def test_a_step_hands_its_outputs_to_an_event_loop_at_once(engine) -> None:
    from vlmserve.frontend import core_client

    handed: list[int] = []

    async def main() -> None:
        loop = asyncio.get_running_loop()
        plain = loop.call_soon_threadsafe

        def counting(fn, *args, **kw):
            if fn is core_client.put_all:
                handed.append(len(args[0]))
            return plain(fn, *args, **kw)

        loop.call_soon_threadsafe = counting
        steps = (await engine.get_stats())["num_steps"]

        async def run(p) -> tuple[bool, int]:  # (at most one output a token, tokens)
            outs = [o async for o in engine.generate(p, greedy(10))]
            return len(outs) <= 10, len(outs[-1].outputs[0].token_ids)

        assert await asyncio.gather(*(run(p) for p in prompts(8))) == [(True, 10)] * 8
        assert len(handed) <= (await engine.get_stats())["num_steps"] - steps  # one a step

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


def test_messages_carry_tensors_as_frames_without_copies() -> None:
    """An image's pixels and the mRoPE positions travel as frames of their own, sharing the
    sender's memory, and decode to equal tensors sharing the frames' memory."""
    import numpy as np
    import torch

    from vlmserve.engine.messages import AddRequest, Decoder, Encoder, ImageData, ToCore

    pixels = torch.randint(0, 255, (56, 84, 3), dtype=torch.uint8)
    positions = torch.arange(30).expand(3, -1).contiguous()
    msg = AddRequest("r1", list(range(30)), [ImageData("h", 3, 6, (1, 4, 6), pixels)],
                     positions, -4, greedy(5), (7, 8))
    frames = Encoder().encode(msg)
    assert len(frames) == 3 and len(frames[0]) < 1000  # no pixel bytes (14 KB) in the body
    assert np.shares_memory(np.asarray(frames[1]), pixels.numpy())
    got = Decoder(ToCore).decode([bytearray(f) for f in frames])
    assert isinstance(got, AddRequest) and got.sampling_params == greedy(5)
    assert torch.equal(got.images[0].pixels, pixels) and torch.equal(got.prompt_positions,
                                                                      positions)
    assert (got.request_id, got.position_offset, got.eos_token_ids) == ("r1", -4, (7, 8))
    assert got.images[0].encoder_meta == (1, 4, 6) and got.images[0].embeds is None
    # embedding rows from an encoder service, bfloat16 included (numpy has no such dtype)
    rows = torch.randn(6, 16).to(torch.bfloat16)
    msg.images = [ImageData("h", 3, 6, (1, 4, 6), torch.empty(0, dtype=torch.uint8), rows)]
    got = Decoder(ToCore).decode([bytearray(f) for f in Encoder().encode(msg)])
    assert got.images[0].embeds.dtype == torch.bfloat16
    assert torch.equal(got.images[0].embeds, rows)


def test_step_outputs_carry_logprobs_only_for_requests_that_asked() -> None:
    from types import SimpleNamespace

    from vlmserve.engine.messages import Decoder, Encoder, FromCore, StepOutputs

    def req(rid, output_logprobs=None, prompt_logprobs=None, ranks=None):
        return SimpleNamespace(request_id=rid, output_logprobs=output_logprobs,
                               prompt_logprobs=prompt_logprobs, prompt_logprob_ranks=ranks,
                               prompt_logprobs_sent=False)

    out = StepOutputs(["a", "b"], [5, 6], [None, "length"], 0.01, 2, 0)
    out.add_logprobs(req("a"))
    assert out.logprobs is None and out.prompt_logprobs is None
    plain = Encoder().encode(out)[0]
    b = req("b", [{1: -0.5}, {6: -0.25, 2: -3.0}], [None, {4: -1.5, 3: -0.5}], [None, 2])
    out.add_logprobs(b)
    got = Decoder(FromCore).decode(Encoder().encode(out))
    assert got.logprobs == {"b": {6: -0.25, 2: -3.0}}
    assert list(got.logprobs["b"]) == [6, 2]  # order kept: most likely first
    # the prompt's, once: with the request's first token
    assert got.prompt_logprobs == {"b": ([None, {4: -1.5, 3: -0.5}], [None, 2])}
    later = StepOutputs(["b"], [7], [None], 0.01, 1, 0)
    later.add_logprobs(b)
    assert later.prompt_logprobs is None
    assert Decoder(FromCore).decode([plain]).logprobs is None


def test_streamed_outputs_carry_logprobs(engine, vlmserve_cache: Path) -> None:
    """Each streamed output holds a logprobs dict per token so far, equal to the offline
    engine's for the same request (which tests/engine/test_logprobs.py checks against
    transformers); a request that did not ask, streamed alongside, gets None."""
    from vlmserve import LLM

    p = prompts(2)[1]
    asking = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, logprobs=3)

    async def run(params) -> list:
        return [out async for out in engine.generate(p, params)]

    async def both() -> list[list]:
        return await asyncio.gather(run(asking), run(greedy(6)))

    outs, plain = asyncio.run(both())
    assert all(o.outputs[0].logprobs is None for o in plain)
    # A reader that lags gets queued outputs merged, so count tokens, not outputs.
    sizes = [len(o.outputs[0].token_ids) for o in outs]
    assert sizes == sorted(set(sizes)) and sizes[-1] == 6
    for o in outs:
        c = o.outputs[0]
        assert len(c.logprobs) == len(c.token_ids)
        assert all(t in lps and len(lps) == 3 for t, lps in zip(c.token_ids, c.logprobs))
    offline = LLM(**OPTS).generate([p], asking, use_tqdm=False)[0].outputs[0]
    assert offline.token_ids == outs[-1].outputs[0].token_ids
    for ours, ref in zip(outs[-1].outputs[0].logprobs, offline.logprobs):
        assert list(ours) == list(ref)
        assert list(ours.values()) == pytest.approx(list(ref.values()), abs=1e-5)


def test_stop_strings_end_requests_in_the_front_end_and_free_them_in_the_core(
        engine, vlmserve_cache: Path) -> None:
    from vlmserve import LLM

    p = prompts(2)[1]
    full = LLM(**OPTS).generate(p, greedy(20), use_tqdm=False)[0].outputs[0].text
    stop = full[5:7]
    expected = full[: full.find(stop)]

    async def main() -> list:
        params = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True, stop=[stop])
        return [o async for o in engine.generate(p, params)]

    outs = asyncio.run(main())
    assert outs[-1].outputs[0].text == expected and outs[-1].outputs[0].finish_reason == "stop"
    s = wait_idle(engine)
    assert s["num_free_kv_blocks"] == s["num_kv_blocks"] and s["encoder_cache_referenced"] == 0


@pytest.mark.parametrize("how", ["cancel", "break", "aclose"])
def test_consumer_leaving_aborts_the_request(engine, how: str) -> None:
    finished: list[RequestTiming] = []
    engine.client.add_finish_callback(finished.append)
    p = prompts(2)[1]

    seen = asyncio.Event()

    async def consume() -> None:
        gen = engine.generate(p, greedy(400))
        async for out in gen:
            if len(out.outputs[0].token_ids) >= 3:  # (a reader behind skips outputs)
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
            s = await engine.get_stats()
            if s["num_running"] == s["num_streams"] == 0:
                break
            await asyncio.sleep(0.01)
        return s

    s = asyncio.run(main())
    engine.client._finish_callbacks.remove(finished.append)
    assert s["num_running"] == s["num_waiting"] == s["num_streams"] == 0
    assert s["num_free_kv_blocks"] == s["num_kv_blocks"] and s["encoder_cache_referenced"] == 0
    assert [t.finish_reason for t in finished] == ["abort"]
    assert 0 < len(finished[0].token_times) < 400


def test_timing(engine) -> None:
    finished: list[RequestTiming] = []
    engine.client.add_finish_callback(finished.append)

    async def main():
        stream = await engine.add_request("time me", greedy(6))
        return [o async for o in stream], stream.timing

    outs, timing = asyncio.run(main())
    engine.client._finish_callbacks.remove(finished.append)
    assert finished == [timing] and timing.finish_reason == "length"
    assert len(timing.token_times) == 6
    assert timing.num_prompt_tokens == len(outs[0].prompt_token_ids)
    assert 0 <= timing.ttft <= timing.e2e_latency
    assert 0 <= timing.frontend_time <= timing.ttft  # preprocessed, then handed over
    assert len(timing.inter_token_latencies) == 5 and min(timing.inter_token_latencies) >= 0


def test_the_core_dying_ends_every_stream_and_is_reported(vlmserve_cache: Path) -> None:
    import os
    import signal

    eng = AsyncLLM.from_kwargs(**OPTS)
    dead: list[BaseException] = []
    eng.client.add_dead_callback(dead.append)

    async def drain(stream) -> None:
        async for _ in stream:
            pass

    async def main() -> None:
        stream = await eng.add_request("hello", greedy(400))
        await stream.__anext__()
        os.kill(eng.core_pid, signal.SIGKILL)
        with pytest.raises(EngineDeadError, match="died"):  # a hang fails at the deadline
            await asyncio.wait_for(drain(stream), 60)
        with pytest.raises(EngineDeadError):
            await eng.add_request("again", greedy(2))

    try:
        asyncio.run(main())
        assert not eng.is_running and len(dead) == 1
        # a front end still starting when the core died registers late: told at once
        eng.client.add_dead_callback(dead.append)
        assert len(dead) == 2 and dead[1] is dead[0]
        with pytest.raises(EngineDeadError):  # a utility call fails, it does not wait
            asyncio.run(asyncio.wait_for(eng.get_stats(), 5))
    finally:
        eng.shutdown()
    eng2 = AsyncLLM.from_kwargs(**OPTS)
    core = eng2._proc
    eng2.shutdown()
    assert not eng2.is_running and core.exitcode == 0 and len(dead) == 2
    with pytest.raises(EngineDeadError):
        asyncio.run(eng2.add_request("x", greedy(2)))


@pytest.fixture(scope="module")
def pooled(vlmserve_cache: Path) -> Iterator[AsyncLLM]:
    """A front end with 2 preprocessing processes."""
    eng = AsyncLLM(EngineConfig.from_kwargs(**OPTS), preprocess_workers=2)
    yield eng
    eng.shutdown()


def _image_prompts(n: int) -> list[dict]:
    return [p for p in prompts(2 * n) if p["multi_modal_data"]["image"]]


async def _last_tokens(eng: AsyncLLM, prompt: dict, loader=None) -> list[int]:
    kw = {} if loader is None else {"image_loader": loader}
    stream = await eng.add_request(prompt, greedy(4), **kw)
    return [o.outputs[0].token_ids async for o in stream][-1]


def _answers(eng: AsyncLLM, ps: list[dict]) -> list[list[int]]:
    async def run() -> list:
        return await asyncio.gather(*(_last_tokens(eng, p) for p in ps))
    return asyncio.run(asyncio.wait_for(run(), 120))


def _live_pids(eng: AsyncLLM, n: int) -> set[int]:
    """The pool's processes, once `n` of them run (a dead one's replacement takes seconds
    to load the model's processor)."""
    deadline = time.monotonic() + 120  # bounds a broken test only
    while len(pids := eng._pool.pids()) < n:
        assert time.monotonic() < deadline, pids
        time.sleep(0.05)
    return set(pids)


def _started(folder: Path) -> set[int]:
    """Pids of the preprocessing processes a `GatedLoader` holds."""
    return {int(f.name.split("-")[1]) for f in folder.glob("started-*")}


def test_a_killed_preprocessing_process_is_replaced_and_its_requests_retried(
        pooled: AsyncLLM, tmp_path: Path) -> None:
    """SIGKILL of one of 2 preprocessing processes while 8 image requests are in its pool:
    the one it was running is retried, the others never notice; all 8 are answered as
    without the kill, a new process takes the dead one's place and the front end serves
    on."""
    import os
    import signal

    from tests.engine.helpers import GatedLoader

    ps = _image_prompts(8)
    want = _answers(pooled, ps)
    before = _live_pids(pooled, 2)

    async def burst() -> list:
        tasks = [asyncio.create_task(_last_tokens(pooled, p, GatedLoader(str(tmp_path))))
                 for p in ps]
        while len(_started(tmp_path)) < 2:  # both processes hold a request
            await asyncio.sleep(0.01)
        os.kill(min(_started(tmp_path)), signal.SIGKILL)
        (tmp_path / "gate").touch()
        return await asyncio.gather(*tasks, return_exceptions=True)

    got = asyncio.run(asyncio.wait_for(burst(), 120))
    assert got == want
    after = _live_pids(pooled, 2)
    assert min(_started(tmp_path)) not in after and after & before
    assert asyncio.run(_last_tokens(pooled, ps[0])) == want[0] and pooled.is_running


def test_a_request_that_kills_its_preprocessing_process_fails_alone(pooled: AsyncLLM
                                                                    ) -> None:
    """A request whose preprocessing kills its process is retried once, then fails with an
    error saying so; the requests beside it are answered and the front end serves on."""
    from tests.engine.helpers import KillingLoader

    ps = _image_prompts(4)
    want = _answers(pooled, ps)

    async def burst() -> list:
        return await asyncio.gather(_last_tokens(pooled, ps[0], KillingLoader()),
                                    *(_last_tokens(pooled, p) for p in ps[1:]),
                                    return_exceptions=True)

    got = asyncio.run(asyncio.wait_for(burst(), 120))
    assert isinstance(got[0], RuntimeError) and "died twice" in str(got[0]), got[0]
    assert got[1:] == want[1:]
    assert asyncio.run(_last_tokens(pooled, ps[0])) == want[0] and pooled.is_running
    assert len(_live_pids(pooled, 2)) == 2


def test_preprocessing_workers_run_torch_on_their_share_of_threads(
        vlmserve_cache: Path, monkeypatch) -> None:
    """A pool's processes are its parallelism: each runs torch on its share of the host's
    threads (a dozen processes with a thread per core each slowed the GPU engine core),
    unless the user set OMP_NUM_THREADS. (3: neither the tests' one thread nor this host's
    core count.)"""
    import torch

    threads = 3

    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    eng = AsyncLLM(EngineConfig.from_kwargs(**OPTS), preprocess_workers=1,
                   preprocess_threads=threads)
    try:
        assert eng._pool.submit(torch.get_num_threads).result(timeout=60) == threads
    finally:
        eng.shutdown()


def test_preprocess_threads_share_the_cores(monkeypatch) -> None:
    """One core for the engine core and one per front end; the rest shared by every front
    end's preprocessing processes; at least one each."""
    import os

    from vlmserve.entrypoints.args import ServerConfig
    from vlmserve.entrypoints.openai.launch import preprocess_threads

    monkeypatch.setattr(os, "sched_getaffinity", lambda _: set(range(16)))
    assert preprocess_threads(ServerConfig(api_server_count=4, preprocess_workers=2)) == 1
    assert preprocess_threads(ServerConfig(api_server_count=1, preprocess_workers=2)) == 7
    assert preprocess_threads(ServerConfig(api_server_count=8, preprocess_workers=4)) == 1


def test_a_consumer_behind_gets_the_delta_outputs_waiting_joined() -> None:
    """Delta outputs (what the server streams): a reader that fell behind gets those waiting
    as one (their texts, tokens and logprobs joined in order, the first's prompt logprobs
    kept); an error is never joined."""
    from vlmserve.frontend.streams import RequestStream
    from vlmserve.outputs import CompletionOutput, RequestOutput

    class Engine:
        def abort(self, rid: str) -> None:
            raise AssertionError("not aborted")

    def out(i: int, finished: bool = False) -> RequestOutput:
        return RequestOutput("r", None, [1], [CompletionOutput(
            0, f"t{i} ", [i], "length" if finished else None, [{i: -1.0}])], finished=finished)

    async def main() -> None:
        stream = RequestStream(Engine(), "r", asyncio.get_running_loop(),
                               RequestTiming(time.monotonic()), delta=True)
        stream._put(out(0))
        assert (await anext(stream)).outputs[0].token_ids == [0]
        for i in (1, 2, 3):
            stream._put(out(i))
        stream._put(EngineDeadError("gone"))
        c = (await anext(stream)).outputs[0]
        assert (c.text, c.token_ids, c.logprobs) == ("t1 t2 t3 ", [1, 2, 3],
                                                     [{1: -1.0}, {2: -1.0}, {3: -1.0}])
        with pytest.raises(EngineDeadError):
            await anext(stream)
        done = RequestStream(Engine(), "d", asyncio.get_running_loop(),
                             RequestTiming(time.monotonic()), delta=True)
        first = out(4)  # a request's first output carries its prompt's logprobs
        first.prompt_logprobs, first.prompt_logprob_ranks = [None, {7: -0.5}], [None, 1]
        done._put(first)
        done._put(out(5, finished=True))
        final = await anext(done)
        assert final.finished and final.outputs[0].token_ids == [4, 5] and done.finished
        assert (final.prompt_logprobs, final.prompt_logprob_ranks) == ([None, {7: -0.5}],
                                                                        [None, 1])

    asyncio.run(main())


def test_a_consumer_behind_takes_the_newest_output_and_never_skips_an_error() -> None:
    """Outputs are cumulative: a reader that fell behind gets the newest of those waiting
    (one chunk with all their tokens), but an error after them still arrives, after them."""
    from vlmserve.frontend.streams import RequestStream
    from vlmserve.outputs import CompletionOutput, RequestOutput

    class Engine:
        aborted: list[str] = []

        def abort(self, rid: str) -> None:
            self.aborted.append(rid)

    def out(n: int, finished: bool = False) -> RequestOutput:
        return RequestOutput("r", None, [1], [CompletionOutput(0, "x" * n, list(range(n)),
                                                               "length" if finished else None)],
                             finished=finished)

    async def main() -> None:
        loop = asyncio.get_running_loop()
        engine = Engine()
        stream = RequestStream(engine, "r", loop, RequestTiming(time.monotonic()))
        stream._put(out(1))
        assert len((await anext(stream)).outputs[0].token_ids) == 1  # kept up: each output
        for n in (2, 3, 4):
            stream._put(out(n))
        assert len((await anext(stream)).outputs[0].token_ids) == 4  # behind: the newest
        stream._put(out(5))
        stream._put(out(6))
        stream._put(EngineDeadError("gone"))
        assert len((await anext(stream)).outputs[0].token_ids) == 6
        with pytest.raises(EngineDeadError):
            await anext(stream)
        done = RequestStream(engine, "d", loop, RequestTiming(time.monotonic()))
        loop.call_later(0.01, done._put, out(3, finished=True))  # a reader that waits
        final = await anext(done)
        assert final.finished and done.finished
        with pytest.raises(StopAsyncIteration):
            await anext(done)
        assert engine.aborted == []

    asyncio.run(main())
