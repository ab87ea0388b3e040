"""CUDA IPC handles between two real processes on one GPU: rows copied bit-for-bit, the
producer's GPU memory back to where it was after the releases; a consumer killed while it
holds mapped handles, and handles nobody opens, are reclaimed at the lease and their blocks
freed (PyTorch's IPC ref counters settled by the producer). Pooled handles (the default):
slots reused round after round, pool memory flat, each block mapped once by the consumer."""

from __future__ import annotations

import multiprocessing as mp
import os
import signal

import pytest
import torch

from tests.encoder import consumer
from tests.encoder.helpers import wait_until
from tests.encoder.test_procs import _get, _stop
from vlmserve.encoder.ledger import HandleLedger
from vlmserve.transfer.handles import CudaIpcHandle

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
SPAWN = mp.get_context("spawn")


def _settled(ledger: HandleLedger, baseline: int, timeout_s: float) -> bool:
    return wait_until(lambda: ledger.stats().live_handles == 0
                      and torch.cuda.memory_allocated() == baseline, timeout_s)


def _rows(i: int) -> torch.Tensor:
    g = torch.Generator(device="cuda").manual_seed(i)
    return torch.randn(1280, 1536, generator=g, device="cuda").to(torch.bfloat16)


def test_cuda_handles_opened_in_another_process():
    inbox, outbox = SPAWN.Queue(), SPAWN.Queue()
    proc = SPAWN.Process(target=consumer.open_cuda, args=(inbox, outbox))
    proc.start()
    try:
        assert _get(outbox, proc) == "started"
        with HandleLedger(lease_s=60, cuda_pool=False) as ledger:
            torch.cuda.synchronize()
            baseline = torch.cuda.memory_allocated()
            sources = [_rows(i) for i in range(8)]
            want = [consumer.digest(r.cpu()) for r in sources]
            handles = [ledger.export(r) for r in sources]
            assert all(isinstance(h, CudaIpcHandle) for h in handles)
            del sources
            torch.cuda.synchronize()
            held = torch.cuda.memory_allocated() - baseline
            assert held >= 8 * 1280 * 1536 * 2 and ledger.stats().live_bytes == held
            inbox.put(handles)
            results, stats = _get(outbox, proc)
            assert [results[h.handle_id] for h in handles] == want
            assert (stats.opened, stats.released, stats.live) == (8, 8, 0)
            assert _settled(ledger, baseline, 10), (ledger.stats(),
                                                    torch.cuda.memory_allocated() - baseline)
            s = ledger.stats()
            assert (s.released, s.reclaimed, s.double_opens) == (8, 0, 0)
    finally:
        _stop(proc)


def test_killed_consumer_and_unopened_handles_freed_at_lease():
    """4 handles to a consumer that copies 2 and maps 2 (without releasing) before it is
    killed, 2 handles sent nowhere: after the lease all 6 blocks are freed."""
    inbox, outbox = SPAWN.Queue(), SPAWN.Queue()
    proc = SPAWN.Process(target=consumer.open_cuda, args=(inbox, outbox, 2))
    proc.start()
    try:
        assert _get(outbox, proc) == "started"
        with HandleLedger(lease_s=2.0, grace_s=0.1, cuda_pool=False) as ledger:
            torch.cuda.synchronize()
            baseline = torch.cuda.memory_allocated()
            handles = [ledger.export(_rows(i)) for i in range(6)]
            torch.cuda.synchronize()
            assert torch.cuda.memory_allocated() > baseline
            inbox.put(handles[:4])
            ready, results = _get(outbox, proc)
            assert ready == "ready" and len(results) == 2
            assert wait_until(lambda: ledger.stats().opened == 4, 5)
            os.kill(proc.pid, signal.SIGKILL)
            proc.join(10)
            assert ledger.stats().live_handles == 4  # 2 mapped by the dead, 2 never sent
            assert _settled(ledger, baseline, 5), (ledger.stats(), list(ledger.errors),
                                                   torch.cuda.memory_allocated() - baseline)
            s = ledger.stats()
            assert (s.released, s.reclaimed, s.free_errors) == (2, 4, 0)
    finally:
        _stop(proc)


def test_encoder_on_cuda_exports_ipc_handles(vlmserve_cache):
    from tests.engine.helpers import make_image
    from vlmserve.encoder.encoder import MultimodalEncoder

    prompt = {"prompt": "<|vision_start|><|image_pad|><|vision_end|>Hi.",
              "multi_modal_data": {"image": [make_image(112, 84, 0)]}}
    inbox, outbox = SPAWN.Queue(), SPAWN.Queue()
    proc = SPAWN.Process(target=consumer.open_cuda, args=(inbox, outbox))
    proc.start()
    try:
        assert _get(outbox, proc) == "started"
        with MultimodalEncoder("tiny-qwen2-vl", dtype="float32", device="cuda") as enc:
            img, = enc.encode([prompt])[0].images
            ref, = enc.encode([prompt], transport="bytes")[0].images
            assert isinstance(img.handle, CudaIpcHandle)
            inbox.put([img.handle])
            results, _ = _get(outbox, proc)
            assert results[img.handle.handle_id] == consumer.digest(ref.handle.open())
            assert wait_until(lambda: enc.get_stats().ledger.live_handles == 0, 10)
    finally:
        _stop(proc)


def test_pooled_handles_reuse_slots_and_each_block_is_mapped_once():
    inbox, outbox = SPAWN.Queue(), SPAWN.Queue()
    proc = SPAWN.Process(target=consumer.open_cuda_rounds, args=(inbox, outbox))
    proc.start()
    try:
        assert _get(outbox, proc) == "started"
        with HandleLedger(lease_s=60) as ledger:
            pool_sizes, mapped = [], []
            for round_ in range(8):
                sources = [_rows(round_ * 8 + i) for i in range(8)]
                want = [consumer.digest(r.cpu()) for r in sources]
                handles = [ledger.export(r) for r in sources]
                assert all(h.block_offset is not None for h in handles)
                inbox.put(handles)
                results, n_mapped = _get(outbox, proc)
                assert [results[h.handle_id] for h in handles] == want
                assert wait_until(lambda: ledger.stats().live_handles == 0, 10)
                pool_sizes.append(ledger.stats().cuda_pool_bytes)
                mapped.append(n_mapped)
            # 8 live at most (4 MiB slots): one 64 MiB block, made once, mapped once
            assert pool_sizes == [64 << 20] * 8 and mapped == [1] * 8
            s = ledger.stats()
            assert (s.exported, s.released, s.reclaimed, s.double_opens) == (64, 64, 0, 0)
            inbox.put(None)
            assert _get(outbox, proc) == "done"
    finally:
        _stop(proc)
