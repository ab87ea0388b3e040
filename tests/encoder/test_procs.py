"""Handles across a real process boundary (spawned consumers): 200 handles opened and
copied bit-for-bit, nothing left on either side; a consumer killed before releasing has its
handles reclaimed within the lease; a second process opening a handle is recorded."""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import time
from queue import Empty

import pytest
import torch

from tests.encoder import consumer
from tests.encoder.helpers import segments, wait_until
from tests.engine.helpers import make_image
from vlmserve.encoder.encoder import MultimodalEncoder
from vlmserve.encoder.ledger import HandleLedger

SPAWN = mp.get_context("spawn")


def _prompt(images) -> dict:
    pads = "<|vision_start|><|image_pad|><|vision_end|>" * len(images)
    return {"prompt": f"<|im_start|>user\n{pads}Describe.<|im_end|>\n<|im_start|>assistant\n",
            "multi_modal_data": {"image": images}}


def _get(queue, proc, timeout_s: float = 120.0):
    """The next answer of ``proc``; fails at once if it died."""
    end = time.monotonic() + timeout_s
    while True:
        try:
            return queue.get(timeout=0.2)
        except Empty:
            assert proc.is_alive(), f"the consumer died (exit code {proc.exitcode})"
            assert time.monotonic() < end, "the consumer did not answer"


def _stop(proc) -> None:
    if proc.is_alive():
        proc.kill()
    proc.join(10)


def test_200_handles_across_processes(vlmserve_cache):
    """50 requests of 4 images (some repeated): 200 shared-memory handles, one tower forward;
    a spawned consumer opens them all and copies the rows (bit-for-bit the encoder's); then
    the live-handle count is 0 on both sides and no segment is left. A handle the producer's
    own process already opened is refused in the consumer and recorded as a double open."""
    with MultimodalEncoder("tiny-qwen2-vl", dtype="float32", device="cpu") as enc:
        prefix = enc.ledger.segment_prefix()
        sizes = [(56, 56), (84, 56), (56, 112), (112, 84)]
        prompts = [_prompt([make_image(*sizes[j], seed=(i * 4 + j) % 37) for j in range(4)])
                   for i in range(50)]
        outputs = enc.encode(prompts)
        assert enc.get_stats().batches == 1
        expected = {img.handle.handle_id: img.mm_hash for o in outputs for img in o.images}
        assert len(expected) == 200 and len(segments(prefix)) == 200
        # the reference rows: the same batch again, as bytes handles opened here
        reference = {img.mm_hash: consumer.digest(img.handle.open())
                     for o in enc.encode(prompts, transport="bytes") for img in o.images}
        first, *others = enc.encode(prompts[:1])[0].images
        twice = first.handle
        twice.open()
        for img in others:
            img.handle.release()
        assert wait_until(lambda: enc.ledger.record(twice.handle_id) is None, 5)

        inbox, outbox = SPAWN.Queue(), SPAWN.Queue()
        proc = SPAWN.Process(target=consumer.open_all, args=(inbox, outbox))
        proc.start()
        try:
            inbox.put((outputs, [twice]))
            results, consumer_stats = _get(outbox, proc)
        finally:
            _stop(proc)
        assert results.pop(twice.handle_id) == "HandleExpiredError"
        assert {h: reference[expected[h]] for h in expected} == results
        assert (consumer_stats.opened, consumer_stats.released, consumer_stats.live,
                consumer_stats.failed) == (201, 201, 0, 1)
        assert wait_until(lambda: enc.get_stats().ledger.live_handles == 0, 10), (
            enc.get_stats(), list(enc.ledger.errors)[:5])
        s = enc.get_stats().ledger
        assert (s.exported, s.released, s.reclaimed, s.live_bytes) == (404, 404, 0, 0)
        assert s.double_opens == 1 and any(twice.handle_id in e for e in enc.ledger.errors)
        assert s.unknown_messages == 1  # the second process's release of it
        assert segments(prefix) == []


def test_killed_consumer_handles_reclaimed_at_their_lease():
    """A consumer copies 10 of 20 handles, announces and maps the other 10 (copies in
    progress) and is killed (SIGKILL): those 10 stay until their lease (from the open) and
    the grace run out, then are reclaimed, their segments unlinked. The ledger's clock is
    given explicitly (`reclaim_expired(now)`; its thread never reaches the 600 s lease)."""
    lease, grace = 600.0, 0.1
    inbox, outbox = SPAWN.Queue(), SPAWN.Queue()
    proc = SPAWN.Process(target=consumer.open_some_then_hang, args=(inbox, outbox, 10))
    proc.start()
    try:
        assert _get(outbox, proc) == "started"
        with HandleLedger(lease_s=lease, grace_s=grace) as ledger:
            prefix = ledger.segment_prefix()
            handles = [ledger.export(torch.full((9, 32), float(i))) for i in range(20)]
            inbox.put(handles)
            assert _get(outbox, proc) == "ready"
            assert wait_until(lambda: ledger.stats().opened == 20)
            assert wait_until(lambda: ledger.stats().released == 10)
            os.kill(proc.pid, signal.SIGKILL)
            proc.join(10)
            s = ledger.stats()
            assert (s.live_handles, s.released) == (10, 10)
            assert len(segments(prefix)) == 10
            recs = [r for r in map(ledger.record, (h.handle_id for h in handles)) if r]
            assert len(recs) == 10 and all(r.deadline == r.opened_at + lease for r in recs)
            ends = [r.deadline + grace for r in recs]
            assert ledger.reclaim_expired(now=min(ends)) == 0  # a dead consumer: kept still
            assert ledger.stats().live_handles == 10
            assert ledger.reclaim_expired(now=max(ends) + 1e-3) == 10
            s = ledger.stats()
            assert (s.live_handles, s.reclaimed, s.live_bytes, s.exported) == (0, 10, 0, 20)
            assert segments(prefix) == []
    finally:
        _stop(proc)


@pytest.mark.skipif(not hasattr(signal, "SIGKILL"), reason="POSIX only")
def test_segments_of_a_closed_encoder_are_gone(vlmserve_cache):
    """Handles nobody opened are reclaimed when the encoder shuts down."""
    enc = MultimodalEncoder("tiny-qwen2-vl", dtype="float32", device="cpu", lease_s=60)
    prefix = enc.ledger.segment_prefix()
    enc.encode([_prompt([make_image(56, 56, 0)])] * 3)
    assert len(segments(prefix)) == 3
    enc.shutdown()
    assert segments(prefix) == [] and enc.get_stats().ledger.reclaimed == 3
