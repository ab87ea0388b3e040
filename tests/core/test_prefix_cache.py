"""Prefix caching in the scheduler and the KV cache manager, with fake requests (no model):
keys by tokens and image content, sharing by refcount, eviction, encoder skipping, and no
block shared before the step that writes it has finished."""

from __future__ import annotations

import torch

from tests.core.test_scheduler import EOS, make_scheduler, run
from vlmserve.core.kv_cache_manager import KVCacheManager
from vlmserve.multimodal.inputs import ImageInput, ProcessedPrompt
from vlmserve.request import Request
from vlmserve.sampling_params import SamplingParams

BS = 4


def request(rid: str, tokens: list[int], images=(), max_tokens: int = 2) -> Request:
    """images: (hash, offset, length)."""
    imgs = [ImageInput(mm_hash=h, offset=o, length=n, pixels=torch.empty(0),
                       encoder_meta=(1, 2, 2), transform=None) for h, o, n in images]
    return Request(rid, ProcessedPrompt(None, list(tokens), imgs),
                   SamplingParams(max_tokens=max_tokens, ignore_eos=True), (EOS,))


def scheduler(**kw):
    return make_scheduler(block_size=BS, enable_prefix_caching=True, **kw)


def finish(sched, req) -> list:
    sched.add_request(req)
    return run(sched)


def text(n: int, start: int = 10) -> list[int]:
    return list(range(start, start + n))


def test_the_same_prompt_again_computes_only_its_last_token():
    sched = scheduler()
    finish(sched, request("a", text(20)))
    outs = finish(sched, request("b", text(20)))
    # 20 tokens = 5 full blocks; the last token is always computed: 4 blocks hit
    assert outs[0].new_requests[0].num_computed_tokens == 16
    assert outs[0].num_scheduled_tokens["b"] == 4
    assert sched.kv.num_hit_tokens == 16 and sched.kv.num_queried_tokens == 40
    assert sched.stats().prefix_cache_hit_rate == 16 / 40


def test_a_different_image_of_the_same_size_hits_only_the_text_before_it():
    sched = scheduler()
    tokens = text(6) + [99] * 8 + text(6, 50)  # an 8-token image at offset 6
    finish(sched, request("a", tokens, [("img-A", 6, 8)]))
    outs = finish(sched, request("b", tokens, [("img-B", 6, 8)]))
    assert outs[0].new_requests[0].num_computed_tokens == 4  # block 0 only: text
    assert list(outs[0].encoder_inputs) == ["img-B"]  # B is encoded
    outs = finish(sched, request("c", tokens, [("img-A", 6, 8)]))
    assert outs[0].new_requests[0].num_computed_tokens == 16  # through the image


def test_images_inside_a_hit_are_not_encoded_and_one_cut_by_it_is():
    sched = scheduler()
    tokens = text(2) + [99] * 4 + text(2, 40) + [98] * 8 + text(5, 60)  # images at 2 and 8
    images = [("one", 2, 4), ("two", 8, 8)]
    finish(sched, request("a", tokens, images))
    # keep only the first three blocks cached: image one whole, image two cut after 4 rows
    for key in sched.kv.request_keys(request("x", tokens, images), 5)[3:]:
        block = sched.kv._cached.pop(key, None)
        if block is not None:
            del sched.kv._key[block]
    outs = finish(sched, request("b", tokens, images))
    assert outs[0].new_requests[0].num_computed_tokens == 12
    assert list(outs[0].encoder_inputs) == ["two"]  # image one skipped, two encoded
    assert outs[0].num_scheduled_tokens["b"] == len(tokens) - 12


def test_blocks_are_shared_by_refcount_and_kept_until_evicted():
    kv = KVCacheManager(num_blocks=6, block_size=BS, enable_prefix_caching=True)
    assert kv.allocate_slots("a", 12)
    a_blocks = kv.block_ids("a")
    keys = [b"k0", b"k1", b"k2"]
    kv.cache_blocks("a", keys, 0)
    assert kv.cached_prefix(keys) == a_blocks
    kv.take_cached_prefix("b", kv.cached_prefix(keys[:2]))
    assert kv.block_ids("b") == a_blocks[:2] and kv.num_free_blocks == 3
    kv.free("a")  # block 2 free but cached; 0 and 1 still held by b
    assert kv.num_free_blocks == 4 and kv.cached_prefix(keys) == a_blocks
    kv.free("b")
    assert kv.num_free_blocks == 6 and kv.num_cached_blocks == 3
    # new allocations take the never-cached blocks first, then evict least recently freed
    assert kv.allocate_slots("c", 12)
    assert kv.num_cached_blocks == 3 and kv.num_evicted_blocks == 0
    assert kv.allocate_slots("c", 16)  # one more: evicts a's tail block (freed first)
    assert kv.num_evicted_blocks == 1 and kv.cached_prefix(keys) == a_blocks[:2]


def test_no_block_is_shared_before_the_step_writing_it_has_finished():
    sched = scheduler()
    sched.add_request(request("a", text(20), max_tokens=4))
    so = sched.schedule()  # a's prefill: its blocks are being written
    assert so.num_scheduled_tokens == {"a": 20}
    sched.add_request(request("b", text(20), max_tokens=4))
    so2 = sched.schedule()
    assert so2.new_requests[0].request_id == "b" and so2.new_requests[0].num_computed_tokens == 0
    sched.update_from_output(so, {"a": 1})  # a's step is done: now its blocks are keyed
    sched.add_request(request("c", text(20), max_tokens=4))
    so3 = sched.schedule()
    assert [n.num_computed_tokens for n in so3.new_requests] == [16]


def test_preempted_request_recomputes_from_its_cached_prefix_and_frees_everything():
    sched = scheduler(num_kv_blocks=14, max_num_batched_tokens=64)
    reqs = [request(f"r{i}", text(20, 10 * i), max_tokens=16) for i in range(3)]
    for r in reqs:
        sched.add_request(r)
    run(sched, lag=True)
    assert sched.num_preemptions > 0
    assert sched.kv.num_hit_tokens > 0  # the preempted ones found their blocks again
    assert sched.kv.num_free_blocks == 14
    assert not sched.kv._blocks


def test_output_tokens_are_cached_for_the_next_turn():
    sched = scheduler()
    a = request("a", text(10), max_tokens=12)
    finish(sched, a)
    turn2 = a.all_token_ids + text(5, 200)  # the reply and a new question
    outs = finish(sched, request("b", turn2))
    # 10 prompt + 12 outputs = 22 tokens: 5 full blocks written (the last output's KV never is)
    assert outs[0].new_requests[0].num_computed_tokens == 20


def test_prefix_caching_off_shares_nothing():
    sched = make_scheduler(block_size=BS)
    finish(sched, request("a", text(20)))
    outs = finish(sched, request("b", text(20)))
    assert outs[0].new_requests[0].num_computed_tokens == 0
    assert sched.kv.num_cached_blocks == 0
