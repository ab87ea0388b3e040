"""LLaVA-1.5 pieces vs transformers: admission (token expansion, pixels), the CLIP tower and
projector, weight loading, the built-in checkpoints, and the decoder's Llama flags."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
import transformers
from PIL import Image
from transformers import AutoConfig, AutoProcessor

from vlmserve.errors import InvalidRequestError
from vlmserve.models import builtin
from vlmserve.models.builtin import build_config, create_checkpoint, resolve_model
from vlmserve.models.llava_processing import LlavaInputProcessor
from vlmserve.models.loader import load_model
from vlmserve.models.qwen2 import attention_biases
from vlmserve.multimodal.inputs import pixel_values


def random_image(h: int, w: int, seed: int = 0) -> Image.Image:
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8))


def chat(num_images: int, text: str = "Describe.") -> list[dict]:
    return [{"role": "user",
             "content": [{"type": "image"}] * num_images + [{"type": "text", "text": text}]}]


@pytest.fixture(scope="module")
def path(vlmserve_cache) -> Path:
    return resolve_model("tiny-llava-1.5")


@pytest.fixture(scope="module")
def processor(path: Path) -> LlavaInputProcessor:
    return LlavaInputProcessor(path)


@pytest.fixture(scope="module")
def hf_processor(path: Path):
    return AutoProcessor.from_pretrained(path)


def test_chat_template(processor: LlavaInputProcessor) -> None:
    assert processor.apply_chat_template(chat(2, "What?")) == \
        "USER: <image>\n<image>\nWhat? ASSISTANT:"
    assert processor.apply_chat_template([{"role": "user", "content": "Hi"}]) == \
        "USER: Hi ASSISTANT:"


def test_token_expansion_matches_transformers_for_50_sizes(processor, hf_processor) -> None:
    """Our token ids (a BOS, every <image> expanded to 36) equal LlavaProcessor's for 50
    random image sizes, one to three images a prompt (sides from 4: HF takes a 3-pixel-high
    image for channels-first)."""
    rng = np.random.default_rng(0)
    for i in range(50):
        n = 1 + i % 3
        images = [random_image(int(rng.integers(4, 400)), int(rng.integers(4, 400)), i * 3 + j)
                  for j in range(n)]
        text = processor.apply_chat_template(chat(n))
        ours = processor.process(text, None, images)
        ref = hf_processor(images=images, text=text, return_tensors="pt")
        assert ours.prompt_token_ids == ref["input_ids"][0].tolist()
        assert [img.length for img in ours.images] == [36] * n
        assert ours.prompt_positions is None


@pytest.mark.parametrize("size", [(84, 84), (60, 90), (200, 50), (17, 400), (333, 334), (5, 3)])
def test_pixels_match_transformers_bit_for_bit(processor, hf_processor, size) -> None:
    image = random_image(*size, seed=sum(size))
    ours = processor.process(processor.apply_chat_template(chat(1)), None, [image])
    ref = hf_processor.image_processor(images=[image], return_tensors="pt")["pixel_values"]
    assert ours.images[0].pixels.dtype == torch.uint8
    assert ours.images[0].pixels.shape == (84, 84, 3)
    assert torch.equal(pixel_values(ours.images), ref)


def test_placeholders_given_expanded_or_wrong(processor) -> None:
    image = random_image(50, 60)
    text = processor.apply_chat_template(chat(1))
    once = processor.process(text, None, [image])
    again = processor.process(None, once.prompt_token_ids, [image])  # already expanded
    assert again.prompt_token_ids == once.prompt_token_ids
    assert [i.offset for i in again.images] == [i.offset for i in once.images]
    with pytest.raises(InvalidRequestError, match="1 image placeholder token.*2 image"):
        processor.process(text, None, [image, image])
    tid = processor.image_token_id
    with pytest.raises(InvalidRequestError, match="35 image placeholder"):
        processor.process(None, [1] + [tid] * 35, [image])
    two = processor.process(None, [1, tid, tid, 5], [image, random_image(70, 40, 1)])
    assert [i.offset for i in two.images] == [1, 37] and len(two.prompt_token_ids) == 74


def test_hashes_follow_content(processor) -> None:
    a, b = random_image(50, 60, 1), random_image(50, 60, 2)
    out = processor.process(processor.apply_chat_template(chat(3)), None, [a, b, a])
    hashes = [i.mm_hash for i in out.images]
    assert hashes[0] == hashes[2] != hashes[1]


def _tiny_hf(tmp_path: Path, **overrides):
    config = build_config("tiny-llava-1.5")
    for k, v in overrides.items():
        setattr(config, k, v)
    torch.manual_seed(0)
    model = transformers.LlavaForConditionalGeneration(config)
    builtin.init_tiny_weights(model)
    model.eval().save_pretrained(tmp_path)
    return tmp_path, model


@pytest.mark.parametrize("overrides", [
    {},  # layer -2 of 3, class token dropped
    {"vision_feature_select_strategy": "full", "vision_feature_layer": -1},
    {"vision_feature_layer": [-3, -1]},  # two layers concatenated
], ids=["default", "full-last", "two-layers"])
def test_image_features_match_transformers(tmp_path: Path, overrides) -> None:
    path, hf = _tiny_hf(tmp_path, **overrides)
    ours = load_model(path, AutoConfig.from_pretrained(path), torch.float32, torch.device("cpu"))
    pixels = torch.randn(3, 3, 84, 84, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        rows = ours.encode_images(pixels, None)
        ref = torch.cat(hf.model.get_image_features(pixel_values=pixels).pooler_output)
    per_image = 36 + int(overrides.get("vision_feature_select_strategy") == "full")
    assert rows.shape == ref.shape == (3 * per_image, 64)
    torch.testing.assert_close(rows, ref, rtol=0, atol=1e-6)
    # only the blocks up to the deepest feature layer are built
    depth = 3 if overrides.get("vision_feature_layer") in (-1, [-3, -1]) else 2
    assert len(ours.vision_tower.encoder.layers) == depth


def test_loads_the_hub_layout(tmp_path: Path, path: Path) -> None:
    """llava-hf's checkpoints name weights `language_model.model.*`,
    `vision_tower.vision_model.*`, `language_model.lm_head.*`."""
    from safetensors.torch import load_file, save_file

    weights = load_file(path / "model.safetensors")
    hub = {}
    for name, t in weights.items():
        if name.startswith("vision_tower."):
            name = "vision_tower.vision_model." + name[len("vision_tower."):]
        hub[name] = t
    assert any(k.startswith("language_model.model.") for k in hub)
    save_file(hub, tmp_path / "model.safetensors")
    config = AutoConfig.from_pretrained(path)
    a = load_model(path, config, torch.float32, torch.device("cpu"))
    b = load_model(tmp_path, config, torch.float32, torch.device("cpu"))
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)
    for name in ("multi_modal_projector.linear_3.weight", "image_newline",
                 "vision_tower.encoder.layers.0.mlp.fc3.weight"):
        with pytest.raises(KeyError, match="unexpected"):
            b.load_weights([(name, torch.zeros(1))])


def test_builtin_checkpoint(path: Path) -> None:
    files = {p.name for p in path.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json", "preprocessor_config.json",
            "processor_config.json"} <= files
    hf = transformers.LlavaForConditionalGeneration.from_pretrained(path)
    cfg = hf.config
    tok = AutoProcessor.from_pretrained(path).tokenizer
    assert tok.convert_ids_to_tokens([cfg.image_token_id, tok.bos_token_id, tok.eos_token_id]) \
        == ["<image>", "<s>", "</s>"]
    assert tok.encode("Hi")[0] == tok.bos_token_id
    assert (cfg.vision_feature_layer, cfg.vision_feature_select_strategy) == (-2, "default")
    assert cfg.text_config.model_type == "llama" and not cfg.text_config.attention_bias
    assert not hf.lm_head.weight[cfg.image_token_id].any()
    assert 0.15 < hf.model.language_model.embed_tokens.weight.std() < 0.25


def test_builtin_is_deterministic(tmp_path: Path) -> None:
    a = create_checkpoint("tiny-llava-1.5", tmp_path / "a")
    b = create_checkpoint("tiny-llava-1.5", tmp_path / "b")
    for f in ("model.safetensors", "config.json", "tokenizer.json", "preprocessor_config.json",
              "processor_config.json"):
        assert (a / f).read_bytes() == (b / f).read_bytes(), f


def test_full_size_preset_has_published_shapes(tmp_path: Path) -> None:
    config = build_config("llava-1.5-7b-random")
    config.save_pretrained(tmp_path)
    config = AutoConfig.from_pretrained(tmp_path)
    text, vision = config.text_config, config.vision_config
    assert (text.num_hidden_layers, text.hidden_size, text.intermediate_size,
            text.vocab_size) == (32, 4096, 11008, 32064)
    assert (vision.num_hidden_layers, vision.hidden_size, vision.image_size,
            vision.patch_size) == (24, 1024, 336, 14)
    with torch.device("meta"):
        model = transformers.LlavaForConditionalGeneration(config)
    assert sum(p.numel() for p in model.parameters()) == 7_063_427_072  # llava-1.5-7b-hf
    proc = builtin.preprocessor_config("llava-1.5-7b-random")
    assert proc["crop_size"] == {"height": 336, "width": 336}
    assert proc["size"] == {"shortest_edge": 336}


def test_decoder_biases_by_config() -> None:
    qwen = transformers.Qwen2VLConfig().text_config
    llama = transformers.LlamaConfig()
    mistral = transformers.MistralConfig()
    assert attention_biases(qwen) == (True, False)
    assert attention_biases(llama) == (False, False)
    assert attention_biases(transformers.LlamaConfig(attention_bias=True)) == (True, True)
    assert attention_biases(mistral) == (False, False)
    with pytest.raises(ValueError, match="mlp_bias"):
        attention_biases(transformers.LlamaConfig(mlp_bias=True))
