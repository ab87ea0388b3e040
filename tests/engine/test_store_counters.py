"""The embedding store's byte and entry counters are running counts (O(1) to read after
every step): after every operation they must equal a recount over the store's entries."""

from __future__ import annotations

import pytest
import torch

from vlmserve.core.mm_cache_manager import EncoderCacheManager
from vlmserve.worker.mm_embedding_store import MMEmbeddingStore

HIDDEN = 8
CPU = torch.device("cpu")


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def recount(store: MMEmbeddingStore) -> tuple[int, int, int]:
    """(entries, device bytes, host bytes) summed over the store's tables."""
    device = sum(_nbytes(t) for t in store._device.values())
    if store.offload:
        device += sum(_nbytes(b) for b in store._buffers)
    host = sum(_nbytes(t) for t in store._host.values())
    return len(store._device) + len(store._host), device, host


class Checked:
    """Runs store operations and compares the counters with a recount after each one; also
    tracks the peak of the recounted device bytes at the points the store notes its peak."""

    def __init__(self, store: MMEmbeddingStore) -> None:
        self.store = store
        self.peak = 0
        self.check()

    def check(self) -> None:
        s = self.store
        assert (s.num_entries, s.bytes_on_device, s.bytes_on_host) == recount(s)

    def put(self, h: str, rows: int, value: float = 1.0) -> None:
        self.store.put(h, torch.full((rows, HIDDEN), value))
        if not self.store.offload:
            self.peak = max(self.peak, recount(self.store)[1])
        self.check()

    def free(self, hashes: list[str]) -> None:
        self.store.free(hashes)
        self.check()

    def step(self, spans: list[tuple[str, int, int]], prefetch=()) -> torch.Tensor | None:
        s = self.store
        s.begin_step()
        self.check()
        s.prefetch(list(prefetch))
        self.check()
        out = s.gather(spans)
        self.check()
        s.end_step()
        self.peak = max(self.peak, recount(s)[1])
        self.check()
        assert s.stats.peak_device_bytes == self.peak
        return out


@pytest.mark.parametrize("offload", [False, True], ids=["device", "offload"])
def test_counters_put_gather_free(offload):
    # host pool of 10 rows: the third entry finds no range and gets a tensor of its own
    store = MMEmbeddingStore(CPU, HIDDEN, torch.float32, offload=offload, buffer_rows=16,
                             host_rows=10)
    c = Checked(store)
    c.put("a", 4, 1.0)
    c.put("b", 5, 2.0)
    c.put("c", 3, 3.0)  # offload: outside the pool
    if offload:
        assert store.stats.host_pool_misses == 1
    assert store.num_entries == 3 and store.bytes_on_host == (12 * HIDDEN * 4 if offload else 0)
    out = c.step([("a", 0, 4), ("c", 1, 3)], prefetch=[("b", 0, 5)])
    assert torch.equal(out, torch.tensor([1.0] * 4 + [3.0] * 2)[:, None].expand(6, HIDDEN))
    out = c.step([("b", 0, 5)])  # offload: read from the prefetched buffer
    assert torch.equal(out, torch.full((5, HIDDEN), 2.0))
    c.free(["a", "missing"])  # an unknown hash is ignored
    c.free(["a"])  # freeing twice counts once
    c.put("b", 2, 4.0)  # the same hash again replaces the entry
    assert store.num_entries == 2
    c.step([("b", 0, 2)])
    c.put("d", 4, 5.0)  # offload: reuses the pool range "a" gave back
    if offload:
        assert store.stats.host_pool_misses == 1
    c.free(["b", "c", "d"])
    assert store.num_entries == 0 and store.bytes_on_host == 0
    assert store.bytes_on_device == (2 * 16 * HIDDEN * 4 if offload else 0)


@pytest.mark.parametrize("offload", [False, True], ids=["device", "offload"])
def test_counters_under_cache_retention_and_eviction(offload):
    """Driven as the engine drives it: the scheduler's encoder cache (LRU retention, a small
    capacity) decides which entries exist; the store encodes, serves and frees them."""
    cache = EncoderCacheManager(capacity_rows=24, retain=True)
    store = MMEmbeddingStore(CPU, HIDDEN, torch.float32, offload=offload, buffer_rows=32,
                             host_rows=24)
    c = Checked(store)
    gen = torch.Generator().manual_seed(0)
    sizes = {f"img{i}": 3 + i % 5 for i in range(12)}
    live: dict[str, list[str]] = {}  # request -> hashes it references
    for step in range(40):
        # finish the oldest request now and then: its images become retained (LRU)
        if live and step % 3 == 0:
            rid = next(iter(live))
            cache.release_all(rid, live.pop(rid))
        rid = f"r{step}"
        wanted = [h for h in sizes if torch.rand((), generator=gen) < 0.2][:2]
        to_encode, hashes = [], []
        for h in wanted:
            if h in cache:
                cache.add_ref(h, rid)
            elif cache.can_allocate(sizes[h]):
                cache.allocate(h, sizes[h], rid)
                to_encode.append(h)
            else:
                continue
            hashes.append(h)
        live[rid] = hashes
        c.free(cache.take_freed())  # evicted to make room, dropped before the encoder runs
        for h in to_encode:
            c.put(h, sizes[h], float(step))
        c.step([(h, 0, sizes[h]) for h in hashes])
        assert store.num_entries == cache.num_entries
    assert cache.num_evictions > 0 and cache.num_hits > 0
    for rid in list(live):
        cache.release_all(rid, live.pop(rid))
    cache.retain = False
    c.free(list(cache._lru))  # the retained entries, dropped at the end
    assert store.num_entries == 0 and store.bytes_on_host == 0


def held_bytes(tensors) -> int:
    """Bytes the allocator holds for these tensors: each distinct storage once, whole."""
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}
    return sum(storages.values())


def test_retained_embeddings_hold_only_their_own_rows(vlmserve_cache) -> None:
    """Four images encoded in one batch by the real encoder, three freed: what the store
    still holds (whole storages, as the allocator sees them) is what it counts, not the
    batch's storage."""
    from tests.engine.helpers import chat_prompt, make_image
    from vlmserve import LLM

    llm = LLM("tiny-qwen2-vl", dtype="float32", device="cpu", mm_embedding_offload=False)
    prompt = chat_prompt(llm, "Four.", [make_image(56 + 28 * i, 56, i) for i in range(4)])
    images = llm.engine.input_processor.process(prompt).images
    runner = llm.engine.core.executor.runner
    store = runner.store
    runner.encoder.run({img.mm_hash: img for img in images})
    assert runner.encoder.num_batches == 1 and store.num_entries == 4
    store.free([img.mm_hash for img in images[:3]])
    assert store.num_entries == 1
    assert held_bytes(store._device.values()) == store.bytes_on_device
    assert store.bytes_on_device == images[3].length * store._device[images[3].mm_hash][0].nbytes
