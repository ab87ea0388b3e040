"""Offloaded image embeddings held once per host under tensor parallelism: the host's leader
holds the host rows, the other ranks of its host none, and they receive each step's rows from
it; greedy output stays that of one process. Real ranks over gloo on the CPU."""

from __future__ import annotations

import multiprocessing as mp
import os
import socket

import pytest
import torch

from tests.distributed.helpers import one_process
from vlmserve import LLM, SamplingParams


def test_tp2_offload_holds_host_rows_once_and_matches_one_process(vlmserve_cache):
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    # chunks of 23 tokens cut through images: later chunks read their rows back from the host
    kw = dict(dtype="float32", device="cpu", max_num_batched_tokens=23, max_num_seqs=4,
              mm_embedding_offload=True, mm_cache_gb=0.01)
    single, prompts, expected = one_process("tiny-qwen2-vl", params, **kw)
    tp = LLM("tiny-qwen2-vl", tensor_parallel_size=2, **kw)
    try:
        ex = tp.engine.executor
        leader, other = ex.rank_load_stats
        assert leader.host_cache_bytes == single.engine.executor.load_stats.host_cache_bytes > 0
        assert other.host_cache_bytes == 0
        outs = tp.generate(prompts, params, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outs] == expected
        store = ex.runner.store
        assert store.holds_rows and store.share is not None
        # rows did come back from the leader's host rows, not only fresh from the encoder
        assert store.stats.prefetch_hit_rows + store.stats.prefetch_miss_rows > 0
    finally:
        tp.engine.shutdown()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank(rank: int, world: int, port: int, node: int, out) -> None:
    os.environ["GROUP_RANK"] = str(node)  # as torchrun sets it on each node
    from vlmserve.distributed.parallel_state import init_tensor_parallel

    tp = init_tensor_parallel(rank, world, f"tcp://127.0.0.1:{port}", torch.device("cpu"), 60)
    x = torch.full((3,), float(rank))
    tp.broadcast_in_host(x)
    out.put((rank, tp.host_leader, tp.is_host_leader, x.tolist()))
    out.close()
    out.join_thread()  # sent before the exit below, which skips the queue's own flush
    tp.barrier()
    # results are out: leave without the interpreter's teardown, where gloo's threads now and
    # then aborted a rank whose peer had gone first ("terminate called without an active
    # exception"; the engine's own ranks are daemons that rank 0 outlives)
    os._exit(0)


@pytest.mark.parametrize("nodes", [[0, 0, 1, 1], [0, 1, 1, 1]])
def test_host_groups_follow_torchrun_nodes(nodes):
    """Four ranks on two "hosts" (torchrun's GROUP_RANK): each host has its own leader, the
    lowest rank there, and a broadcast within a host reaches only that host's ranks."""
    ctx = mp.get_context("spawn")
    out, port = ctx.Queue(), _free_port()
    procs = [ctx.Process(target=_rank, args=(r, 4, port, n, out)) for r, n in enumerate(nodes)]
    for p in procs:
        p.start()
    got = sorted(out.get(timeout=60) for _ in procs)
    for p in procs:
        p.join(30)
        assert p.exitcode == 0
    for rank, leader, is_leader, x in got:
        assert leader == nodes.index(nodes[rank]) and is_leader == (rank == leader)
        assert x == [float(leader)] * 3
