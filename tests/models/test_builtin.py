"""Built-in checkpoints: HF loads them, they are deterministic, and the cache is safe."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest
import torch
import transformers
from PIL import Image
from safetensors.torch import load_file
from transformers import AutoConfig, AutoImageProcessor, AutoTokenizer

from vlmserve.models import builtin
from vlmserve.models.builtin import BUILTIN_MODELS, build_config, create_checkpoint, resolve_model
from vlmserve.models.qwen2_vl_processing import Qwen2VLInputProcessor
from vlmserve.multimodal.inputs import pixel_values

TINY = {
    "tiny-qwen2-vl": ("tiny_qwen2_vl_path", transformers.Qwen2VLForConditionalGeneration, True),
    "tiny-qwen2.5-vl": (
        "tiny_qwen25_vl_path",
        transformers.Qwen2_5_VLForConditionalGeneration,
        False,
    ),
    "tiny-qwen3-vl": ("tiny_qwen3_vl_path", transformers.Qwen3VLForConditionalGeneration, True),
    "tiny-qwen3-vl-moe": ("tiny_qwen3_vl_moe_path",
                          transformers.Qwen3VLMoeForConditionalGeneration, True),
}


@pytest.fixture(params=sorted(TINY))
def tiny(request: pytest.FixtureRequest) -> tuple[str, Path]:
    name = request.param
    return name, request.getfixturevalue(TINY[name][0])


def test_hf_loads_tiny_checkpoint(tiny: tuple[str, Path]) -> None:
    name, path = tiny
    _, cls, tied = TINY[name]
    files = {p.name for p in path.iterdir()}
    assert {
        "config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
        "preprocessor_config.json",
    } <= files
    model = cls.from_pretrained(path)
    assert model.config.architectures == [cls.__name__]
    embed = model.model.language_model.embed_tokens.weight
    assert (model.lm_head.weight.data_ptr() == embed.data_ptr()) is tied
    assert 0.15 < embed.std() < 0.25  # our init (std 0.2), not HF's default std 0.02

    tok = AutoTokenizer.from_pretrained(path)
    cfg = model.config
    assert cfg.text_config.vocab_size == 448 == len(tok)
    assert tok.convert_ids_to_tokens(
        [
            cfg.image_token_id,
            cfg.video_token_id,
            cfg.vision_start_token_id,
            cfg.vision_end_token_id,
            cfg.text_config.eos_token_id,
            cfg.text_config.pad_token_id,
        ]
    ) == [
        "<|image_pad|>",
        "<|video_pad|>",
        "<|vision_start|>",
        "<|vision_end|>",
        "<|im_end|>",
        "<|endoftext|>",
    ]
    assert not model.lm_head.weight[[cfg.image_token_id, cfg.video_token_id]].any()
    assert tok.eos_token == "<|im_end|>" and tok.pad_token == "<|endoftext|>"
    proc = AutoImageProcessor.from_pretrained(path)
    patch = 16 if name.startswith("tiny-qwen3-vl") else 14
    assert (proc.patch_size, proc.merge_size, proc.temporal_patch_size) == (patch, 2, 2)


def test_tokenizer_round_trips_text(tiny_qwen2_vl_path: Path) -> None:
    tok = AutoTokenizer.from_pretrained(tiny_qwen2_vl_path)
    text = "Describe the image: a café, 3 dogs 🐕 and <|image_pad|>!"
    ids = tok.encode(text)
    assert tok.decode(ids) == text
    assert ids.count(tok.convert_tokens_to_ids("<|image_pad|>")) == 1
    assert len(tok.encode(" the image")) == 2  # learned merges, not bytes only


def test_tiny_greedy_output_varies_and_depends_on_image(tiny: tuple[str, Path]) -> None:
    """Greedy parity tests need outputs that change with the image and clear argmax margins."""
    name, path = tiny
    model = TINY[name][1].from_pretrained(path).eval()
    proc = Qwen2VLInputProcessor(path, model.config)
    prompt = proc.apply_chat_template(
        [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Describe."}]}]
    )
    rng = np.random.default_rng(1)
    outputs = []
    for size in [(64, 96), (64, 96)]:
        image = Image.fromarray(rng.integers(0, 256, (*size, 3), dtype=np.uint8))
        p = proc.process(prompt, None, [image])
        with torch.no_grad():
            out = model.generate(
                input_ids=torch.tensor([p.prompt_token_ids]),
                pixel_values=pixel_values(p.images),
                image_grid_thw=torch.tensor([i.encoder_meta for i in p.images]),
                max_new_tokens=12,
                do_sample=False,
                output_logits=True,
                return_dict_in_generate=True,
            )
        top2 = torch.stack(out.logits)[:, 0].topk(2, dim=-1).values
        assert (top2[:, 0] - top2[:, 1]).min() > 1e-3
        tokens = out.sequences[0, len(p.prompt_token_ids) :].tolist()
        assert len(set(tokens)) > 4
        outputs.append(tokens)
    assert outputs[0] != outputs[1]


def test_create_checkpoint_is_deterministic(tmp_path: Path) -> None:
    for name in sorted(TINY):
        a = create_checkpoint(name, tmp_path / "a" / name)
        b = create_checkpoint(name, tmp_path / "b" / name)
        for fname in (
            "model.safetensors",
            "config.json",
            "tokenizer.json",
            "tokenizer_config.json",
            "preprocessor_config.json",
        ):
            assert (a / fname).read_bytes() == (b / fname).read_bytes(), fname
        ta, tb = load_file(a / "model.safetensors"), load_file(b / "model.safetensors")
        assert ta.keys() == tb.keys()
        assert all(torch.equal(ta[k], tb[k]) for k in ta)


def test_random_presets_are_seeded(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A full-size preset's HF random init comes from a fixed seed: every host of a torchrun
    job creates the same weights (here a tiny recipe run through the full-size path), and
    the caller's random state is left as it was."""
    import dataclasses

    spec = dataclasses.replace(BUILTIN_MODELS["tiny-qwen2-vl"], tiny=False)
    monkeypatch.setitem(BUILTIN_MODELS, "tiny-random-preset", spec)
    torch.manual_seed(123)
    before = torch.rand(1)
    torch.manual_seed(123)
    a = load_file(create_checkpoint("tiny-random-preset", tmp_path / "a") / "model.safetensors")
    assert torch.equal(torch.rand(1), before)  # fork_rng: the caller's stream untouched
    b = load_file(create_checkpoint("tiny-random-preset", tmp_path / "b") / "model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_resolve_model_paths_and_errors(tmp_path: Path) -> None:
    assert resolve_model(str(tmp_path)) == tmp_path
    with pytest.raises(ValueError, match="tiny-qwen2-vl") as err:
        resolve_model("no-such-model")
    assert all(name in str(err.value) for name in BUILTIN_MODELS)


def test_resolve_model_creates_once_and_survives_a_race(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("VLMSERVE_CACHE", str(tmp_path))
    calls = []

    def fake_create(name: str, path: Path) -> Path:
        calls.append(name)
        (Path(path) / "config.json").write_text("{}")
        return Path(path)

    monkeypatch.setattr(builtin, "create_checkpoint", fake_create)
    first = resolve_model("tiny-qwen2-vl")
    assert first == tmp_path / "tiny-qwen2-vl" and (first / "config.json").exists()
    assert resolve_model("tiny-qwen2-vl") == first and calls == ["tiny-qwen2-vl"]

    def losing_create(name: str, path: Path) -> Path:  # another process finishes first
        (tmp_path / name).mkdir()
        (tmp_path / name / "winner").write_text("")
        return fake_create(name, path)

    monkeypatch.setattr(builtin, "create_checkpoint", losing_create)
    won = resolve_model("tiny-qwen2.5-vl")
    assert (won / "winner").exists() and not (won / "config.json").exists()
    assert sorted(os.listdir(tmp_path)) == ["tiny-qwen2-vl", "tiny-qwen2.5-vl"]  # no temp left


@pytest.mark.parametrize(
    "name, params, layers, hidden, vocab",
    [
        ("qwen2-vl-2b-random", 2_208_985_600, 28, 1536, 151936),
        ("qwen2.5-vl-7b-random", 8_292_166_656, 28, 3584, 152064),
        ("qwen3-vl-30b-a3b-random", 31_070_754_032, 48, 2048, 151936),  # "31.07B"
        ("qwen3-vl-30b-a3b-12l-random", 8_638_410_992, 12, 2048, 151936),
        ("qwen3.5-0.8b-random", 852_985_920, 24, 1024, 248320),  # "0.9B"
    ],
)
def test_full_size_presets_have_published_shapes(
    name: str, params: int, layers: int, hidden: int, vocab: int, tmp_path: Path
) -> None:
    config = build_config(name)
    config.save_pretrained(tmp_path)
    config = AutoConfig.from_pretrained(tmp_path)  # survives a round trip through config.json
    text = config.text_config
    assert (text.num_hidden_layers, text.hidden_size, text.vocab_size) == (layers, hidden, vocab)
    qwen3 = name.startswith("qwen3")
    mrope = [11, 11, 10] if "3.5" in name else [24, 20, 20] if qwen3 else [16, 24, 24]
    assert text.rope_parameters["mrope_section"] == mrope
    with torch.device("meta"):
        model = getattr(transformers, BUILTIN_MODELS[name].architecture)(config)
    assert sum(p.numel() for p in model.parameters()) == params
    assert builtin.preprocessor_config(name)["max_pixels"] == (16777216 if qwen3 else 12845056)
