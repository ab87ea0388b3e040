"""Embedding handles on the wire (msgpack / JSON, never pickle) and the engine core's opening
of them: round trips for every kind, a failed open releases the request's other handles, a
handle whose rows do not fit the image is refused; on a GPU, a CUDA IPC handle sent as bytes
opens in another process."""

from __future__ import annotations

import multiprocessing as mp
from dataclasses import dataclass

import msgspec
import pytest
import torch

from tests.encoder import consumer
from tests.encoder.helpers import segments, wait_until
from tests.encoder.test_procs import _get, _stop
from vlmserve.encoder.ledger import HandleLedger
from vlmserve.transfer.handles import CudaIpcHandle, HandleError, HandleExpiredError
from vlmserve.transfer.wire import HandleWire, from_wire, open_handles, to_wire


@dataclass
class _Image:  # what `open_handles` reads of an `ImageData`
    length: int
    handle: HandleWire | None = None
    embeds: torch.Tensor | None = None


def _roundtrip(handle, codec) -> HandleWire:
    return codec.decode(codec.encode(to_wire(handle)), type=HandleWire)


@pytest.mark.parametrize("codec", [msgspec.msgpack, msgspec.json])
@pytest.mark.parametrize("transport", ["shm", "bytes"])
def test_host_handles_survive_the_wire(codec, transport) -> None:
    rows = torch.randn(12, 8)
    with HandleLedger(lease_s=30) as ledger:
        wire = _roundtrip(ledger.export(rows, transport), codec)
        assert type(wire).__name__.lower() == f"{transport}wire"
        assert torch.equal(from_wire(wire).open(), rows)
        assert wait_until(lambda: ledger.stats().live_handles == 0, 5)
        assert segments(ledger.segment_prefix()) == []


def test_cuda_handle_fields_survive_the_wire() -> None:
    """The rebuild arguments of `reduce_tensor` (as on a GPU) come back equal, with the
    classes and function fixed on this side rather than sent."""
    from torch.multiprocessing.reductions import rebuild_cuda_tensor

    args = (torch.Tensor, torch.Size([5, 4]), (4, 1), 0, torch.storage.TypedStorage,
            torch.bfloat16, 0, b"\x01ipc", 4096, 512, False, b"\x02rc", 16, b"\x03ev", True)
    for offset in (None, 1 << 20):  # a tensor of its own, a slot of a pool block (bytes)
        if offset is not None:
            args = (*args[:5], torch.uint8, *args[6:])
        h = CudaIpcHandle("p-1", (5, 4), "bfloat16", "ipc:///tmp/x", 1e10,
                          rebuild=lambda: None, args=args, block_offset=offset)
        for codec in (msgspec.msgpack, msgspec.json):
            back = from_wire(_roundtrip(h, codec))
            assert isinstance(back, CudaIpcHandle) and back.rebuild is rebuild_cuda_tensor
            assert back.args == args and (back.handle_id, back.shape) == ("p-1", (5, 4))
            assert back.block_offset == offset


def test_a_failed_open_releases_the_requests_other_handles() -> None:
    with HandleLedger(lease_s=30) as ledger:
        ok = to_wire(ledger.export(torch.ones(3, 8), "shm"))
        # its lease ran out (as seen by the consumer): opening it fails
        gone = msgspec.structs.replace(to_wire(ledger.export(torch.ones(2, 8), "shm")),
                                       expires_at=0.0)
        later = to_wire(ledger.export(torch.ones(4, 8), "shm"))
        images = [_Image(3, ok), _Image(5, embeds=torch.zeros(5, 8)), _Image(2, gone),
                  _Image(4, later)]
        with pytest.raises(HandleExpiredError):
            open_handles(images, torch.device("cpu"))
        # the first was opened and released, the last released unread: nothing is left held
        assert wait_until(lambda: ledger.stats().live_handles == 0, 5)
        assert segments(ledger.segment_prefix()) == []
        s = ledger.stats()
        assert (s.opened, s.released, s.reclaimed) == (2, 3, 0)


def test_rows_that_do_not_fit_the_image_are_refused_and_released() -> None:
    with HandleLedger(lease_s=30) as ledger:
        wire = to_wire(ledger.export(torch.ones(3, 8), "shm"))
        with pytest.raises(HandleError, match="rows"):
            open_handles([_Image(4, wire)], torch.device("cpu"))
        assert wait_until(lambda: ledger.stats().live_handles == 0, 5)
        text = to_wire(ledger.export(torch.ones(2, 8), "bytes"))
        rows = open_handles([_Image(1, embeds=None), _Image(2, text)], torch.device("cpu"))
        assert rows[0] is None and torch.equal(rows[1], torch.ones(2, 8))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_handles_on_the_wire_open_in_another_process() -> None:
    spawn = mp.get_context("spawn")
    inbox, outbox = spawn.Queue(), spawn.Queue()
    proc = spawn.Process(target=consumer.open_wire_cuda, args=(inbox, outbox))
    proc.start()
    try:
        assert _get(outbox, proc) == "started"
        with HandleLedger(lease_s=60) as ledger:
            sources = [torch.randn(1280, 1536, device="cuda").to(torch.bfloat16)
                       for _ in range(4)]
            want = [consumer.digest(r.cpu()) for r in sources]
            wires = [to_wire(ledger.export(r)) for r in sources]
            inbox.put(msgspec.msgpack.encode(wires))
            results, stats = _get(outbox, proc)
            assert [results[w.handle_id] for w in wires] == want
            assert (stats.opened, stats.released, stats.live) == (4, 4, 0)
            assert wait_until(lambda: ledger.stats().live_handles == 0, 10)
    finally:
        _stop(proc)


def test_handles_from_clients_name_no_address_the_server_contacts() -> None:
    """A client's handles of every kind lose the release address they came with (the
    server connects to no address a client names) and each gets an id of its own (a retry
    is no second open): opening them reads the rows and connects nowhere."""
    from vlmserve.transfer.consumer_ledger import ConsumerLedger
    from vlmserve.transfer.wire import EncodedImageWire, EncoderOutputWire, output_from_wire

    rows = torch.randn(3, 8)
    with HandleLedger(lease_s=30) as ledger:
        sent = [msgspec.structs.replace(to_wire(ledger.export(rows, kind)),
                                        release_address="tcp://127.0.0.1:9")
                for kind in ("shm", "bytes")]
        wire = EncoderOutputWire(prompt=None, prompt_token_ids=[1, 2, 3], images=[
            EncodedImageWire(mm_hash="x", length=3, encoder_meta=(), handle=h) for h in sent])
        consumer = ConsumerLedger()
        try:
            for _ in range(2):  # the same body twice
                out = output_from_wire(wire, ("bytes", "shm"))
                assert [i.handle.release_address for i in out.images] == [None, None]
                assert not {i.handle.handle_id for i in out.images} & {h.handle_id
                                                                       for h in sent}
                for img in out.images:
                    assert torch.equal(img.handle.open(ledger=consumer), rows)
            assert consumer._ctx is None and not consumer._sockets
        finally:
            consumer.close()
