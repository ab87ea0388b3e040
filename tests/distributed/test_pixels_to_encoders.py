"""Tensor parallelism, the vision tower's data mode: a step's pixels travel only to the rank
that encodes them. Two ranks in real processes over gloo, each with its EncoderRunner: rank 0
broadcasts the step as the executor does (no pixels), sends rank 1 the pixels of its share,
and both end with every image's rows, equal to one process's encode."""

from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import socket

import pytest
import torch

from tests.engine.helpers import make_image
from vlmserve.core.scheduler_output import SchedulerOutput
from vlmserve.distributed.parallel_state import init_tensor_parallel, split_by_rows
from vlmserve.executor.multiproc import without_pixels
from vlmserve.models.builtin import resolve_model
from vlmserve.models.loader import load_hf_config, load_model
from vlmserve.models.registry import resolve_model_class
from vlmserve.multimodal.inputs import ImageInput, encoder_order
from vlmserve.worker.encoder_runner import EncoderRunner
from vlmserve.worker.mm_embedding_store import MMEmbeddingStore

CPU = torch.device("cpu")
SIZES = [(84, 84), (140, 84), (56, 112), (84, 84), (56, 56)]  # (width, height)


def _runner(path, tp) -> EncoderRunner:
    model = load_model(path, load_hf_config(path), torch.float32, CPU, tp)
    store = MMEmbeddingStore(CPU, model.hidden_size, torch.float32)
    return EncoderRunner(model, CPU, torch.float32, store, tp)


def _rank(rank: int, init_method: str, path, images: list[ImageInput] | None, out) -> None:
    tp = init_tensor_parallel(rank, 2, init_method, CPU, timeout_s=60)
    runner = _runner(path, tp)
    with torch.inference_mode():
        for _ in range(2):  # the second step: every image already stored, nothing travels
            if rank == 0:
                so = SchedulerOutput(encoder_inputs={img.mm_hash: img for img in images})
                tp.broadcast_object(without_pixels(so))
            else:
                so = tp.broadcast_object()
                assert all(img.pixels.device.type == "meta" for img in so.encoder_inputs.values()
                           if img.embeds is None)
            runner.run(so.encoder_inputs)
    rows = {h: runner.store.gather([(h, 0, img.length)])
            for h, img in so.encoder_inputs.items()}
    torch.save({"rows": rows, "received": runner.pixel_bytes_received,
                "own": runner.num_own_images, "encoded": runner.num_images}, out / f"{rank}.pt")
    tp.barrier()
    # results are out: leave without the interpreter's teardown, where gloo's threads now and
    # then aborted a rank whose peer had gone first ("terminate called without an active
    # exception"; the engine's own ranks are daemons that rank 0 outlives)
    os._exit(0)


@pytest.mark.parametrize("model", ["tiny-qwen2-vl", "tiny-llava-next"])
def test_a_follower_receives_only_its_shares_pixels(vlmserve_cache, tmp_path, model):
    path = resolve_model(model)
    hf_config = load_hf_config(path)
    processor = resolve_model_class(hf_config).input_processor_cls(path, hf_config)
    parts = [{"type": "image"}] * len(SIZES) + [{"type": "text", "text": "Describe."}]
    text = processor.apply_chat_template([{"role": "user", "content": parts}])
    images = processor.process(text, None, [make_image(w, h, i)
                                            for i, (w, h) in enumerate(SIZES)]).images
    # what rank 1 is to encode (the split every rank computes) and the bytes of its pixels
    pixel_images = encoder_order(images)
    shares = split_by_rows([img.length for img in pixel_images], 2)
    share = shares[1]
    # one process: each rank's share in one forward, as that rank runs it (a batch of other
    # images would round differently), and one image that came encoded (an encoder
    # service's rows): no pixels for anyone
    runner = _runner(path, None)
    embedded = ImageInput("encoded-elsewhere", 0, 3, torch.empty(0, dtype=torch.uint8), (),
                          None, embeds=torch.randn(3, runner.model.hidden_size))
    images = [*images, embedded]
    with torch.inference_mode():
        for part in [*([pixel_images[i] for i in share] for share in shares), [embedded]]:
            runner.run({img.mm_hash: img for img in part})
    expected = {img.mm_hash: runner.store.gather([(img.mm_hash, 0, img.length)])
                for img in images}
    share_bytes = sum(pixel_images[i].pixels.nbytes for i in share)
    total_bytes = sum(img.pixels.nbytes for img in pixel_images)
    assert 0 < len(share) < len(pixel_images) and 0 < share_bytes < total_bytes
    message = pickle.dumps(without_pixels(SchedulerOutput(
        encoder_inputs={img.mm_hash: img for img in images[:-1]})))
    assert len(message) < min(img.pixels.nbytes for img in pixel_images)

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        init_method = f"tcp://127.0.0.1:{s.getsockname()[1]}"
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_rank, args=(r, init_method, path, images if r == 0 else None,
                                              tmp_path)) for r in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
        assert p.exitcode == 0
    ranks = [torch.load(tmp_path / f"{r}.pt") for r in range(2)]
    assert ranks[1]["received"] == share_bytes  # its share's pixels, once, nothing more
    assert ranks[0]["received"] == 0
    assert ranks[1]["own"] == len(share) and ranks[0]["own"] == len(pixel_images) - len(share)
    for got in ranks:
        assert got["encoded"] == len(pixel_images)
        assert got["rows"].keys() == expected.keys()
        for h, rows in expected.items():
            torch.testing.assert_close(got["rows"][h], rows, rtol=0, atol=0)
