"""Image embeddings: shared encodes, LRU eviction within budget, offload buffer rotation."""

from __future__ import annotations

import pytest

from tests.engine.helpers import chat_prompt, make_image, mixed_prompts
from vlmserve import LLM, SamplingParams

GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)


def make_llm(**kw):
    args = dict(dtype="float32", device="cpu", max_num_batched_tokens=32, max_num_seqs=8)
    args.update(kw)
    return LLM("tiny-qwen2-vl", **args)


@pytest.mark.parametrize("offload", [False, True])
def test_image_shared_by_five_concurrent_requests_is_encoded_once(vlmserve_cache, offload):
    llm = make_llm(mm_embedding_offload=offload, enable_mm_cache=False, max_num_batched_tokens=512)
    img = make_image(112, 112, 42)
    prompts = [chat_prompt(llm, f"Question {i}: what do you see?" + " more" * i, [img])
               for i in range(5)]
    engine = llm.engine
    for i, p in enumerate(prompts):  # all five in the engine at once
        engine.add_request(p, GREEDY, request_id=f"r{i}")
    outs = {}
    while engine.has_unfinished_requests():
        outs.update({o.request_id: o.outputs[0].token_ids for o in engine.step() if o.finished})
    s = engine.get_stats()
    assert s["num_images_encoded"] == 1 and s["num_encoder_cache_hits"] == 4
    assert engine.executor.runner.encoder.num_images == 1
    alone = [llm.generate(p, GREEDY, use_tqdm=False)[0] for p in prompts]
    assert [outs[f"r{i}"] for i in range(5)] == [o.outputs[0].token_ids for o in alone]


def test_retained_entries_are_reused_then_evicted_within_budget(vlmserve_cache):
    # prefix caching off: the same prompt again would skip its image altogether
    llm = make_llm(mm_embedding_offload=True, enable_mm_cache=True,
                   enable_prefix_caching=False)
    row_bytes = llm.engine.executor.bytes_per_embedding_row
    img = make_image(112, 112, 1)  # 16 rows
    first = llm.generate(chat_prompt(llm, "Once.", [img]), GREEDY, use_tqdm=False)
    again = llm.generate(chat_prompt(llm, "Once.", [img]), GREEDY, use_tqdm=False)
    s = llm.engine.get_stats()
    assert s["num_images_encoded"] == 1 and s["num_encoder_cache_hits"] == 1
    assert first[0].outputs[0].token_ids == again[0].outputs[0].token_ids

    budget_rows = 40  # room for two 16-row images, not three
    llm = make_llm(mm_embedding_offload=True, enable_mm_cache=True,
                   mm_cache_gb=budget_rows * row_bytes / 2**30)
    for seed in range(5):
        llm.generate(chat_prompt(llm, "Next.", [make_image(112, 112, 100 + seed)]), GREEDY,
                     use_tqdm=False)
        llm.engine.step()
        s = llm.engine.get_stats()
        assert s["encoder_cache_rows"] <= budget_rows
        assert s["mm_embedding_bytes_host"] == s["encoder_cache_rows"] * row_bytes
    assert s["num_encoder_cache_evictions"] == 3 and s["encoder_cache_entries"] == 2
    # evicted entries' host rows went back to the pool in time for the next image's copy
    assert s["mm_host_pool_misses"] == 0


class _Copy:
    """Stands in for a CUDA event: the copy it marks finishes when told."""

    def __init__(self) -> None:
        self.finished = False

    def query(self) -> bool:
        return self.finished


def test_host_rows_are_carved_merged_and_reused_only_after_their_copies():
    import torch

    from vlmserve.worker.mm_embedding_store import _HostRows

    pool = _HostRows(10, 4, torch.float32, pin=False)
    a, b, c = pool.take(4), pool.take(3), pool.take(3)
    assert [t.storage_offset() // 4 for t in (a, b, c)] == [0, 4, 7]
    assert pool.take(1) is None and all(pool.owns(t) for t in (a, b, c))
    assert not pool.owns(torch.empty(3, 4))
    copy = _Copy()
    pool.give_back(a, [copy, None])
    assert pool.take(1) is None, "rows still being copied are not handed out"
    copy.finished = True
    pool.give_back(c, [None])
    assert pool.take(5) is None and pool.free == [[0, 4], [7, 3]]  # a and c, b between
    pool.give_back(b, [None])
    assert pool.take(10).storage_offset() == 0  # b merged with both neighbours
    assert pool.free == []


def test_every_byte_freed_without_cache(vlmserve_cache):
    llm = make_llm(mm_embedding_offload=True, enable_mm_cache=False)
    llm.generate(mixed_prompts(llm), GREEDY, use_tqdm=False)
    llm.engine.step()
    s = llm.engine.get_stats()
    assert s["mm_embedding_bytes_host"] == 0 and s["mm_embedding_entries"] == 0
    assert s["encoder_cache_rows"] == 0
    # what stays on the device is the two ping-pong buffers, whatever the load
    assert s["mm_embedding_bytes_device"] == 2 * 32 * llm.engine.executor.bytes_per_embedding_row


def test_ping_pong_buffers_alternate_and_are_never_overwritten_while_read(vlmserve_cache):
    llm = make_llm(mm_embedding_offload=True, max_num_batched_tokens=16)
    llm.generate(mixed_prompts(llm), GREEDY, use_tqdm=False)
    trace = llm.engine.executor.runner.store.trace
    reads = [(buf, step) for op, buf, step in trace if op == "read"]
    assert len(reads) > 10
    assert all(buf == (step - 1) % 2 for buf, step in reads), "step N reads buffer N % 2"
    last_read: dict[int, int] = {}
    for i, (op, buf, step) in enumerate(trace):
        if op == "read":
            last_read[buf] = step
        if op == "prefetch":
            # step N fills the buffer step N+1 reads, the one step N-1 read, and only after
            # waiting for the reads of that step
            assert buf == step % 2
            assert trace[i - 1] == ("wait_reads", buf, step)
            assert last_read.get(buf, -1) < step
