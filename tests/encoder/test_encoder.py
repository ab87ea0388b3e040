"""`MultimodalEncoder` against the engine: the rows it exports are bit-for-bit those the
engine's own encoder stores (float32, CPU), token ids, hashes, grids and mRoPE positions are
the engine's admission's; only the vision weights are loaded; one tower forward for all the
requests; only delivering ranks export."""

from __future__ import annotations

import msgspec
import pytest
import torch
import zmq
from safetensors import safe_open

from tests.encoder.helpers import segments, wait_until
from tests.engine.helpers import chat_prompt, make_image
from vlmserve import LLM
from vlmserve.encoder.encoder import MultimodalEncoder
from vlmserve.encoder.service import forwards
from vlmserve.models.qwen2_vl import Qwen2VLForConditionalGeneration
from vlmserve.transfer.handles import BytesHandle, ShmHandle

MODELS = ["tiny-qwen2-vl", "tiny-qwen2.5-vl", "tiny-qwen3-vl"]


def _prompts(llm) -> list[dict]:
    img = make_image
    return [
        chat_prompt(llm, "Two, one repeated later.", [img(56, 84, 1), img(112, 56, 2)]),
        chat_prompt(llm, "No image at all.", []),
        chat_prompt(llm, "Three.", [img(140, 140, 3), img(56, 84, 1), img(84, 112, 4)]),
    ]


@pytest.mark.parametrize("model", MODELS)
def test_exported_rows_equal_the_engine_encoder(vlmserve_cache, model):
    llm = LLM(model, dtype="float32", device="cpu", mm_embedding_offload=False)
    prompts = _prompts(llm)
    with MultimodalEncoder(model, dtype="float32", device="cpu") as enc:
        outputs = enc.encode(prompts)
        stats = enc.get_stats()
        assert (stats.batches, stats.encoded_images, stats.images) == (1, 4, 5)
        processed = [llm.engine.input_processor.process(p) for p in prompts]
        runner = llm.engine.core.executor.runner
        runner.encoder.run({img.mm_hash: img for p in processed for img in p.images})
        assert runner.encoder.num_batches == 1
        for out, ref in zip(outputs, processed, strict=True):
            assert out.prompt_token_ids == ref.prompt_token_ids
            assert torch.equal(out.prompt_positions, ref.prompt_positions)
            assert out.position_offset == ref.position_offset
            assert len(out.images) == len(ref.images)
            for img, want in zip(out.images, ref.images, strict=True):
                assert (img.mm_hash, img.offset, img.length, img.encoder_meta) == (
                    want.mm_hash, want.offset, want.length, tuple(want.encoder_meta))
                assert isinstance(img.handle, ShmHandle)
                assert img.handle.shape == (want.length, enc.hidden_size)
                rows = img.handle.open()
                engine_rows = runner.store.gather([(want.mm_hash, 0, want.length)])
                assert torch.equal(rows, engine_rows)  # bit for bit
        assert wait_until(lambda: enc.get_stats().ledger.live_handles == 0, 5)
        assert not segments(enc.ledger.segment_prefix())


@pytest.mark.parametrize("model", MODELS)
def test_only_the_vision_weights_are_loaded(vlmserve_cache, model):
    llm = LLM(model, dtype="float32", device="cpu")
    with MultimodalEncoder(model, dtype="float32", device="cpu") as enc:
        ckpt = {}
        for f in enc.model_path.glob("*.safetensors"):
            with safe_open(str(f), framework="pt") as fh:
                ckpt.update({n: fh.get_slice(n).get_shape() for n in fh.keys()})
        vision_numel = sum(torch.Size(s).numel() for n, s in ckpt.items()
                           if n.startswith(Qwen2VLForConditionalGeneration.encoder_prefixes))
        total_numel = sum(torch.Size(s).numel() for s in ckpt.values())
        params = dict(enc.vision.named_parameters())
        assert sum(p.numel() for p in params.values()) == vision_numel < total_numel
        full = llm.engine.core.executor.runner.model
        assert params.keys() == {f"visual.{n}" for n, _ in full.visual.named_parameters()}
        for name, p in full.visual.named_parameters():
            assert torch.equal(params[f"visual.{name}"], p), name
        assert not hasattr(enc, "language_model") and not hasattr(enc.vision, "lm_head")


def test_bytes_transport(vlmserve_cache):
    with MultimodalEncoder("tiny-qwen2-vl", dtype="float32", device="cpu") as enc:
        prompt = {"prompt": "<|vision_start|><|image_pad|><|vision_end|>Hi.",
                  "multi_modal_data": {"image": [make_image(84, 56, 0)]}}
        shm, = enc.encode([prompt])[0].images
        raw, = enc.encode([prompt], transport="bytes")[0].images
        assert isinstance(raw.handle, BytesHandle)
        assert len(segments(enc.ledger.segment_prefix())) == 1  # the shared-memory handle's
        assert torch.equal(raw.handle.open(), shm.handle.open())
        assert wait_until(lambda: enc.get_stats().ledger.live_handles == 0, 5)


def test_only_delivering_ranks_export(vlmserve_cache):
    """A follower rank (rank 1) finishes its requests with no handle; with the rule off (the
    negative control) it exports handles that nobody opens: they stay live until the lease."""
    prompt = {"prompt": "<|vision_start|><|image_pad|><|vision_end|>Hi.",
              "multi_modal_data": {"image": [make_image(56, 56, 0)]}}
    with MultimodalEncoder("tiny-qwen2-vl", dtype="float32", device="cpu", rank=1) as follower:
        assert not follower.delivers
        outs = follower.encode([prompt] * 4)
        assert all(img.handle is None for o in outs for img in o.images)
        s = follower.get_stats()
        assert (s.handles_not_exported, s.ledger.exported, s.ledger.live_handles) == (4, 0, 0)
        assert not segments(follower.ledger.segment_prefix())
        assert outs[0].prompt_token_ids and outs[0].images[0].length == 4
        forced = follower.encode([prompt], export=True)  # an explicit call still exports
        assert forced[0].images[0].handle is not None
        forced[0].release()
    with MultimodalEncoder("tiny-qwen2-vl", dtype="float32", device="cpu", rank=1,
                           export_only_delivered=False, lease_s=60) as leaky:
        for _ in range(3):
            leaky.encode([prompt] * 4)  # the caller never sees these
        s = leaky.get_stats().ledger
        assert (s.exported, s.live_handles) == (12, 12)  # the leak the rule prevents
        assert len(segments(leaky.ledger.segment_prefix())) == 12
        assert s.live_bytes == 12 * 4 * leaky.hidden_size * 4


def test_encoder_server_forwards_are_bounded_in_rows_and_keep_arrival_order() -> None:
    """The encoder server's waiting jobs go to the tower in forwards of at most the budget's
    image rows (a larger job alone), one handle kind per forward, in arrival order."""
    from vlmserve.encoder.service import EncodeJob, forwards
    from vlmserve.transfer.wire import PixelImage

    def job(name: str, *lengths: int, transport: str = "shm") -> EncodeJob:
        images = [PixelImage(mm_hash=name, encoder_meta=(), length=n, shape=(1, 1, 3),
                             pixels=b"abc") for n in lengths]
        return EncodeJob(ord(name), transport, images)

    jobs = [job("a", 300, 200), job("b", 400), job("c", 2000), job("d", 100, transport="bytes"),
            job("e", 100), job("f"), job("g", 500)]
    got = [[chr(j.job_id) for j in g] for g in forwards(jobs, 1000)]
    assert got == [["a", "b"], ["c"], ["e", "f", "g"], ["d"]]


def test_launched_forwards_finish_in_any_interleaving(vlmserve_cache):
    """`launch` queues a forward and `finish` exports it, so the encoder server launches the
    next forward before exporting the last: two launched, then finished in order, give the
    rows `encode` gives each alone."""
    llm = LLM("tiny-qwen2-vl", dtype="float32", device="cpu", mm_embedding_offload=False)
    first, second = _prompts(llm)[0], _prompts(llm)[2]
    with MultimodalEncoder("tiny-qwen2-vl", dtype="float32", device="cpu") as enc:
        want = [[img.handle.open() for img in enc.encode([p])[0].images]
                for p in (first, second)]
        a, b = enc.launch([first]), enc.launch([second], transport="bytes")
        got = [[img.handle.open() for img in enc.finish(work)[0].images] for work in (a, b)]
        assert [len(rows) for rows in got] == [2, 3]
        for rows, ref in zip(got, want, strict=True):
            assert all(torch.equal(r, w) for r, w in zip(rows, ref, strict=True))
        handles = [img.handle for img in enc.finish(enc.launch([first], transport="bytes"))[0]
                   .images]
        assert all(isinstance(h, BytesHandle) for h in handles)
        assert all(torch.equal(h.open(), w) for h, w in zip(handles, want[0], strict=True))
        assert wait_until(lambda: enc.get_stats().ledger.live_handles == 0, 5)


def test_the_encoder_core_fails_only_the_offending_job(vlmserve_cache, tmp_path):
    """Jobs the front end should have refused (pixels that do not fit their shape, a grid
    the tower cannot take) reach the encoder core beside a good one in one round: each bad
    job is answered with its error, the good one with its handle, and the core goes on."""
    from vlmserve.encoder.service import EncodeJob, EncoderCoreProc, JobDone
    from vlmserve.transfer.wire import from_wire, pixel_image

    llm = LLM("tiny-qwen2-vl", dtype="float32", device="cpu", mm_embedding_offload=False)
    good = pixel_image(llm.engine.input_processor.process(_prompts(llm)[0]).images[0])
    with MultimodalEncoder("tiny-qwen2-vl", dtype="float32", device="cpu") as enc:
        ctx = zmq.Context()
        sock = ctx.socket(zmq.ROUTER)
        sock.bind(f"ipc://{tmp_path}/core")
        proc = EncoderCoreProc(enc, sock)
        answers: dict[int, JobDone] = {}
        proc._send = lambda identity, msg: answers.__setitem__(msg.job_id, msg)
        bad_shape = msgspec.structs.replace(good, mm_hash="a" * 64, shape=(-1, -1, 3),
                                            pixels=b"\x07" * 3)
        bad_grid = msgspec.structs.replace(good, mm_hash="b" * 64, encoder_meta=(1, 2, 2))
        jobs = [EncodeJob(i, "bytes", [img]) for i, img in
                enumerate([good, bad_shape, bad_grid, good])]
        try:
            for job in jobs:
                proc.sender[id(job)] = b"front end"
            launched = [proc._launch(group) for group in forwards(jobs, 10_000)]
            proc._finish_all([item for item in launched if item is not None])
        finally:
            proc.close()
            sock.close(0)
            ctx.term()
        assert sorted(answers) == [0, 1, 2, 3] and not proc.sender
        for i in (1, 2):
            assert answers[i].error is not None and answers[i].handles == []
        for i in (0, 3):
            assert answers[i].error is None
            assert from_wire(answers[i].handles[0]).open().shape[0] == good.length
