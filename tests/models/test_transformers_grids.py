"""The transformers backend reads image grids on the host (`models/transformers_grids.py`):
small integer tensors travel as values in ``encoder_meta``; transformers' vision helpers,
wrapped where a loaded model calls them, put their results on the device only once computed
(the device here is ``meta``: a device that is not the host, on the CPU); a tower that cannot
take a host grid falls back to device grids with its output unchanged. (Greedy parity of every
architecture with its grids on the host: tests/models/test_transformers_backend.py; the
launch never waiting for the device on CUDA: tests/gpu/test_no_sync.py.)"""

from __future__ import annotations

import pytest
import torch

from tests.engine.helpers import chat_prompt, make_image
from vlmserve import LLM
from vlmserve.models.transformers_grids import host_copy, host_grids, wrap_vision_helpers
from vlmserve.models.transformers_packing import pack_image, unpack_meta, unpack_tensors

pytest.importorskip("torchvision", reason="the Qwen processors of transformers 5 need it")


def test_small_integer_tensors_travel_as_values_in_the_meta():
    pixels = torch.arange(24, dtype=torch.float32).view(4, 6)
    grid = torch.tensor([[1, 4, 6]])
    big = torch.arange(100, dtype=torch.int64)  # more values than the meta carries
    data, meta = pack_image({"pixel_values": pixels, "image_grid_thw": grid,
                             "num_patches": big}, [7, 7, 7], image_token_id=7)
    layout = unpack_meta(meta)
    assert data.numel() == layout.nbytes == pixels.nbytes + big.nbytes
    out = unpack_tensors(data, layout)
    assert out["image_grid_thw"].device.type == "cpu"
    assert out["image_grid_thw"].dtype == torch.int64
    assert out["image_grid_thw"].tolist() == [[1, 4, 6]]
    assert torch.equal(out["pixel_values"], pixels) and torch.equal(out["num_patches"], big)
    assert layout.num_image_tokens == 3 and layout.text_tokens == ()


def test_floating_tensors_travel_in_the_models_dtype():
    """The tower casts an image's floating tensors to the model's dtype: carried in it, they
    take half the bytes of float32 with the same values; integers stay as they are."""
    pixels = torch.linspace(-2.5, 2.5, 35, dtype=torch.float32).view(5, 7)  # odd: padded
    big = torch.arange(100, dtype=torch.int64)
    data, meta = pack_image({"pixel_values": pixels, "num_patches": big}, [7], 7,
                            float_dtype=torch.bfloat16)
    layout = unpack_meta(meta)
    assert data.numel() == layout.nbytes == 72 + big.nbytes  # 70 bytes, padded to 8
    assert data[70:72].tolist() == [0, 0]
    out = unpack_tensors(data, layout)
    assert out["pixel_values"].dtype == torch.bfloat16
    assert torch.equal(out["pixel_values"], pixels.to(torch.bfloat16))
    assert torch.equal(out["num_patches"], big)


def test_the_processor_carries_pixels_in_the_engines_dtype(vlmserve_cache):
    from vlmserve.config import ModelConfig
    from vlmserve.models.metadata import load_model_processor

    image = make_image(64, 48, seed=3)
    sizes = {}
    for dtype in ("float32", "bfloat16"):
        _, _, proc = load_model_processor(ModelConfig(
            model="tiny-qwen2-vl", model_impl="transformers", device="cpu", dtype=dtype))
        prompt = proc.apply_chat_template([{"role": "user", "content": [
            {"type": "image"}, {"type": "text", "text": "What is it?"}]}])
        (img,) = proc.process(prompt, None, [image]).images
        tensors = unpack_tensors(img.pixels, unpack_meta(img.encoder_meta))
        assert tensors["pixel_values"].dtype == getattr(torch, dtype)
        sizes[dtype] = img.pixels.numel()
    assert sizes["bfloat16"] * 2 == sizes["float32"]


@pytest.fixture(scope="module")
def qwen_backend(vlmserve_cache):
    return LLM("tiny-qwen2-vl", dtype="float32", device="cpu", model_impl="transformers",
               max_num_seqs=4)


def test_helpers_compute_on_the_host_and_hand_the_device_their_results(qwen_backend):
    from transformers.models.qwen2_vl import modeling_qwen2_vl as m
    from transformers.utils.generic import get_max_seqlen
    from transformers.vision_utils import get_vision_position_ids

    model = qwen_backend.engine.executor.runner.model
    assert model.grids.on and wrap_vision_helpers(model.hf)  # wrapped once, found again
    grid = torch.tensor([[1, 4, 6], [2, 2, 2]])
    want = get_vision_position_ids(grid, 2)
    assert torch.equal(m.get_vision_position_ids(grid, 2), want)  # outside: as written
    with host_grids(torch.device("meta")):
        pos = m.get_vision_position_ids(grid, 2)
        cu, _ = m.get_vision_attention_seqlens(grid, model.hf.config.vision_config)
        assert pos.device.type == "meta" and cu.device.type == "meta"
        assert torch.equal(host_copy(pos), want)
        assert host_copy(cu).tolist() == [0, 24, 28, 32]
        # the longest segment from the host copy (flash's path reads it back otherwise)
        config = model.hf.config.vision_config
        assert m.get_max_seqlen(cu, config) == get_max_seqlen(host_copy(cu), config)


def test_a_tower_that_cannot_take_host_grids_falls_back_unchanged(qwen_backend):
    llm = qwen_backend
    model = llm.engine.executor.runner.model
    prompt = chat_prompt(llm, "Describe them.", [make_image(56, 84, 901), make_image(84, 56, 902)])
    images = llm.engine.input_processor.process(prompt).images
    pixels = torch.cat([img.pixels.reshape(-1) for img in images])
    metas = [img.encoder_meta for img in images]
    want = model.encode_images(pixels, metas)
    features, grids_seen = model._features, []

    def mixing(**kwargs):
        grids_seen.append(model.grids.on)
        if model.grids.on:  # as a tower mixing a host grid with device tensors does
            raise RuntimeError("Expected all tensors to be on the same device")
        return features(**kwargs)

    model._features = mixing
    try:
        got = model.encode_images(pixels, metas)
        assert grids_seen == [True, False] and not model.grids.on
        assert torch.equal(got, want)
        assert torch.equal(model.encode_images(pixels, metas), want)  # device grids from then on
        assert grids_seen == [True, False, False]
    finally:
        model._features = features
        model.grids.on = True
