"""Multi-host launch on one machine: two torchrun processes (`--nnodes 2 --nproc-per-node 1`,
one per "host", rendezvous at 127.0.0.1), each `-m vlmserve serve ... --tensor-parallel-size
2`; rank 0 serves HTTP, rank 1 runs the worker loop."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import openai
import pytest

from tests import procs
from tests.e2e.test_server import greedy, user
from tests.e2e.test_server_procs import FLAGS, MODEL, _free_port, wait_healthy
from vlmserve import LLM


class TwoHosts:
    """Node ranks 0 and 1 of one torchrun job, each its own torchrun process and session."""

    def __init__(self, log_dir: Path, *extra: str) -> None:
        master, self.port = _free_port(), _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.nodes = []
        for node in range(2):
            log = open(log_dir / f"node{node}.log", "wb")  # noqa: SIM115 - closed with the test
            self.nodes.append(procs.start(
                [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2",
                 "--nproc-per-node", "1", "--node-rank", str(node), "--master-addr",
                 "127.0.0.1", "--master-port", str(master), "-m", "vlmserve", "serve", MODEL,
                 "--port", str(self.port), "--tensor-parallel-size", "2", *FLAGS, *extra],
                stdout=log, stderr=subprocess.STDOUT))
        try:
            wait_healthy(self.url, self.nodes)
        except BaseException:
            self.kill()
            raise

    def worker(self, node: int) -> int:
        """The pid of node `node`'s rank (torchrun's one child there)."""
        pid = self.nodes[node].pid
        children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
        assert len(children) == 1, children
        return int(children[0])

    def wait(self, timeout: float) -> list[int | None]:
        deadline = time.monotonic() + timeout
        for n in self.nodes:
            try:
                n.wait(max(deadline - time.monotonic(), 0.01))
            except subprocess.TimeoutExpired:
                pass
        return [n.poll() for n in self.nodes]

    def kill(self) -> None:
        for n in self.nodes:
            procs.kill_group(n)


@pytest.fixture
def two_hosts(vlmserve_cache: Path, tmp_path: Path):
    jobs: list[TwoHosts] = []

    def start(*extra: str) -> TwoHosts:
        jobs.append(TwoHosts(tmp_path, *extra))
        return jobs[-1]

    yield start
    for job in jobs:
        job.kill()


def test_two_hosts_answer_like_one_process_and_stop_on_sigterm(two_hosts) -> None:
    """A chat request through the OpenAI API: the same text as one process (the TP=1 engine,
    which the server tests show answers as a TP=1 server does); SIGTERM to rank 0 (the
    server) stops both hosts' ranks and both torchrun processes exit 0."""
    messages = user("Tell me about the two hosts.")
    llm = LLM(MODEL, dtype="float32", device="cpu", max_model_len=1024,
              max_num_batched_tokens=256)
    expected = llm.chat(messages, greedy(16), use_tqdm=False)[0].outputs[0].text
    job = two_hosts()

    async def ask() -> str:
        async with openai.AsyncOpenAI(base_url=job.url + "/v1", api_key="none",
                                      max_retries=0) as client:
            r = await client.chat.completions.create(
                model=MODEL, messages=messages, max_tokens=16, temperature=0,
                extra_body={"ignore_eos": True})
            return r.choices[0].message.content

    assert asyncio.run(ask()) == expected
    os.kill(job.worker(0), signal.SIGTERM)
    assert job.wait(30) == [0, 0]


def test_a_killed_rank_on_the_other_host_fails_the_stream_and_rank0_exits(two_hosts) -> None:
    """Rank 1 (the second host's) SIGKILLed mid-stream: the stream ends with an error and the
    server (and its torchrun) exits non-zero on its own."""
    job = two_hosts("--tp-timeout", "20")
    events: list = []

    async def main() -> BaseException | None:
        async with openai.AsyncOpenAI(base_url=job.url + "/v1", api_key="none",
                                      max_retries=0) as client:
            stream = await client.chat.completions.create(
                model=MODEL, messages=user("Talk."), max_tokens=900, temperature=0,
                stream=True, extra_body={"ignore_eos": True})
            try:
                async for chunk in stream:
                    events.append(chunk)
                    if len(events) == 3:
                        os.kill(job.worker(1), signal.SIGKILL)
            except openai.APIError as e:
                return e
        return None

    assert isinstance(asyncio.run(main()), openai.APIError)
    assert len(events) < 900
    assert job.wait(60)[0] not in (None, 0)  # exits on its own (the deadline: a hang)
