"""Embedding handles and the ledgers in one process: round trips, release, a second open
refused, a handle never opened reclaimed at its lease."""

from __future__ import annotations

import os
import pickle

import pytest
import torch

from tests.encoder.helpers import segments, wait_until
from vlmserve.encoder.ledger import HandleLedger
from vlmserve.transfer.consumer_ledger import ConsumerLedger
from vlmserve.transfer.handles import BytesHandle, HandleExpiredError, HandleOpenedTwiceError


@pytest.fixture
def ledger():
    with HandleLedger(lease_s=30.0) as led:
        yield led


def rows(n: int = 7, hidden: int = 16, dtype=torch.float32, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, hidden, generator=g).to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_bytes_handle_round_trip(ledger, dtype):
    x = rows(dtype=dtype)
    h = pickle.loads(pickle.dumps(ledger.export(x, transport="bytes")))
    assert isinstance(h, BytesHandle)
    assert (h.shape, h.dtype, h.nbytes) == ((7, 16), str(dtype)[6:], x.nbytes)
    assert h.data[:8] != b"\0" * 8 and not segments(ledger.segment_prefix())
    consumer = ConsumerLedger()
    assert torch.equal(h.open(ledger=consumer), x)
    assert wait_until(lambda: ledger.stats().released == 1, 5)
    s = ledger.stats()
    assert (s.live_handles, s.exported, s.opened, s.live_bytes) == (0, 1, 1, 0)
    c = consumer.stats()
    assert (c.opened, c.released, c.live, c.copied_bytes) == (1, 1, 0, x.nbytes)
    consumer.close()


def test_shm_handle_round_trip_and_second_open_refused(ledger):
    x = rows()
    h = ledger.export(x)
    assert h.kind == "shm" and segments(ledger.segment_prefix()) == [h.segment]
    assert ledger.stats().live_bytes == x.nbytes
    consumer = ConsumerLedger()
    with pytest.raises(ValueError):  # wrong destination: refused before anything happens
        h.copy_into(torch.empty(7, 15), ledger=consumer)
    dst = torch.full((7, 16), float("nan"))
    assert h.copy_into(dst, ledger=consumer) is dst and torch.equal(dst, x)
    with pytest.raises(HandleOpenedTwiceError):
        h.open(ledger=consumer)
    with pytest.raises(HandleOpenedTwiceError):
        h.release(ledger=consumer)
    assert wait_until(lambda: ledger.stats().live_handles == 0, 5)
    assert not segments(ledger.segment_prefix())
    c, s = consumer.stats(), ledger.stats()
    assert (c.opened, c.released, c.refused) == (1, 1, 2)
    assert (s.opened, s.released, s.reclaimed, s.double_opens) == (1, 1, 0, 0)
    consumer.close()


def test_release_unread_frees_at_once(ledger):
    handles = [ledger.export(rows(seed=i)) for i in range(3)]
    consumer = ConsumerLedger()
    for h in handles:
        h.release(ledger=consumer)
    assert wait_until(lambda: ledger.stats().live_handles == 0, 5)
    assert not segments(ledger.segment_prefix())
    assert consumer.stats().discarded == 3 and ledger.stats().released == 3
    consumer.close()


def test_handle_never_opened_is_kept_through_its_lease_and_grace_then_freed():
    """The ledger's clock given explicitly (`reclaim_expired(now)`; its thread's own clock
    never reaches a 600 s lease here): kept up to the lease plus the grace, freed after."""
    with HandleLedger(lease_s=600.0, grace_s=0.1) as ledger:
        h = ledger.export(rows())
        kept = ledger.export(rows(seed=1), transport="bytes")
        assert segments(ledger.segment_prefix()) == [h.segment]
        recs = [ledger.record(x.handle_id) for x in (h, kept)]
        assert all(r.deadline == r.exported_at + 600.0 for r in recs)
        ends = [r.deadline + ledger.grace_s for r in recs]
        assert ledger.reclaim_expired(now=min(ends)) == 0  # lease and grace not yet over
        assert ledger.stats().live_handles == 2
        assert segments(ledger.segment_prefix()) == [h.segment]
        assert ledger.reclaim_expired(now=max(ends) + 1e-3) == 2
        s = ledger.stats()
        assert (s.live_handles, s.reclaimed, s.released, s.live_bytes) == (0, 2, 0, 0)
        assert not segments(ledger.segment_prefix())


def test_handle_never_opened_is_reclaimed_at_its_lease():
    """The ledger's thread reclaims at the lease; a consumer that comes later is refused and
    the producer hears of it."""
    with HandleLedger(lease_s=0.5, grace_s=0.1) as ledger:
        h = ledger.export(rows())
        kept = ledger.export(rows(seed=1), transport="bytes")
        assert wait_until(lambda: ledger.stats().live_handles == 0)
        assert not segments(ledger.segment_prefix())
        s = ledger.stats()
        assert (s.reclaimed, s.released, s.live_bytes) == (2, 0, 0)
        consumer = ConsumerLedger()
        with pytest.raises(HandleExpiredError):  # too late: refused, the producer told
            h.open(ledger=consumer)
        assert wait_until(lambda: ledger.stats().late_releases == 1)
        assert ledger.stats().late_opens == 1
        assert consumer.stats().failed == 1
        with pytest.raises(HandleExpiredError):
            kept.open(ledger=consumer)
        consumer.close()


def test_expired_segment_gone_is_an_error_not_garbage():
    """A consumer that gets past the expiry check just before the producer unlinks finds no
    segment: an error, never other rows."""
    with HandleLedger(lease_s=30.0) as ledger:
        h = ledger.export(rows())
        ledger.reclaim_expired(now=float("inf"))
        assert not segments(ledger.segment_prefix())
        consumer = ConsumerLedger()
        with pytest.raises(HandleExpiredError, match="is gone"):
            h.open(ledger=consumer)
        consumer.close()


def test_polled_ledger_without_thread():
    with HandleLedger(lease_s=30.0, background=False) as ledger:
        x = rows()
        h = ledger.export(x)
        consumer = ConsumerLedger()
        assert torch.equal(h.open(ledger=consumer), x)
        assert ledger.record(h.handle_id) is not None  # nobody read the messages yet
        assert wait_until(lambda: ledger.poll(0.05) >= 0 and ledger.record(h.handle_id)
                          is None, 5)
        assert ledger.stats().released == 1 and not segments(ledger.segment_prefix())
        consumer.close()


def test_close_reclaims_everything():
    ledger = HandleLedger(lease_s=30.0)
    prefix = ledger.segment_prefix()
    for i in range(5):
        ledger.export(rows(seed=i))
    assert len(segments(prefix)) == 5
    sock = ledger.address.removeprefix("ipc://")
    assert os.path.exists(sock)
    ledger.close()
    assert not segments(prefix) and not os.path.exists(sock)
    s = ledger.stats()
    assert (s.live_handles, s.reclaimed) == (0, 5)
    with pytest.raises(RuntimeError):
        ledger.export(rows())


def test_a_handle_is_checked_before_its_rows_take_memory(monkeypatch, tmp_path):
    """A 1 KB bytes handle declaring 2,000,000 rows (or holding one row to broadcast), or a
    shared-memory segment smaller than declared, is refused before `open` allocates the
    declared rows."""
    import time
    from multiprocessing.shared_memory import SharedMemory

    from safetensors.torch import save

    from vlmserve.transfer.consumer_ledger import ConsumerLedger
    from vlmserve.transfer.handles import HandleError, ShmHandle

    allocated = []
    real = torch.empty
    monkeypatch.setattr(torch, "empty", lambda *a, **k: allocated.append(a) or real(*a, **k))
    later = time.time() + 60
    one_row = save({"rows": torch.zeros(1, 64)})
    seen = ConsumerLedger()
    for shape in [(2_000_000, 64), (6, 64)]:
        with pytest.raises(HandleError, match="shape"):
            BytesHandle(f"c-{shape[0]}", shape, "float32", None, later, data=one_row).open(
                ledger=seen)
    with pytest.raises(HandleError, match="not safetensors"):
        BytesHandle("c-x", (6, 64), "float32", None, later, data=b"\xff" * 64).open(ledger=seen)
    shm = SharedMemory(create=True, size=64)
    try:
        with pytest.raises(HandleError, match="fewer than"):
            ShmHandle("s-1", (2_000_000, 64), "float32", None, later,
                      segment=shm.name.lstrip("/")).open(ledger=seen)
    finally:
        shm.close()
        shm.unlink()
    assert allocated == []
    seen.close()


_KILLED_PRODUCER = """
import sys, torch
from vlmserve.encoder.ledger import HandleLedger
led = HandleLedger(lease_s=600.0)
for i in range(3):
    led.export(torch.ones(4, 8) * i, "shm")
print(led.segment_prefix(), led.address, flush=True)
sys.stdin.read()  # until killed
"""


def test_a_killed_producers_segments_and_socket_are_removed_by_the_next_ledger():
    """A producer SIGKILLed with live handles leaves its segments and socket file; the next
    ledger (an encoder restarted) removes them, and leaves a live producer's alone."""
    import signal
    import subprocess
    import sys

    with HandleLedger(lease_s=30.0) as alive:
        alive.export(rows(), "shm")
        proc = subprocess.Popen([sys.executable, "-c", _KILLED_PRODUCER], stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, text=True)
        try:
            prefix, address = proc.stdout.readline().split()
        finally:
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait()
        sock = address.removeprefix("ipc://")
        assert len(segments(prefix)) == 3 and os.path.exists(sock)
        with HandleLedger(lease_s=30.0):
            assert segments(prefix) == [] and not os.path.exists(sock)
            assert len(segments(alive.segment_prefix())) == 1
