"""`vlmserve serve --data-parallel-size 2` on the CPU: two engine cores behind one front end,
requests routed by cache affinity (core/dp_routing.py, frontend/dp_client.py)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from tests.e2e.chat_workload import conversations, run_chats
from tests.e2e.test_server import data_url, user
from tests.e2e.test_server_procs import MODEL, ServeProc, _stream
from tests.engine.helpers import make_image
from tests.wait import exited, wait_until

pytestmark = pytest.mark.slow

# 16 chats of 3 images (about 490 tokens, 31 blocks a prompt; 35 with four turns): one core of
# 640 KV blocks holds them all, and so do two cores of 320 each when each keeps its own half
# (affinity); a core that sees every chat (random routing) cannot keep them
CHATS, TURNS, BLOCKS = 16, 4, 320


@pytest.fixture(scope="module")
def single(vlmserve_cache: Path) -> Iterator[ServeProc]:
    srv = ServeProc("--num-kv-blocks", str(2 * BLOCKS))
    yield srv
    srv.kill()


@pytest.fixture(scope="module")
def affine(vlmserve_cache: Path) -> Iterator[ServeProc]:
    srv = ServeProc("-dp", "2", "--num-kv-blocks", str(BLOCKS))
    yield srv
    srv.kill()


def _chats() -> list[list[dict]]:
    return [user(f"Request {i}: what is this?" + " more" * (i % 3),
                 *(data_url(make_image(56 + 28 * (i % 3), 84, 11 * i + j)) for j in range(i % 3)))
            for i in range(8)]


async def _answers(srv: ServeProc, chats: list[list[dict]]) -> list[str]:
    async with srv.client() as client:
        return await asyncio.gather(*(_stream(client, m, 12) for m in chats))


def test_two_cores_answer_as_one(single: ServeProc, affine: ServeProc) -> None:
    chats = _chats()
    assert asyncio.run(_answers(affine, chats)) == asyncio.run(_answers(single, chats))
    s = affine.stats()
    assert s["data_parallel_size"] == 2 and len(s["cores"]) == 2
    # both cores computed, and the totals are their sums
    assert all(c["alive"] and c["num_generated_tokens"] > 0 for c in s["cores"])
    assert s["num_generated_tokens"] == sum(c["num_generated_tokens"] for c in s["cores"])
    assert s["num_kv_blocks"] == 2 * BLOCKS
    assert len({c["pid"] for c in s["cores"]}) == 2
    metrics = httpx.get(affine.url + "/metrics").text
    for core in ("0", "1"):
        assert f'vlmserve_core_alive{{core="{core}"}} 1.0' in metrics
    assert 'vlmserve_dp_routed_requests{core="1",reason="balance"}' in metrics


def _hit_rate(srv: ServeProc) -> float:
    assert wait_until(lambda: srv.stats()["num_running"] == 0)
    httpx.post(srv.url + "/reset_prefix_cache").raise_for_status()
    return asyncio.run(run_chats(srv.url, MODEL, conversations(CHATS, size=336), TURNS,
                                 srv.stats))


def test_affinity_keeps_a_chats_prefix_hits(single: ServeProc, affine: ServeProc,
                                            vlmserve_cache: Path) -> None:
    one = _hit_rate(single)
    before = affine.stats()["routing"]["replicas"]
    two = _hit_rate(affine)
    routing = [{k: after[k] - was[k] for k in ("affinity", "balance", "busy")}
               for was, after in zip(before, affine.stats()["routing"]["replicas"],
                                     strict=True)]
    affine.kill()  # the machine has 2 cores: one two-core server at a time
    randomly = ServeProc("-dp", "2", "--num-kv-blocks", str(BLOCKS),
                         "--dp-routing", "random")
    try:
        rand = _hit_rate(randomly)
    finally:
        randomly.kill()
    print(f"prefix hit rate of turns 2-{TURNS}: one core {one:.1%}, two cores by affinity "
          f"{two:.1%}, randomly {rand:.1%}; routing {routing}")
    assert one > 0.8  # the workload is one where prefixes matter
    assert two > one - 0.10
    assert two > rand + 0.40
    # every follow-up turn went where its chat's prefix was; first turns spread by cache room
    # (half each, however fast each core answers)
    assert sum(r["affinity"] for r in routing) == CHATS * (TURNS - 1)
    assert [r["balance"] for r in routing] == [CHATS // 2] * 2


def test_a_dead_core_fails_only_its_requests(vlmserve_cache: Path) -> None:
    # 16,000 tokens a stream: far more than a core makes before the kill
    srv = ServeProc("-dp", "2", "--max-model-len", "16384")
    try:
        events: list[list] = [[] for _ in range(4)]

        async def main() -> tuple[list, list[int]]:
            # a client (its own connection pool) a stream: in one pool a stream's socket was
            # once closed on the client's side before its first event (anyio's
            # ClosedResourceError), a client's matter that this test is not about
            clients = [srv.client() for _ in range(4)]
            async with contextlib.AsyncExitStack() as stack:
                for c in clients:
                    await stack.enter_async_context(c)
                tasks = []
                for i in range(4):  # distinct prompts (beyond the system prompt): two a core
                    prompt = f"Stream {i}: " + " ".join(f"word{i}x{j}" for j in range(30))
                    tasks.append(asyncio.create_task(
                        _stream(clients[i], user(prompt), 16000, events[i])))
                    while not events[i]:  # routed and begun before the next is sent
                        if tasks[i].done():  # it failed before its first event: say why
                            raise AssertionError(f"stream {i}: {tasks[i].exception()!r}")
                        await asyncio.sleep(0.01)
                cores = srv.stats()["cores"]
                assert [c["num_streams"] for c in cores] == [2, 2]
                os.kill(cores[1]["pid"], signal.SIGKILL)
                # the deadline only turns streams that are never told into a failure
                failed = await asyncio.wait_for(_first_two_done(tasks), 60)
                alive = [i for i, t in enumerate(tasks) if not t.done()]
                assert len(alive) == 2
                counts = [len(e) for e in events]

                async def progress() -> None:  # the other core's streams go on
                    while not all(len(events[i]) > counts[i] + 20 for i in alive):
                        assert not any(tasks[i].done() for i in alive)
                        await asyncio.sleep(0.01)

                await asyncio.wait_for(progress(), 60)
                for t in tasks:
                    t.cancel()
                await asyncio.gather(*tasks, return_exceptions=True)
                return failed, alive

        failed, alive = asyncio.run(main())
        assert all(isinstance(r, openai.APIError) and "engine core" in str(r) for r in failed)
        assert sorted(alive) == [0, 2]  # balanced in turn: streams 1 and 3 were on core 1
        assert httpx.get(srv.url + "/health").status_code == 200
        s = srv.stats()
        assert [c["alive"] for c in s["cores"]] == [True, False]
        # new requests go to the live core and are served
        answers = asyncio.run(_answers(srv, _chats()[:4]))
        assert all(answers)
        assert srv.stats()["routing"]["replicas"][1]["alive"] is False
        assert srv.proc.poll() is None
    finally:
        srv.kill()
    assert wait_until(lambda: exited(srv.proc.pid))


async def _first_two_done(tasks: list[asyncio.Task]) -> list:
    """The results (or errors) of the first two tasks to end."""
    done: list = []
    pending = set(tasks)
    while len(done) < 2:
        finished, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
        for t in finished:
            done.append(t.exception() or t.result())
    return done
