"""Consumer processes for the handle tests (spawned: a fresh interpreter, as a real consumer
would be). Each takes handles from the producer and answers on a queue."""

from __future__ import annotations

import hashlib
import time

import torch


def digest(t: torch.Tensor) -> str:
    """The exact bytes of a tensor, hashed (bit-for-bit comparison across processes)."""
    return hashlib.sha256(t.contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()


def open_all(inbox, outbox) -> None:
    """Open every handle of every `EncoderOutput` received (and of the extra handles), copy
    the rows, answer with their digests (or the error's name) and this side's ledger."""
    from vlmserve.transfer.consumer_ledger import consumer_ledger

    outputs, extra = inbox.get()
    results = {}
    for out in outputs:
        for img in out.images:
            results[img.handle.handle_id] = digest(img.handle.open())
    for h in extra:
        try:
            h.open()
            results[h.handle_id] = "opened"
        except Exception as e:
            results[h.handle_id] = type(e).__name__
    ledger = consumer_ledger()
    stats = ledger.stats()
    ledger.close()  # flush the release messages before answering
    outbox.put((results, stats))


def open_some_then_hang(inbox, outbox, copy_first: int) -> None:
    """Copy ``copy_first`` handles out; of the rest, announce the open and map the rows (a
    copy in progress), then wait to be killed."""
    from vlmserve.transfer.consumer_ledger import consumer_ledger
    from vlmserve.transfer.handles import _map_segment

    ledger = consumer_ledger()
    outbox.put("started")  # the producer exports now: the lease runs from here
    handles = inbox.get()
    for h in handles[:copy_first]:
        h.open()
    mapped = []
    for h in handles[copy_first:]:
        ledger.begin(h)
        mapped.append(_map_segment(h.segment, h.nbytes))
    outbox.put("ready")
    time.sleep(600)


def open_cuda(inbox, outbox, hang_after: int | None = None) -> None:
    """CUDA consumer: copy each handle's rows into a fresh CUDA tensor and answer with their
    digests; with ``hang_after``, rebuild (map) the remaining handles without releasing them
    and wait to be killed."""
    from vlmserve.transfer.consumer_ledger import consumer_ledger

    torch.cuda.init()
    outbox.put("started")
    handles = inbox.get()
    n = len(handles) if hang_after is None else hang_after
    results = {h.handle_id: digest(h.open().cpu()) for h in handles[:n]}
    held = []
    for h in handles[n:]:
        consumer_ledger().begin(h)
        held.append(h.rebuild(*h.args))
    torch.cuda.synchronize()
    if hang_after is not None:
        outbox.put(("ready", results))
        time.sleep(600)
    stats = consumer_ledger().stats()
    consumer_ledger().close()
    outbox.put((results, stats))


def open_wire_cuda(inbox, outbox) -> None:
    """CUDA consumer of handles on the wire (msgpack bytes, no pickle): open each on this
    process's GPU as the engine core does, answer with the digests and the ledger."""
    import msgspec

    from vlmserve.transfer.consumer_ledger import consumer_ledger
    from vlmserve.transfer.wire import HandleWire, from_wire

    torch.cuda.init()
    outbox.put("started")
    wires = msgspec.msgpack.decode(inbox.get(), type=list[HandleWire])
    results = {w.handle_id: digest(from_wire(w).open("cuda").cpu()) for w in wires}
    stats = consumer_ledger().stats()
    consumer_ledger().close()
    outbox.put((results, stats))


def open_cuda_rounds(inbox, outbox) -> None:
    """CUDA consumer of several rounds of handles: each round's digests, and how many pool
    blocks this process has mapped so far."""
    from vlmserve.transfer import handles as handles_module
    from vlmserve.transfer.consumer_ledger import consumer_ledger

    torch.cuda.init()
    outbox.put("started")
    while (handles := inbox.get()) is not None:
        results = {h.handle_id: digest(h.open().cpu()) for h in handles}
        outbox.put((results, len(handles_module._mapped)))
    consumer_ledger().close()
    outbox.put("done")
