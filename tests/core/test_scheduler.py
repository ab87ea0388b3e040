"""Scheduler and cache accounting with fake requests: no model, no tensors of substance."""

import random

import pytest
import torch

from vlmserve.core.scheduler import Scheduler
from vlmserve.multimodal.inputs import ImageInput, ProcessedPrompt
from vlmserve.request import Request, RequestStatus
from vlmserve.sampling_params import SamplingParams

EOS = 7


def make_request(rid, prompt_len, images=(), max_tokens=4, hashes=None):
    """images: (offset, length) placeholder runs inside the prompt."""
    imgs = [ImageInput(mm_hash=(hashes[i] if hashes else f"{rid}-img{i}"), offset=o, length=n,
                       pixels=torch.empty(0), encoder_meta=(1, 2, 2), transform=None)
            for i, (o, n) in enumerate(images)]
    prompt = ProcessedPrompt(None, [1] * prompt_len, imgs)
    return Request(rid, prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True), (EOS,))


def make_scheduler(**kw):
    """A scheduler with small limits; unless given, an encoder budget of the step budget and an
    encoder cache of four times the larger of the two."""
    args = dict(max_num_seqs=4, max_num_batched_tokens=32, max_model_len=512,
                num_kv_blocks=256, block_size=4)
    args.update(kw)
    args.setdefault("max_num_encoder_tokens", args["max_num_batched_tokens"])
    args.setdefault("encoder_cache_rows", 4 * max(args["max_num_encoder_tokens"],
                                                  args["max_num_batched_tokens"]))
    return Scheduler(**args)


def run(sched, max_steps=1000, on_step=None, lag=False):
    """Drive the scheduler like the engine; return the list of SchedulerOutputs. A sampled
    token's value is its position. `lag`: schedule step N+1 before step N's tokens come
    back (the engine's async scheduling)."""
    outs, pending = [], []
    for _ in range(max_steps):
        if not sched.has_unfinished_requests() and not pending:
            return outs
        before = {rid: r.num_placeholders for rid, r in sched.requests.items()}
        so = sched.schedule()
        sampled = {rid: 100 + end for rid, end in so.chunk_ends.items()
                   if sched.requests[rid].num_placeholders > before[rid]}
        if on_step:
            on_step(sched, so)
        pending.append((so, sampled))
        while pending and (not lag or so.is_empty or len(pending) > 1):
            sched.update_from_output(*pending.pop(0))
        outs.append(so)
    raise AssertionError("requests did not finish")


def test_budgets_respected_and_everything_freed():
    sched = make_scheduler(max_num_seqs=3, max_num_batched_tokens=20, max_num_encoder_tokens=12)
    rng = random.Random(0)
    reqs = []
    for i in range(10):
        n_img = rng.randint(0, 3)
        images, pos = [], rng.randint(0, 5)
        for _ in range(n_img):
            length = rng.randint(1, 12)
            images.append((pos, length))
            pos += length + rng.randint(0, 4)
        reqs.append(make_request(f"r{i}", pos + rng.randint(1, 5), images,
                                 max_tokens=rng.randint(1, 6)))
        sched.add_request(reqs[-1])

    def check(s, so):
        assert so.total_num_scheduled_tokens <= 20
        assert len(s.running) <= 3
        enc = sum(img.length for img in so.encoder_inputs.values())
        assert enc <= 12
        assert s.encoder_cache.used_rows <= s.encoder_cache.capacity_rows

    outs = run(sched, on_step=check)
    encoded = [h for so in outs for h in so.encoder_inputs]
    assert sorted(encoded) == sorted(f.mm_hash for r in reqs for f in r.mm_features)
    assert all(r.status == RequestStatus.FINISHED_LENGTH for r in reqs)
    assert all(len(r.output_token_ids) == r.sampling_params.max_tokens for r in reqs)
    assert sched.kv.num_free_blocks == sched.kv.num_blocks
    assert sched.encoder_cache.used_rows == 0 and sched.encoder_cache.num_entries == 0
    freed = [h for so in outs for h in so.free_encoder_hashes] + sched.encoder_cache.take_freed()
    assert sorted(freed) == sorted(f.mm_hash for r in reqs for f in r.mm_features)


def test_image_encoded_in_step_whose_chunk_first_needs_it_and_chunk_cuts_through_it():
    sched = make_scheduler(max_num_batched_tokens=8, max_num_encoder_tokens=16)
    req = make_request("a", 30, [(5, 12)])
    sched.add_request(req)
    so1 = sched.schedule()
    assert so1.num_scheduled_tokens == {"a": 8}  # tokens 0..7: needs rows 0..2 of the image
    assert list(so1.encoder_inputs) == ["a-img0"]
    assert so1.encoder_inputs["a-img0"] is req.encoder_inputs["a-img0"]  # the payload
    assert not hasattr(so1.new_requests[0].mm_features[0], "pixels")  # scheduling data only
    sched.update_from_output(so1, {})
    so2 = sched.schedule()  # tokens 8..15 take rows 3..10; the image is not encoded again
    assert so2.num_scheduled_tokens == {"a": 8} and not so2.encoder_inputs
    sched.update_from_output(so2, {})
    so3 = sched.schedule()  # rows 11.. consumed at token 16; the entry is freed after it
    sched.update_from_output(so3, {})
    assert sched.schedule().free_encoder_hashes == ["a-img0"]


def test_one_token_chunk_through_an_image_is_not_treated_as_a_decode():
    # the prompt ends in an image; its last chunk is one token, the image's only row
    sched = make_scheduler(max_num_batched_tokens=8, max_num_encoder_tokens=16)
    sched.add_request(make_request("a", 9, [(8, 1)]))
    so1 = sched.schedule()
    assert so1.num_scheduled_tokens == {"a": 8} and not so1.encoder_inputs
    sched.update_from_output(so1, {})
    so2 = sched.schedule()
    assert so2.num_scheduled_tokens == {"a": 1} and list(so2.encoder_inputs) == ["a-img0"]
    sched.update_from_output(so2, {"a": 100})
    assert sched.schedule().free_encoder_hashes == ["a-img0"]


def test_chunk_stops_before_image_when_encoder_budget_is_spent():
    sched = make_scheduler(max_num_batched_tokens=64, max_num_encoder_tokens=10)
    sched.add_request(make_request("a", 40, [(2, 8), (12, 8)]))
    so = sched.schedule()
    assert list(so.encoder_inputs) == ["a-img0"]
    assert so.num_scheduled_tokens == {"a": 12}  # stops right before the second image


def test_fcfs_order_and_no_starvation():
    sched = make_scheduler(max_num_seqs=2, max_num_batched_tokens=16)
    reqs = [make_request(f"r{i}", 10, max_tokens=3) for i in range(6)]
    for r in reqs:
        sched.add_request(r)
    started = []

    def record(s, so):
        for nr in so.new_requests:
            started.append(nr.request_id)

    run(sched, on_step=record)
    assert started == [r.request_id for r in reqs]
    assert all(r.status.finished for r in reqs)


def test_preemption_frees_blocks_and_recomputes():
    # 12 blocks of 4 tokens: two 20-token prompts growing to 28 tokens cannot both fit
    sched = make_scheduler(num_kv_blocks=12, max_num_batched_tokens=64)
    a, b = make_request("a", 20, [(2, 6)], max_tokens=8), make_request("b", 20, max_tokens=8)
    sched.add_request(a)
    sched.add_request(b)
    outs = run(sched)
    assert sched.num_preemptions >= 1 and b.num_preemptions >= 1 and a.num_preemptions == 0
    assert len(a.output_token_ids) == len(b.output_token_ids) == 8
    preempted_steps = [so for so in outs if "b" in so.finished_request_ids]
    assert preempted_steps, "the worker must be told to drop the preempted request"
    assert sched.kv.num_free_blocks == 12


def test_prompt_longer_than_max_model_len_rejected():
    sched = make_scheduler(max_model_len=16)
    reason = sched.check_admissible(make_request("a", 16))
    assert reason and "16" in reason and "maximum context length" in reason
    assert sched.check_admissible(make_request("b", 15)) is None


def test_image_larger_than_encoder_budget_rejected():
    sched = make_scheduler(max_num_encoder_tokens=8)
    assert "encoder budget" in sched.check_admissible(make_request("a", 20, [(0, 9)]))


def test_shared_image_encoded_once_across_requests():
    sched = make_scheduler(max_num_seqs=5, max_num_batched_tokens=200)
    reqs = [make_request(f"r{i}", 20 + i, [(3, 10)], hashes=["same"]) for i in range(5)]
    for r in reqs:
        sched.add_request(r)
    outs = run(sched)
    assert sum(len(so.encoder_inputs) for so in outs) == 1
    assert sched.encoder_cache.num_entries == 0


def test_chunked_prefill_disabled_schedules_whole_prompts():
    sched = make_scheduler(max_num_batched_tokens=32, enable_chunked_prefill=False)
    sched.add_request(make_request("a", 20))
    sched.add_request(make_request("b", 20))
    so = sched.schedule()
    assert so.num_scheduled_tokens == {"a": 20}
    assert "chunked prefill disabled" in sched.check_admissible(make_request("c", 40))


@pytest.mark.parametrize("budget", [1, 3, 7])
def test_tiny_budgets_make_progress(budget):
    sched = make_scheduler(max_num_batched_tokens=budget, max_num_encoder_tokens=16)
    r = make_request("a", 25, [(0, 6), (6, 6), (15, 4)], max_tokens=3)
    sched.add_request(r)
    run(sched)
    assert r.status == RequestStatus.FINISHED_LENGTH


def test_encoder_cache_counts_unreferenced_rows_as_evictable():
    from vlmserve.core.mm_cache_manager import EncoderCacheManager

    cache = EncoderCacheManager(capacity_rows=10, retain=True)
    cache.allocate("a", 4, "r1")
    cache.allocate("b", 4, "r1")
    cache.release_all("r1", ["a", "b"])  # both retained, unreferenced
    assert cache.can_allocate(10) and not cache.can_allocate(11)
    assert not cache.can_allocate(7, keep={"a"})  # "a" is about to be reused: not evictable
    cache.add_ref("a", "r2")
    assert cache.can_allocate(6) and not cache.can_allocate(7)
    cache.allocate("c", 6, "r2")  # evicts "b" only
    assert cache.take_freed() == ["b"] and cache.num_evictions == 1 and cache.used_rows == 10


@pytest.mark.parametrize("kv_blocks", [256, 12])
def test_lagged_updates_give_the_same_tokens_and_free_everything(kv_blocks):
    """Scheduling step N+1 before step N's tokens are known (placeholders) changes no token,
    also through preemptions, and leaves nothing allocated."""
    results = []
    for lag in (False, True):
        sched = make_scheduler(max_num_seqs=3, max_num_batched_tokens=20,
                               max_num_encoder_tokens=12, num_kv_blocks=kv_blocks)
        rng = random.Random(1)
        reqs = []
        for i in range(8):
            images = [(2, rng.randint(1, 10))] if rng.random() < 0.5 else []
            reqs.append(make_request(f"r{i}", 14 + rng.randint(0, 6), images,
                                     max_tokens=rng.randint(1, 9)))
            sched.add_request(reqs[-1])
        run(sched, lag=lag)
        results.append([r.output_token_ids for r in reqs])
        assert all(r.status == RequestStatus.FINISHED_LENGTH for r in reqs)
        assert all(r.num_placeholders == 0 for r in reqs)
        assert sched.kv.num_free_blocks == sched.kv.num_blocks
        assert sched.encoder_cache.num_referenced == 0
        if kv_blocks == 12:
            assert sched.num_preemptions > 0
    assert results[0] == results[1]


def test_how_far_front_ends_preprocess_ahead():
    """Admit synchronously while less than a step's tokens wait; queue ahead until both a
    batch of requests (max_num_seqs) and two steps' worth of tokens wait."""
    sched = make_scheduler(max_num_seqs=3, max_num_batched_tokens=32)
    assert sched.needs_requests() and sched.has_room_ahead()
    sched.add_request(make_request("a", 20))
    assert sched.num_waiting_tokens() == 20 and sched.needs_requests()
    sched.add_request(make_request("b", 20))
    assert not sched.needs_requests() and sched.has_room_ahead()  # 40 tokens, 2 requests
    sched.add_request(make_request("c", 20))
    assert sched.has_room_ahead()  # 3 requests, but 60 < 64 tokens
    sched.add_request(make_request("d", 8))
    assert not sched.has_room_ahead()  # 4 requests and 68 tokens
    so = sched.schedule()  # a and b (32 tokens: a whole, 12 of b) leave the queue
    assert set(so.num_scheduled_tokens) == {"a", "b"}
    assert sched.num_waiting_tokens() == 28 and sched.needs_requests()


@pytest.mark.parametrize("lag", [False, True])
def test_prefill_tokens_while_decoding_are_capped(lag):
    """With `max_num_prefill_tokens_while_decoding`, a step that carries decodes carries at
    most that many prompt tokens (new prompts wait in smaller chunks); a step without decodes
    still fills the whole budget; every request finishes as without the cap."""
    sched = make_scheduler(max_num_seqs=4, max_num_batched_tokens=32,
                           max_num_prefill_tokens_while_decoding=8)
    prompts = {"a": 30, "b": 2, "c": 45, "d": 20}
    reqs = [make_request("a", 30, [(4, 10)], max_tokens=12),
            make_request("b", 2, max_tokens=12)]
    for r in reqs:
        sched.add_request(r)
    seen = {"capped": 0, "full": 0}

    def check(s, so):
        if so.total_num_scheduled_tokens == 0:
            return
        if len(s.requests) == 2 and s.requests["a"].output_token_ids and "c" not in s.requests:
            for r in (make_request("c", 45, [(10, 12), (30, 6)], max_tokens=3),
                      make_request("d", 20, max_tokens=3)):
                s.add_request(r)
                reqs.append(r)
        starts = {rid: so.chunk_ends[rid] - n for rid, n in so.num_scheduled_tokens.items()}
        prefill = sum(n for rid, n in so.num_scheduled_tokens.items()
                      if starts[rid] < prompts[rid])
        if any(starts[rid] >= prompts[rid] for rid in starts):  # a decode rides along
            assert prefill <= 8, so.num_scheduled_tokens
            seen["capped"] += prefill > 0
        elif prefill == 32:
            seen["full"] += 1

    run(sched, on_step=check, lag=lag)
    assert seen["capped"] >= 4 and seen["full"] >= 1  # c and d went in capped chunks
    assert all(r.status == RequestStatus.FINISHED_LENGTH for r in reqs)
    assert all(len(r.output_token_ids) == r.sampling_params.max_tokens for r in reqs)
    assert sched.kv.num_free_blocks == sched.kv.num_blocks


@pytest.mark.parametrize("lag", [False, True])
@pytest.mark.parametrize("cap", ["max_num_prefill_tokens_while_decoding",
                                 "max_num_encoder_tokens_while_decoding"])
def test_image_rows_while_decoding_are_capped(lag, cap):
    """The prefill cap bounds the image rows a step with decodes encodes, too, and so does the
    encoder cap of such steps (an image is encoded whole, whatever part of it the chunk
    takes), except its first image, which always fits; the encoder cap leaves the prompt
    tokens alone; every request still finishes."""
    sched = make_scheduler(max_num_seqs=8, max_num_batched_tokens=64, max_num_encoder_tokens=64,
                           num_kv_blocks=512, **{cap: 8})
    sched.add_request(make_request("a", 2, max_tokens=200))
    rng = random.Random(1)
    reqs = []
    for i in range(16):  # images of 2-20 rows, some starting a prompt, some ending it
        images, pos = [], rng.randint(0, 3)
        for _ in range(rng.randint(1, 2)):
            n = rng.randint(2, 20)
            images.append((pos, n))
            pos += n + rng.randint(0, 3)
        reqs.append(make_request(f"r{i}", pos + rng.randint(0, 2), images, max_tokens=2))
    seen = {"several": 0, "one_over_cap": 0, "added": False, "prompt_over_cap": 0}

    def check(s, so):
        if not seen["added"] and s.requests["a"].output_token_ids:
            seen["added"] = True
            for r in reqs:
                s.add_request(r)
        if "a" not in so.num_scheduled_tokens:  # a decodes in every step until it ends
            return
        rows = [img.length for img in so.encoder_inputs.values()]
        assert len(rows) <= 1 or sum(rows) <= 8, (so.num_scheduled_tokens, rows)
        seen["several"] += len(rows) > 1
        seen["one_over_cap"] += len(rows) == 1 and rows[0] > 8
        # prompt tokens but a prompt's last (scheduled as a decode: `decodes_next`)
        prompt = sum(min(n, s.requests[rid].num_prompt_tokens - (so.chunk_ends[rid] - n))
                     for rid, n in so.num_scheduled_tokens.items()
                     if so.chunk_ends[rid] - n < s.requests[rid].num_prompt_tokens - 1)
        seen["prompt_over_cap"] += prompt > 8

    run(sched, on_step=check, lag=lag)
    assert seen["several"] and seen["one_over_cap"], seen
    assert bool(seen["prompt_over_cap"]) == (cap == "max_num_encoder_tokens_while_decoding")
    assert all(r.status == RequestStatus.FINISHED_LENGTH for r in reqs)
    assert sched.kv.num_free_blocks == sched.kv.num_blocks


def test_prefetch_plan_follows_the_prefill_cap():
    """The offload prefetch plan guesses the next step's image rows under the same cap: a
    chunk beside a decode reads 8 rows of the image, and the plan names those 8."""
    sched = make_scheduler(max_num_batched_tokens=32, max_num_encoder_tokens=64,
                           max_num_prefill_tokens_while_decoding=8)
    sched.add_request(make_request("a", 2, max_tokens=20))
    sched.add_request(make_request("b", 60, [(2, 50)], max_tokens=2))
    steps = []

    def record(s, so):
        reads = []
        for rid, n in so.num_scheduled_tokens.items():
            end = so.chunk_ends[rid]
            for f in s.requests[rid].mm_features:
                lo, hi = max(end - n, f.offset), min(end, f.offset + f.length)
                if lo < hi and f.mm_hash not in so.encoder_inputs:
                    reads.append((f.mm_hash, lo - f.offset, hi - f.offset))
        steps.append((reads, list(so.prefetch)))

    run(sched, on_step=record)
    pairs = [(plan, reads) for (_, plan), (reads, _) in zip(steps, steps[1:]) if reads]
    assert len(pairs) >= 3 and all(plan == reads for plan, reads in pairs), pairs
    assert pairs[0][1] == [("b-img0", 28, 36)]
