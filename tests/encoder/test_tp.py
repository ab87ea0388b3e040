"""A tensor-parallel `MultimodalEncoder` (real spawned ranks, gloo on the CPU): its rows equal
the single-rank encoder's; only rank 0, whose outputs the caller gets, exports handles, so
the follower holds nothing after many requests (the bug of TensorRT-LLM's encoder-only
executor: every rank exported CUDA IPC handles, only rank 0's were ever opened); with the rule
off (the negative control) the follower's unopened handles pile up until their lease; a
follower that dies or stops answering makes the next call fail with a clear error, no hang."""

from __future__ import annotations

import os
import signal

import pytest
import torch

from tests.encoder.helpers import segments, wait_until
from tests.engine.helpers import make_image
from vlmserve.distributed.parallel_state import split_by_rows
from vlmserve.encoder import EncoderRankError
from vlmserve.encoder.encoder import MultimodalEncoder

MODELS = ["tiny-qwen2-vl", "tiny-qwen2.5-vl"]
OPTIONS = {"dtype": "float32", "device": "cpu"}


def _prompt(images) -> dict:
    pads = "<|vision_start|><|image_pad|><|vision_end|>" * len(images)
    return {"prompt": f"<|im_start|>user\n{pads}Describe.<|im_end|>\n<|im_start|>assistant\n",
            "multi_modal_data": {"image": images}}


def _prompts() -> list[dict]:
    """Four requests: images of five sizes, two of them repeated (in one request and across
    requests), one request without an image."""
    img = make_image
    return [
        _prompt([img(56, 84, 1), img(112, 56, 2)]),
        _prompt([]),
        _prompt([img(140, 140, 3), img(56, 84, 1), img(84, 112, 4)]),
        _prompt([img(112, 56, 2), img(56, 56, 5), img(56, 56, 5)]),
    ]


def _follower_segments(enc) -> list[str]:
    """Shared-memory segments of the followers' ledgers (named after their pid)."""
    return [n for pid in enc.followers.pids for n in segments(f"vlms-{pid}x")]


@pytest.fixture(scope="module")
def tp2(vlmserve_cache):
    """``tp2(model)``: one TP=2 encoder per model for the module."""
    encoders: dict[str, MultimodalEncoder] = {}

    def get(model: str) -> MultimodalEncoder:
        if model not in encoders:
            encoders[model] = MultimodalEncoder(model, tensor_parallel_size=2, **OPTIONS)
        return encoders[model]

    yield get
    for enc in encoders.values():
        enc.shutdown()


def test_split_by_rows_is_balanced_and_deterministic():
    assert split_by_rows([25, 12, 8, 6], 2) == [[0], [1, 2, 3]]  # 25 vs 26 rows
    assert split_by_rows([4, 4, 4, 4, 4], 2) == [[0, 2, 4], [1, 3]]
    assert split_by_rows([9], 3) == [[0], [], []]
    assert split_by_rows([], 2) == [[], []]
    shares = split_by_rows([30, 20, 20, 10, 10, 10, 5], 3)
    assert sorted(i for s in shares for i in s) == list(range(7))
    assert all(s == sorted(s) for s in shares)  # each share keeps the largest-first order


@pytest.mark.parametrize("model", MODELS)
def test_tp2_rows_equal_tp1(tp2, model):
    """Several requests (repeated and different-size images) in one call: the outputs of the
    TP=2 encoder (rows read through its handles) are the TP=1 encoder's; each rank encoded
    its share (one forward each), rank 0 exported a handle per image, rank 1 none."""
    prompts = _prompts()
    with MultimodalEncoder(model, **OPTIONS) as ref:
        want = ref.encode(prompts)
        want_rows = [[img.handle.open() for img in o.images] for o in want]
    enc = tp2(model)
    before = enc.get_stats()
    got = enc.encode(prompts)
    assert len(got) == len(want)
    for out, ref_out, ref_rows in zip(got, want, want_rows, strict=True):
        assert out.prompt_token_ids == ref_out.prompt_token_ids
        assert torch.equal(out.prompt_positions, ref_out.prompt_positions)
        assert out.position_offset == ref_out.position_offset
        assert len(out.images) == len(ref_out.images)
        for img, ref_img, rows in zip(out.images, ref_out.images, ref_rows, strict=True):
            assert (img.mm_hash, img.offset, img.length, img.encoder_meta) == (
                ref_img.mm_hash, ref_img.offset, ref_img.length, ref_img.encoder_meta)
            got_rows = img.handle.open()
            assert got_rows.shape == (img.length, enc.hidden_size)
            # another batch composition per rank: equal up to float32 GEMM blocking
            torch.testing.assert_close(got_rows, rows, rtol=1e-5, atol=1e-5)
    s = enc.get_stats()
    r0, r1 = s.ranks
    n_images, n_distinct = 8, 5
    assert r0.ledger.exported - before.ranks[0].ledger.exported == n_images
    assert r1.ledger.exported == 0 and r1.ledger.live_handles == 0
    assert r1.handles_not_exported - before.ranks[1].handles_not_exported == n_images
    shares = [r.encoded_images - b.encoded_images for r, b in zip(s.ranks, before.ranks)]
    assert sum(shares) == n_distinct and min(shares) >= 1
    assert [r.batches - b.batches for r, b in zip(s.ranks, before.ranks)] == [1, 1]
    assert (s.requests, s.encoded_images) == (r0.requests, r0.encoded_images)
    assert wait_until(lambda: enc.get_stats().ledger.live_handles == 0, 5)
    assert not segments(enc.ledger.segment_prefix()) and not _follower_segments(enc)


def test_follower_exports_nothing_over_20_requests(tp2):
    """20 calls: the follower finishes each with no handle (0 exported, 0 held); rank 0's
    handles are all released once the consumer opens them: live 0, no segment left."""
    enc = tp2("tiny-qwen2-vl")
    before = enc.get_stats()
    for i in range(20):
        out, = enc.encode([_prompt([make_image(56, 56 + 28 * (i % 3), 100 + i),
                                    make_image(84, 56, 7)])])
        for img in out.images:
            assert img.handle.open().shape == (img.length, enc.hidden_size)
        f = enc.get_stats().ranks[1]
        assert (f.ledger.exported, f.ledger.live_handles, f.ledger.live_bytes) == (0, 0, 0)
        assert not _follower_segments(enc)
    s = enc.get_stats()
    f = s.ranks[1]
    assert f.requests - before.ranks[1].requests == 20
    assert f.handles_not_exported - before.ranks[1].handles_not_exported == 40
    assert s.ledger.exported - before.ledger.exported == 40
    assert wait_until(lambda: enc.get_stats().ledger.live_handles == 0, 5)
    s = enc.get_stats()
    assert (s.ledger.live_bytes, s.ledger.reclaimed) == (0, 0)
    assert s.ledger.released == s.ledger.exported
    assert not segments(enc.ledger.segment_prefix())


def test_a_failed_share_fails_the_call_and_the_ranks_stay_in_step(tp2, monkeypatch):
    """Rank 0's share raising: the call raises that error on rank 0 (the follower, told,
    drops the call), and the next call works."""
    enc = tp2("tiny-qwen2-vl")
    prompt = _prompt([make_image(56, 56, 500), make_image(84, 56, 501)])

    def tower_fails(unique):
        raise RuntimeError("tower failed on rank 0")

    monkeypatch.setattr(enc, "_run_tower", tower_fails)
    with pytest.raises(RuntimeError, match="tower failed on rank 0"):
        enc.encode([prompt])
    monkeypatch.undo()
    out, = enc.encode([prompt])
    assert [img.handle.open().shape[0] for img in out.images] == [4, 6]
    assert enc.get_stats().ranks[1].ledger.exported == 0


def test_negative_control_follower_leaks_until_the_lease(vlmserve_cache):
    """``export_only_delivered=False``: the follower exports a handle per image too; nobody
    opens or releases them, so each stays until the lease (1 s) reclaims it (the leak);
    shutdown leaves no segment on either rank."""
    lease = 1.0
    enc = MultimodalEncoder("tiny-qwen2-vl", tensor_parallel_size=2, lease_s=lease,
                            export_only_delivered=False, **OPTIONS)
    try:
        for i in range(3):
            out, = enc.encode([_prompt([make_image(56, 56, 200 + i), make_image(84, 56, 7)])])
            for img in out.images:
                img.handle.open()
            f = enc.get_stats().ranks[1].ledger
            assert f.exported == 2 * (i + 1)
            # none opened or released: each is live until the lease reclaims it
            assert (f.opened, f.released) == (0, 0)
            assert f.live_handles + f.reclaimed == f.exported
        assert wait_until(lambda: enc.get_stats().ranks[1].ledger.live_handles == 0)
        f = enc.get_stats().ranks[1]
        assert (f.ledger.reclaimed, f.ledger.opened, f.ledger.live_bytes) == (6, 0, 0)
        assert not _follower_segments(enc)
        s = enc.get_stats().ledger
        assert (s.exported, s.released, s.reclaimed) == (6, 6, 0)
        enc.encode([_prompt([make_image(56, 56, 300)])])  # left unopened on both ranks
        # the follower exports after rank 0 has returned: its stats come after its call
        f = enc.get_stats().ranks[1].ledger
        assert f.exported == 7 and f.live_handles + f.reclaimed == 7
        s = enc.ledger.stats()
        assert s.exported == 7 and s.live_handles + s.reclaimed == 1
    finally:
        enc.shutdown()
    assert not _follower_segments(enc) and not segments(enc.ledger.segment_prefix())
    assert all(p.exitcode == 0 for p in enc.followers.procs)


@pytest.mark.parametrize("how", ["killed", "stopped"])
def test_dead_follower_gives_a_clear_error(vlmserve_cache, how):
    """A follower killed (SIGKILL) or stopped (SIGSTOP, no answer) between calls: the next
    call raises `EncoderRankError` saying what happened, within ``tp_timeout_s`` (2 s), and
    so does every later call; shutdown still cleans up."""
    timeout = 2.0
    enc = MultimodalEncoder("tiny-qwen2-vl", tensor_parallel_size=2, tp_timeout_s=timeout,
                            **OPTIONS)
    prompt = _prompt([make_image(56, 56, 400), make_image(84, 56, 401)])
    try:
        enc.encode([prompt])[0].release()
        pid = enc.followers.pids[0]
        os.kill(pid, signal.SIGKILL if how == "killed" else signal.SIGSTOP)
        why = "rank 1 .* exited with code -9" if how == "killed" else "no answer within 2 s"
        with pytest.raises(EncoderRankError, match=why):
            enc.encode([prompt])
        with pytest.raises(EncoderRankError, match="shut it down"):
            enc.encode([prompt])
        with pytest.raises(EncoderRankError):
            enc.get_stats()
    finally:
        enc.shutdown()
    assert not any(p.is_alive() for p in enc.followers.procs)
    assert not segments(enc.ledger.segment_prefix())
