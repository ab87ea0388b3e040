"""LLaVA-NeXT pieces vs transformers: anyres token counts and tiles, the packed image features
(base tile, unpadded grid, image_newline rows), weight loading, the built-in checkpoints."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
import transformers
from transformers import AutoConfig, AutoProcessor
from transformers.image_processing_utils import select_best_resolution as hf_select

from tests.models.test_llava import chat, hf_processor, random_image  # noqa: F401
from vlmserve.errors import InvalidRequestError
from vlmserve.models import builtin
from vlmserve.models.builtin import build_config, create_checkpoint, resolve_model
from vlmserve.models.llava_next_processing import (
    LlavaNextInputProcessor,
    num_image_tokens,
    select_best_resolution,
)
from vlmserve.models.loader import load_model
from vlmserve.multimodal.inputs import pixel_values


@pytest.fixture(scope="module")
def path(vlmserve_cache) -> Path:
    return resolve_model("tiny-llava-next")


@pytest.fixture(scope="module")
def processor(path: Path) -> LlavaNextInputProcessor:
    return LlavaNextInputProcessor(path)


def test_chat_template(processor) -> None:
    assert processor.apply_chat_template(chat(2, "What?")) == \
        "[INST] <image>\n<image>\nWhat? [/INST]"
    assert processor.apply_chat_template([{"role": "user", "content": "Hi"}]) == \
        "[INST] Hi [/INST]"


def test_token_counts_match_transformers_for_50_sizes(processor, hf_processor) -> None:  # noqa: F811
    """Our token ids (every <image> expanded to its anyres count) equal LlavaNextProcessor's
    for 50 random sizes, one to three images a prompt; every grid of the pinpoints is picked
    and unpadding removes rows and columns."""
    rng = np.random.default_rng(0)
    grids, counts = set(), set()
    for i in range(50):
        n = 1 + i % 3
        sizes = [(int(rng.integers(4, 400)), int(rng.integers(4, 400))) for _ in range(n)]
        images = [random_image(h, w, i * 3 + j) for j, (h, w) in enumerate(sizes)]
        text = processor.apply_chat_template(chat(n))
        ours = processor.process(text, None, images)
        ref = hf_processor(images=images, text=text, return_tensors="pt")
        assert ours.prompt_token_ids == ref["input_ids"][0].tolist()
        for img, (h, w) in zip(ours.images, sizes, strict=True):
            assert img.encoder_meta[1:] == (h, w)
            grids.add(hf_select((h, w), processor.pinpoints))
            counts.add(img.length)
    assert grids == set(processor.pinpoints)
    assert len(counts) > 10 and max(counts) <= processor.max_image_tokens == 88


def test_select_best_resolution_matches_transformers() -> None:
    pinpoints = [(336, 672), (672, 336), (672, 672), (1008, 336), (336, 1008)]
    rng = np.random.default_rng(1)
    for _ in range(500):
        h, w = int(rng.integers(1, 3000)), int(rng.integers(1, 3000))
        assert select_best_resolution(h, w, pinpoints) == hf_select((h, w), pinpoints)
    # llava-v1.6's largest image: 576 base + 48 rows of 48 features and a newline
    assert num_image_tokens(672, 672, pinpoints, 336, 24) == 2928


@pytest.mark.parametrize("size", [(56, 56), (60, 90), (200, 50), (17, 400), (333, 334), (5, 3),
                                  (112, 56), (130, 131)])
def test_pixels_match_transformers_bit_for_bit(processor, hf_processor, size) -> None:  # noqa: F811
    image = random_image(*size, seed=sum(size))
    ours = processor.process(processor.apply_chat_template(chat(1)), None, [image])
    ref = hf_processor.image_processor(images=[image], return_tensors="pt")["pixel_values"][0]
    img = ours.images[0]
    assert img.pixels.dtype == torch.uint8 and img.pixels.shape[1:] == (56, 56, 3)
    assert img.encoder_meta[0] == img.pixels.shape[0] == ref.shape[0]
    assert torch.equal(pixel_values(ours.images), ref)


def test_images_of_different_tile_counts_batch(processor) -> None:
    """Tile stacks of several images through one `pixel_values` call: image after image."""
    images = [random_image(60, 200, 1), random_image(120, 110, 2), random_image(50, 100, 3)]
    out = processor.process(processor.apply_chat_template(chat(3)), None, images)
    assert sorted(i.pixels.shape[0] for i in out.images) == [3, 4, 5]
    whole = pixel_values(out.images)
    parts = torch.cat([pixel_values([i]) for i in out.images])
    assert torch.equal(whole, parts)


def test_placeholders_given_expanded_or_wrong(processor) -> None:
    a, b = random_image(50, 60), random_image(70, 140, 1)
    text = processor.apply_chat_template(chat(2))
    once = processor.process(text, None, [a, b])
    again = processor.process(None, once.prompt_token_ids, [a, b])  # already expanded
    assert again.prompt_token_ids == once.prompt_token_ids
    assert [i.offset for i in again.images] == [i.offset for i in once.images]
    with pytest.raises(InvalidRequestError, match="2 image placeholder token.*3 image"):
        processor.process(text, None, [a, b, a])
    tid = processor.image_token_id
    n = processor.num_image_tokens(50, 60)
    with pytest.raises(InvalidRequestError, match="placeholder"):
        processor.process(None, [1] + [tid] * (n - 1), [a])
    m = processor.num_image_tokens(70, 140)
    assert n != m
    with pytest.raises(InvalidRequestError, match="placeholder"):  # counts in the wrong order
        processor.process(None, [1] + [tid] * m + [5] + [tid] * n, [a, b])
    ok = processor.process(None, [1] + [tid] * (n + m) + [5], [a, b])  # one run, two images
    assert [i.offset for i in ok.images] == [1, 1 + n]


def test_hashes_follow_content(processor) -> None:
    a, b = random_image(50, 60, 1), random_image(50, 60, 2)
    out = processor.process(processor.apply_chat_template(chat(3)), None, [a, b, a])
    hashes = [i.mm_hash for i in out.images]
    assert hashes[0] == hashes[2] != hashes[1]


def test_image_features_match_transformers(path: Path) -> None:
    """Packed rows (base tile, unpadded grid rows each ended by image_newline) equal
    `get_image_features` for images whose unpadding trims rows, columns, or nothing."""
    hf = transformers.LlavaNextForConditionalGeneration.from_pretrained(path).eval()
    ours = load_model(path, AutoConfig.from_pretrained(path), torch.float32, torch.device("cpu"))
    proc = LlavaNextInputProcessor(path)
    images = [random_image(h, w, h + w) for h, w in [(60, 200), (112, 112), (37, 90), (300, 70)]]
    out = proc.process(proc.apply_chat_template(chat(4)), None, images)
    tiles = [pixel_values([img]) for img in out.images]
    batch = torch.zeros(len(tiles), max(t.shape[0] for t in tiles), 3, 56, 56)
    for i, t in enumerate(tiles):
        batch[i, :t.shape[0]] = t
    sizes = torch.tensor([img.encoder_meta[1:] for img in out.images])
    with torch.no_grad():
        rows = ours.encode_images(torch.cat(tiles), [img.encoder_meta for img in out.images])
        ref = torch.cat(hf.model.get_image_features(pixel_values=batch,
                                                    image_sizes=sizes).pooler_output)
    assert rows.shape == ref.shape == (sum(i.length for i in out.images), 64)
    torch.testing.assert_close(rows, ref, rtol=0, atol=1e-5)


def test_loads_the_hub_layout(tmp_path: Path, path: Path) -> None:
    """llava-hf's checkpoints name weights `language_model.model.*`,
    `vision_tower.vision_model.*`, `image_newline`, `language_model.lm_head.*`."""
    from safetensors.torch import load_file, save_file

    hub = {}
    for name, t in load_file(path / "model.safetensors").items():
        if name.startswith("vision_tower."):
            name = "vision_tower.vision_model." + name[len("vision_tower."):]
        hub[name] = t
    assert "image_newline" in hub and "language_model.lm_head.weight" in hub
    save_file(hub, tmp_path / "model.safetensors")
    config = AutoConfig.from_pretrained(path)
    a = load_model(path, config, torch.float32, torch.device("cpu"))
    b = load_model(tmp_path, config, torch.float32, torch.device("cpu"))
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)
    assert a.image_newline.abs().max() > 0.05
    with pytest.raises(KeyError, match="unexpected"):
        b.load_weights([("image_newline2", torch.zeros(1))])


def test_builtin_checkpoint(path: Path) -> None:
    hf = transformers.LlavaNextForConditionalGeneration.from_pretrained(path)
    cfg = hf.config
    tok = AutoProcessor.from_pretrained(path).tokenizer
    assert tok.convert_ids_to_tokens([cfg.image_token_id, tok.bos_token_id, tok.eos_token_id]) \
        == ["<image>", "<s>", "</s>"]
    assert cfg.text_config.model_type == "mistral" and cfg.text_config.sliding_window is None
    assert cfg.image_grid_pinpoints == [[56, 112], [112, 56], [112, 112], [168, 56], [56, 168]]
    assert not hf.lm_head.weight[cfg.image_token_id].any()
    assert 0.15 < hf.model.image_newline.std() < 0.25


def test_builtin_is_deterministic(tmp_path: Path) -> None:
    a = create_checkpoint("tiny-llava-next", tmp_path / "a")
    b = create_checkpoint("tiny-llava-next", tmp_path / "b")
    for f in ("model.safetensors", "config.json", "tokenizer.json", "preprocessor_config.json",
              "processor_config.json"):
        assert (a / f).read_bytes() == (b / f).read_bytes(), f


def test_full_size_preset_has_published_shapes(tmp_path: Path) -> None:
    config = build_config("llava-next-mistral-7b-random")
    config.save_pretrained(tmp_path)
    config = AutoConfig.from_pretrained(tmp_path)
    text, vision = config.text_config, config.vision_config
    assert (text.model_type, text.num_hidden_layers, text.hidden_size, text.intermediate_size,
            text.num_key_value_heads, text.vocab_size) == ("mistral", 32, 4096, 14336, 8, 32064)
    assert (vision.num_hidden_layers, vision.hidden_size, vision.image_size,
            vision.patch_size) == (24, 1024, 336, 14)
    with torch.device("meta"):
        model = transformers.LlavaNextForConditionalGeneration(config)
    assert sum(p.numel() for p in model.parameters()) == 7_566_747_648  # llava-v1.6-mistral-7b
    proc = builtin.preprocessor_config("llava-next-mistral-7b-random")
    assert proc["crop_size"] == {"height": 336, "width": 336}
    assert proc["image_grid_pinpoints"][2] == [672, 672]


def test_sliding_window_refused(tmp_path: Path) -> None:
    from vlmserve.models.llava_next import LlavaNextForConditionalGeneration

    config = build_config("tiny-llava-next")
    config.text_config.sliding_window = 64
    with pytest.raises(ValueError, match="sliding-window"):
        LlavaNextForConditionalGeneration(config)
