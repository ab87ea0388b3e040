"""Cache groups per attention kind, with fake requests (no model): sliding and chunked groups
free what their window has passed, allocation is all or nothing across groups, the linear
group's state slots and snapshots, and prefix hits every group can serve."""

from __future__ import annotations

from tests.core.test_prefix_cache import request, text
from tests.core.test_scheduler import make_scheduler, run
from vlmserve.core.kv_cache_groups import (
    FULL,
    CacheGroupSpec,
    LayerKind,
    StatePool,
    layer_groups,
    size_cache_groups,
)
from vlmserve.core.kv_cache_manager import KVCacheManager

BS = 4
SLIDING = LayerKind("sliding", 8)
CHUNKED = LayerKind("chunked", 8)
LINEAR = LayerKind("linear")


def groups(*kinds, blocks=64):
    return [CacheGroupSpec(k, (i,), 0 if k.kind == "linear" else blocks)
            for i, k in enumerate(kinds)]


def hybrid(*kinds, blocks=64, **kw):
    kw.setdefault("block_size", BS)
    return make_scheduler(cache_groups=groups(*kinds, blocks=blocks), **kw)


def test_layers_group_by_kind_and_size_full_first_linear_last():
    kinds = [SLIDING, LINEAR, FULL, SLIDING, LayerKind("sliding", 4), FULL, LINEAR]
    assert layer_groups(kinds) == [
        (FULL, (2, 5)), (SLIDING, (0, 3)), (LayerKind("sliding", 4), (4,)), (LINEAR, (1, 6))]


def test_a_sliding_groups_live_blocks_stop_growing_past_the_window():
    sched = hybrid(FULL, SLIDING, max_num_batched_tokens=8)
    sched.add_request(request("a", text(30), max_tokens=40))
    live, tables = [], []

    def watch(s, so):
        if "a" in s.requests and s.requests["a"].status.name == "RUNNING":
            live.append(s.kv.num_live_blocks("a"))
            tables.append(s.kv.group_block_ids("a"))

    run(sched, on_step=watch)
    full, sliding = zip(*live)
    assert max(full) == -(-69 // BS)  # the full group holds everything
    # a chunk of 8 reads 7 keys before it: at most ceil(15 / 4) + 1 blocks; decodes
    # window / block_size + 1
    assert max(sliding) <= 5 and max(sliding[-30:]) <= 8 // BS + 1
    null = sched.kv.groups[1].null_block
    full_t, sliding_t = tables[-1]
    assert len(sliding_t) == len(full_t)  # places kept: block i holds positions 4i..4i+3
    assert sliding_t[:10] == [null] * 10 and null not in sliding_t[-2:]
    assert sched.kv.num_free_blocks == sched.kv.num_blocks


def test_a_chunked_group_frees_the_blocks_of_finished_chunks():
    kv = KVCacheManager(0, BS, groups=groups(FULL, CHUNKED))
    assert kv.allocate_slots("a", 12, 0)
    assert kv.num_live_blocks("a") == [3, 3]
    assert kv.allocate_slots("a", 17, 12)  # chunk [8, 16) is the current one
    assert kv.num_live_blocks("a") == [5, 3]
    assert kv.group_block_ids("a")[1][:2] == [kv.groups[1].null_block] * 2
    assert kv.allocate_slots("a", 25, 24)
    assert kv.num_live_blocks("a") == [7, 1]
    kv.free("a")
    assert kv.num_free_blocks == kv.num_blocks


def test_allocation_is_all_or_nothing_across_groups():
    kv = KVCacheManager(0, BS, groups=[CacheGroupSpec(FULL, (0,), 8),
                                       CacheGroupSpec(LayerKind("sliding", 64), (1,), 4)])
    assert kv.allocate_slots("a", 12)
    free = [g.num_free_blocks for g in kv.groups]
    assert not kv.allocate_slots("b", 8)  # the full group has room, the sliding one not
    assert [g.num_free_blocks for g in kv.groups] == free and not kv.group_block_ids("b")[0]


def test_a_small_sliding_group_preempts_and_everything_is_freed():
    sched = make_scheduler(block_size=BS, max_num_batched_tokens=16, cache_groups=[
        CacheGroupSpec(FULL, (0,), 256), CacheGroupSpec(SLIDING, (1,), 9)])
    for i in range(4):
        sched.add_request(request(f"r{i}", text(20, 10 * i), max_tokens=12))

    def check(s, so):
        assert sum(s.kv.num_live_blocks(r.request_id)[1] for r in s.running) <= 9

    outs = run(sched, on_step=check, lag=True)
    assert sched.num_preemptions > 0  # 4 requests need more than 9 sliding blocks
    assert sum(so.num_scheduled_tokens.get("r3", 0) for so in outs) >= 20 + 11
    assert sched.kv.num_free_blocks == sched.kv.num_blocks


def test_admission_counts_a_windowed_group_by_its_window():
    sched = hybrid(FULL, SLIDING, blocks=8, max_num_batched_tokens=8)
    assert sched.limits.max_kv_tokens == 32  # the full group's 8 blocks
    only_sliding = hybrid(SLIDING, blocks=8, max_num_batched_tokens=8)
    assert only_sliding.limits.max_kv_tokens > 10_000  # a request needs 5 blocks at most
    assert only_sliding.check_admissible(request("a", text(300))) is None


def test_linear_state_slots_one_per_running_request_from_max_num_seqs():
    sched = hybrid(FULL, LINEAR, max_num_seqs=2)
    assert sched.kv.states.num_slots == 2
    slots: dict[str, int] = {}

    def check(s, so):
        for new in so.new_requests:
            assert new.restore_slot is None and new.extra_block_ids == []
            slots[new.request_id] = new.state_slot
        running = [s.kv.state_slot(r.request_id) for r in s.running]
        assert sorted(running) == sorted(set(running)) and set(running) <= {0, 1}

    for i in range(5):
        sched.add_request(request(f"r{i}", text(6, 10 * i), max_tokens=3))
    run(sched, on_step=check)
    assert set(slots) == {f"r{i}" for i in range(5)} and set(slots.values()) == {0, 1}
    assert sched.kv.states.num_free_slots == 2


def test_snapshots_at_chunk_ends_prompt_end_and_image_ends():
    sched = hybrid(FULL, LINEAR, enable_prefix_caching=True, num_snapshot_slots=16,
                   max_num_batched_tokens=12)
    tokens = text(3) + [99] * 6 + text(13, 40)  # an image at [3, 9), 22 tokens
    sched.add_request(request("a", tokens, [("img", 3, 6)], max_tokens=7))
    outs = run(sched)
    asked = [(p, so.num_scheduled_tokens["a"]) for so in outs for _, p, _ in so.snapshots]
    # chunk [0, 12): the image's end (8) and the chunk's (12); chunk [12, 22): 20 (its end)
    # and no other (21 is in the same block); decodes: 24 and 28
    assert [p for p, _ in asked] == [8, 12, 20, 24, 28]
    assert sched.kv.states.num_snapshots == 5


def test_a_hybrid_prefix_hit_restores_the_snapshot_at_the_hit():
    sched = hybrid(FULL, LINEAR, enable_prefix_caching=True, num_snapshot_slots=16)
    first = text(20)
    run_one(sched, request("a", first, max_tokens=6))
    # turn 2: a's prompt and the answer it computed (a token's value is 100 + its end)
    second = first + [120, 121, 122, 123, 124] + text(7, 60)
    outs = run_one(sched, request("b", second))
    new = outs[0].new_requests[0]
    assert new.num_computed_tokens == 24  # the snapshot at 24: a decode's block end
    keys = sched.kv.request_keys(request("x", second), 6)
    assert new.restore_slot == sched.kv.states.lookup(keys[5]) >= 4  # a snapshot slot
    assert new.state_slot < 4


def run_one(sched, req):
    sched.add_request(req)
    return run(sched)


def test_without_a_snapshot_at_the_boundary_the_hit_falls_back_to_one_that_has_it():
    sched = hybrid(FULL, LINEAR, enable_prefix_caching=True, num_snapshot_slots=16)
    run_one(sched, request("a", text(20), max_tokens=2))
    # the same prompt again: blocks 0-3 are cached, and a snapshot at 16 (the last boundary
    # before the prompt's end) lets it resume there
    outs = run_one(sched, request("b", text(20), max_tokens=2))
    assert outs[0].new_requests[0].num_computed_tokens == 16
    assert outs[0].new_requests[0].restore_slot is not None
    # a longer prompt sharing 18 tokens: full blocks 0-3 cached, snapshots at 16 and 20 only
    outs = run_one(sched, request("c", text(18) + text(9, 80), max_tokens=2))
    assert outs[0].new_requests[0].num_computed_tokens == 16
    sched.kv.reset_prefix_cache()
    outs = run_one(sched, request("d", text(20), max_tokens=2))
    assert outs[0].new_requests[0].num_computed_tokens == 0
    assert outs[0].new_requests[0].restore_slot is None


def test_a_sliding_hit_needs_only_the_blocks_in_the_window():
    sched = hybrid(FULL, SLIDING, enable_prefix_caching=True)
    run_one(sched, request("a", text(40), max_tokens=2))
    outs = run_one(sched, request("b", text(40), max_tokens=2))
    new = outs[0].new_requests[0]
    assert new.num_computed_tokens == 36  # 9 blocks
    null = sched.kv.groups[1].null_block
    # from 36 the window (8) reads positions 29..: blocks 7 and 8
    assert new.extra_block_ids[0][:7] == [null] * 7 and null not in new.extra_block_ids[0][7:]
    # a's sliding block 8 lost: the hit falls back to 32, whose window needs blocks 6 and 7
    g = sched.kv.groups[1]
    keys = sched.kv.request_keys(request("x", text(40)), 9)
    del g._key[g._cached.pop(keys[8])]
    outs = run_one(sched, request("c", text(40), max_tokens=2))
    assert outs[0].new_requests[0].num_computed_tokens == 32


def test_snapshot_pool_is_bounded_and_evicts_least_recently_used():
    pool = StatePool(max_num_seqs=1, num_snapshot_slots=2)
    pool.take("a")
    s1, s2 = pool.reserve("a", 1), pool.reserve("a", 2)
    pool.register("a", [b"k1", b"k2"])
    assert {pool.lookup(b"k1"), pool.lookup(b"k2")} == {s1, s2} == {1, 2}
    pool.lookup(b"k1", touch=True)
    s3 = pool.reserve("a", 3)  # evicts k2, the least recently used
    assert s3 == s2 and pool.lookup(b"k2") is None and pool.num_evicted_snapshots == 1
    pool.free("a")  # its pending snapshot goes back unkeyed
    assert pool.num_snapshots == 1 and pool.reserve("b", 1) == s3


def test_groups_are_sized_windows_first_and_full_layers_take_the_rest():
    from vlmserve.core.kv_cache_groups import size_cache_groups

    kw = dict(block_size=BS, max_num_seqs=2, max_model_len=64, chunk_tokens=8)
    assert size_cache_groups([FULL] * 3, 100, **kw) == [CacheGroupSpec(FULL, (0, 1, 2), 100)]
    # a sliding request holds ceil(7 / 4) + 1 blocks; two of them, one step's chunk (2
    # blocks) and a block each to spare: 10; the full layers share the other 380
    got = size_cache_groups([SLIDING, FULL, SLIDING, FULL, LINEAR], 100, **kw)
    assert got == [CacheGroupSpec(FULL, (1, 3), 190), CacheGroupSpec(SLIDING, (0, 2), 10),
                   CacheGroupSpec(LINEAR, (4,), 0)]


def test_groups_are_sized_by_what_a_block_costs_in_each_layer():
    """Gemma 4's shape: layers 3 (sliding) and 4 (full) read layers 0 and 2's caches (a
    block costs them nothing), a full layer's block twice a sliding one's. The memory of
    `blocks_per_layer` blocks of every layer goes to the layers that hold a cache, no more."""
    sliding = LayerKind("sliding", 16)
    kinds = [sliding, FULL, FULL, sliding, FULL]
    kw = dict(block_size=4, max_num_seqs=2, max_model_len=1024, chunk_tokens=8)
    uniform = {g.kind: g for g in size_cache_groups(kinds, 300, **kw)}
    assert uniform == {g.kind: g for g in size_cache_groups(kinds, 300, **kw,
                                                            layer_bytes=[7] * 5)}
    cost = [1, 2, 2, 0, 0]
    sized = {g.kind: g for g in size_cache_groups(kinds, 300, **kw, layer_bytes=cost)}
    assert sized[sliding].num_blocks == uniform[sliding].num_blocks  # (bounded by its window)
    memory = 300 * sum(cost)
    held = sized[FULL].num_blocks * 4 + sized[sliding].num_blocks * 1
    assert memory - 4 < held <= memory
