"""Built-in checkpoints, created locally and deterministically (no network).

Tiny random models for tests (``tiny-qwen2-vl``, ``tiny-qwen2.5-vl``, ``tiny-llava-1.5``,
``tiny-llava-next``) and full-size random-weight presets for speed measurements. Each is
written as a Hugging Face checkpoint folder (config.json, model.safetensors, tokenizer files,
preprocessor_config.json) that ``transformers`` loads as is.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from vlmserve.models.builtin_tokenizer import build_tokenizer, token_ids
from vlmserve.models.hub import download_model, is_model_id

if TYPE_CHECKING:
    from transformers import PretrainedConfig, PreTrainedTokenizerFast

QWEN_IMAGE_MEAN = [0.48145466, 0.4578275, 0.40821073]
QWEN_IMAGE_STD = [0.26862954, 0.26130258, 0.27577711]


@dataclass(frozen=True)
class BuiltinModel:
    """Recipe of one built-in checkpoint."""

    architecture: str  # transformers class name, also written to config.json
    text: dict  # text_config fields (vocab_size None: tokenizer size rounded up to 64)
    vision: dict  # vision_config fields
    tie_word_embeddings: bool
    tiny: bool  # True: deterministic init_tiny_weights; False: HF's random init (std 0.02)
    min_pixels: int = 56 * 56
    max_pixels: int = 448 * 448
    family: str = "qwen2_vl"  # tokenizer, config and processor recipe: qwen2_vl, llava, llava_next
    image_grid_pinpoints: tuple[tuple[int, int], ...] = ()  # llava_next: (height, width)
    image_mean: tuple[float, ...] = tuple(QWEN_IMAGE_MEAN)  # Qwen2/2.5-VL's (CLIP's)
    image_std: tuple[float, ...] = tuple(QWEN_IMAGE_STD)


def _text(
    hidden: int, inter: int, layers: int, heads: int, kv: int, vocab: int | None, mrope: list[int]
) -> dict:
    return dict(
        hidden_size=hidden,
        intermediate_size=inter,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv,
        vocab_size=vocab,
        rms_norm_eps=1e-6,
        max_position_embeddings=32768,
        rope_parameters={"rope_type": "default", "rope_theta": 1e6, "mrope_section": mrope},
    )


_QWEN2_VIS = dict(patch_size=14, spatial_merge_size=2, temporal_patch_size=2, in_channels=3)


def _llama_text(hidden: int, inter: int, layers: int, heads: int, kv: int, vocab: int | None,
                model_type: str = "llama", max_positions: int = 4096, rope_theta: float = 1e4,
                **extra) -> dict:
    return dict(model_type=model_type, hidden_size=hidden, intermediate_size=inter,
                num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv,
                vocab_size=vocab, rms_norm_eps=1e-5, max_position_embeddings=max_positions,
                rope_parameters={"rope_type": "default", "rope_theta": rope_theta}, **extra)


def _mistral_text(*shape) -> dict:
    return _llama_text(*shape, model_type="mistral", max_positions=32768, rope_theta=1e6,
                       sliding_window=None)


def _clip_vision(hidden: int, inter: int, layers: int, heads: int, image_size: int) -> dict:
    return dict(model_type="clip_vision_model", hidden_size=hidden, intermediate_size=inter,
                num_hidden_layers=layers, num_attention_heads=heads, image_size=image_size,
                patch_size=14, hidden_act="quick_gelu", layer_norm_eps=1e-5,
                projection_dim=768)

_QWEN3_VIS = dict(hidden_size=32, intermediate_size=64, depth=3, num_heads=2, out_hidden_size=64,
                  num_position_embeddings=16, deepstack_visual_indexes=[0, 1],
                  hidden_act="gelu_pytorch_tanh", patch_size=16, spatial_merge_size=2,
                  temporal_patch_size=2, in_channels=3)


def _tiny_qwen3(architecture: str, text: dict) -> BuiltinModel:
    return BuiltinModel(architecture=architecture, text=text, vision=_QWEN3_VIS,
                        tie_word_embeddings=True, tiny=True, min_pixels=64 * 64,
                        max_pixels=512 * 512, image_mean=(0.5, 0.5, 0.5),
                        image_std=(0.5, 0.5, 0.5))


def _tiny_qwen3_5(architecture: str, **moe) -> BuiltinModel:
    """Linear-attention layers around a full-attention one; head_dim 32 with a quarter of it
    rotated (8 channels: interleaved mRoPE over 4 frequencies, t h w t)."""
    text = {**_text(64, 128, 3, 4, 2, None, [2, 1, 1]), "head_dim": 32,
            "layer_types": ["linear_attention", "full_attention", "linear_attention"],
            "linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_key_head_dim": 16,
            "linear_value_head_dim": 16, "linear_conv_kernel_dim": 4, **moe}
    text["rope_parameters"] = {**text["rope_parameters"], "mrope_interleaved": True,
                               "partial_rotary_factor": 0.25}
    vision = {k: v for k, v in _QWEN3_VIS.items() if k != "deepstack_visual_indexes"}
    return BuiltinModel(architecture=architecture, text=text, vision=vision,
                        tie_word_embeddings=False, tiny=True, min_pixels=64 * 64,
                        max_pixels=512 * 512, image_mean=(0.5, 0.5, 0.5),
                        image_std=(0.5, 0.5, 0.5))


def _qwen3_5_0_8b_preset() -> BuiltinModel:
    """Qwen/Qwen3.5-0.8B's shapes: 24 layers, three Gated DeltaNet layers to one full-attention
    layer (16 + 16 heads of 128), 8 query / 2 KV heads of 256 with a quarter rotated; a 12-layer
    768-wide vision tower without DeepStack."""
    text = {**_text(1024, 3584, 24, 8, 2, 248320, [11, 11, 10]), "head_dim": 256,
            "max_position_embeddings": 262144,
            "layer_types": ["linear_attention"] * 3 + ["full_attention"],
            "linear_num_key_heads": 16, "linear_num_value_heads": 16,
            "linear_key_head_dim": 128, "linear_value_head_dim": 128,
            "linear_conv_kernel_dim": 4, "full_attention_interval": 4}
    text["layer_types"] = text["layer_types"] * 6
    text["rope_parameters"] = {**text["rope_parameters"], "rope_theta": 1e7,
                               "mrope_interleaved": True, "partial_rotary_factor": 0.25}
    vision = dict(_QWEN3_VIS, hidden_size=768, intermediate_size=3072, depth=12, num_heads=12,
                  out_hidden_size=1024, num_position_embeddings=2304)
    del vision["deepstack_visual_indexes"]
    return BuiltinModel(architecture="Qwen3_5ForConditionalGeneration", text=text,
                        vision=vision, tie_word_embeddings=True, tiny=False,
                        min_pixels=65536, max_pixels=16777216, image_mean=(0.5, 0.5, 0.5),
                        image_std=(0.5, 0.5, 0.5))


def _qwen3_moe_preset(layers: int) -> BuiltinModel:
    text = {**_text(2048, 6144, layers, 32, 4, 151936, [24, 20, 20]), "head_dim": 128,
            "moe_intermediate_size": 768, "num_experts": 128, "num_experts_per_tok": 8,
            "decoder_sparse_step": 1, "mlp_only_layers": []}
    text["rope_parameters"] = {**text["rope_parameters"], "rope_theta": 5e6,
                               "mrope_interleaved": True}
    vision = dict(_QWEN3_VIS, hidden_size=1152, intermediate_size=4304, depth=27, num_heads=16,
                  out_hidden_size=2048, num_position_embeddings=2304,
                  deepstack_visual_indexes=[8, 16, 24])
    return BuiltinModel(architecture="Qwen3VLMoeForConditionalGeneration", text=text,
                        vision=vision, tie_word_embeddings=False, tiny=False,
                        min_pixels=65536, max_pixels=16777216, image_mean=(0.5, 0.5, 0.5),
                        image_std=(0.5, 0.5, 0.5))


BUILTIN_MODELS: dict[str, BuiltinModel] = {
    "tiny-qwen2-vl": BuiltinModel(
        architecture="Qwen2VLForConditionalGeneration",
        text=_text(64, 128, 2, 4, 2, None, [2, 3, 3]),
        vision=dict(embed_dim=32, depth=2, num_heads=2, mlp_ratio=2, hidden_size=64, **_QWEN2_VIS),
        tie_word_embeddings=True,
        tiny=True,
    ),
    "tiny-qwen2.5-vl": BuiltinModel(
        architecture="Qwen2_5_VLForConditionalGeneration",
        text=_text(64, 128, 2, 4, 2, None, [2, 3, 3]),
        vision=dict(
            hidden_size=32,
            intermediate_size=64,
            depth=4,
            num_heads=2,
            fullatt_block_indexes=[1, 3],
            window_size=112,
            out_hidden_size=64,
            **_QWEN2_VIS,
        ),
        tie_word_embeddings=False,
        tiny=True,
    ),
    # head_dim 16: interleaved mRoPE over 8 frequencies (t h w t h w t h)
    "tiny-qwen3-vl": _tiny_qwen3("Qwen3VLForConditionalGeneration",
                                 {**_text(64, 128, 2, 4, 2, None, [2, 3, 3]), "head_dim": 16}),
    # 8 experts, 2 a token, in layers 0 and 2 (layer 1 dense: mlp_only_layers)
    "tiny-qwen3-vl-moe": _tiny_qwen3(
        "Qwen3VLMoeForConditionalGeneration",
        {**_text(64, 128, 3, 4, 2, None, [2, 3, 3]), "head_dim": 16,
         "moe_intermediate_size": 48, "num_experts": 8, "num_experts_per_tok": 2,
         "decoder_sparse_step": 1, "mlp_only_layers": [1]}),
    "tiny-qwen3.5": _tiny_qwen3_5("Qwen3_5ForConditionalGeneration"),
    # every MLP sparse: 8 experts, 2 a token, and a gated shared expert
    "tiny-qwen3.5-moe": _tiny_qwen3_5(
        "Qwen3_5MoeForConditionalGeneration", moe_intermediate_size=48, num_experts=8,
        num_experts_per_tok=2, shared_expert_intermediate_size=64),
    "qwen2-vl-2b-random": BuiltinModel(
        architecture="Qwen2VLForConditionalGeneration",
        text=_text(1536, 8960, 28, 12, 2, 151936, [16, 24, 24]),
        vision=dict(
            embed_dim=1280, depth=32, num_heads=16, mlp_ratio=4, hidden_size=1536, **_QWEN2_VIS
        ),
        tie_word_embeddings=True,
        tiny=False,
        max_pixels=12845056,
    ),
    # Qwen/Qwen3-VL-30B-A3B-Instruct's shapes (31.07B parameters, as published; text: Qwen3-
    # 30B-A3B's), and the same with 12 of its 48 layers (17 GB: fits the GPU machine's disk)
    "qwen3-vl-30b-a3b-random": _qwen3_moe_preset(48),
    "qwen3.5-0.8b-random": _qwen3_5_0_8b_preset(),
    "qwen3-vl-30b-a3b-12l-random": _qwen3_moe_preset(12),
    "qwen2.5-vl-7b-random": BuiltinModel(
        architecture="Qwen2_5_VLForConditionalGeneration",
        text=_text(3584, 18944, 28, 28, 4, 152064, [16, 24, 24]),
        vision=dict(
            hidden_size=1280,
            intermediate_size=3420,
            depth=32,
            num_heads=16,
            fullatt_block_indexes=[7, 15, 23, 31],
            window_size=112,
            out_hidden_size=3584,
            tokens_per_second=2,
            **_QWEN2_VIS,
        ),
        tie_word_embeddings=False,
        tiny=False,
        max_pixels=12845056,
    ),
    "tiny-llava-1.5": BuiltinModel(
        architecture="LlavaForConditionalGeneration",
        text=_llama_text(64, 128, 2, 4, 2, None),
        # 84x84 images: 36 tokens each; 3 layers, features from the second to last
        vision=_clip_vision(32, 64, 3, 2, 84),
        tie_word_embeddings=False,
        tiny=True,
        family="llava",
    ),
    "llava-1.5-7b-random": BuiltinModel(  # llava-hf/llava-1.5-7b-hf's shapes
        architecture="LlavaForConditionalGeneration",
        text=_llama_text(4096, 11008, 32, 32, 32, 32064),
        vision=_clip_vision(1024, 4096, 24, 16, 336),
        tie_word_embeddings=False,
        tiny=False,
        family="llava",
    ),
    "tiny-llava-next": BuiltinModel(
        architecture="LlavaNextForConditionalGeneration",
        text=_mistral_text(64, 128, 2, 4, 2, None),
        # 56x56 tiles: 16 tokens each; grids 1x2, 2x1, 2x2, 1x3, 3x1 (llava-v1.6's at 1/6 size)
        vision=_clip_vision(32, 64, 3, 2, 56),
        tie_word_embeddings=False,
        tiny=True,
        family="llava_next",
        image_grid_pinpoints=((56, 112), (112, 56), (112, 112), (168, 56), (56, 168)),
    ),
    "llava-next-mistral-7b-random": BuiltinModel(  # llava-hf/llava-v1.6-mistral-7b-hf's shapes
        architecture="LlavaNextForConditionalGeneration",
        text=_mistral_text(4096, 14336, 32, 32, 8, 32064),
        vision=_clip_vision(1024, 4096, 24, 16, 336),
        tie_word_embeddings=False,
        tiny=False,
        family="llava_next",
        image_grid_pinpoints=((336, 672), (672, 336), (672, 672), (1008, 336), (336, 1008)),
    ),
}


def build_config(name: str, tokenizer: PreTrainedTokenizerFast | None = None) -> PretrainedConfig:
    """The transformers config of built-in model ``name`` (special ids from ``tokenizer``)."""
    import transformers

    spec = BUILTIN_MODELS[name]
    tokenizer = tokenizer if tokenizer is not None else build_tokenizer(spec.family)
    ids = token_ids(tokenizer, spec.family)
    text = dict(spec.text)
    if text["vocab_size"] is None:
        text["vocab_size"] = -(-len(tokenizer) // 64) * 64
    specials = {k: ids[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id")}
    text.update(specials, tie_word_embeddings=spec.tie_word_embeddings)
    config_cls = getattr(
        transformers, spec.architecture.replace("ForConditionalGeneration", "Config")
    )
    if spec.family in ("llava", "llava_next"):
        vision = spec.vision
        extra = dict(vision_feature_layer=-2, vision_feature_select_strategy="default",
                     projector_hidden_act="gelu",
                     image_seq_length=(vision["image_size"] // vision["patch_size"]) ** 2,
                     image_token_id=ids["image_token_id"], pad_token_id=ids["pad_token_id"])
        if spec.family == "llava_next":
            extra["image_grid_pinpoints"] = [list(p) for p in spec.image_grid_pinpoints]
    else:
        extra = ids
    config = config_cls(
        text_config=text,
        vision_config=dict(spec.vision),
        tie_word_embeddings=spec.tie_word_embeddings,
        **extra,
    )
    config.architectures = [spec.architecture]
    return config


def preprocessor_config(name: str) -> dict:
    """The preprocessor_config.json contents of built-in model ``name``."""
    spec = BUILTIN_MODELS[name]
    vision = spec.vision
    if spec.family in ("llava", "llava_next"):  # llava-hf's CLIP processors at our size
        size = vision["image_size"]
        clip = {
            "image_processor_type": "CLIPImageProcessor",
            "do_resize": True,
            "size": {"shortest_edge": size},
            "resample": 3,  # bicubic
            "do_center_crop": True,
            "crop_size": {"height": size, "width": size},
            "do_rescale": True,
            "rescale_factor": 1 / 255,
            "do_normalize": True,
            "image_mean": QWEN_IMAGE_MEAN,  # OpenAI CLIP's
            "image_std": QWEN_IMAGE_STD,
            "do_convert_rgb": True,
        }
        if spec.family == "llava":  # llava-1.5-7b-hf
            return clip
        return {**clip, "image_processor_type": "LlavaNextImageProcessor",  # llava-v1.6
                "do_pad": True,
                "image_grid_pinpoints": [list(p) for p in spec.image_grid_pinpoints]}
    return {
        "image_processor_type": "Qwen2VLImageProcessor",
        "do_resize": True,
        "resample": 3,  # bicubic
        "do_rescale": True,
        "rescale_factor": 1 / 255,
        "do_normalize": True,
        "image_mean": list(spec.image_mean),
        "image_std": list(spec.image_std),
        "do_convert_rgb": True,
        "min_pixels": spec.min_pixels,
        "max_pixels": spec.max_pixels,
        "size": {"shortest_edge": spec.min_pixels, "longest_edge": spec.max_pixels},
        "patch_size": vision["patch_size"],
        "temporal_patch_size": vision["temporal_patch_size"],
        "merge_size": vision["spatial_merge_size"],
    }


@torch.no_grad()
def init_tiny_weights(model: torch.nn.Module, seed: int = 0, std: float = 0.2) -> None:
    """Deterministic init: matrices N(0, std), norm weights 1 + noise, biases small noise.

    Parameters are visited in sorted name order with one seeded CPU generator, so the result
    does not depend on module construction order or on the device. Rows of the image/video
    placeholder tokens in lm_head are zeroed so that, like the real models, the tiny ones
    never generate a placeholder.
    """
    gen = torch.Generator().manual_seed(seed)
    for name, param in sorted(model.named_parameters()):
        noise = torch.randn(param.shape, generator=gen, dtype=torch.float32)
        if name.endswith(".bias"):
            value = 0.02 * noise
        elif param.ndim == 1 and name.rpartition(".")[2] != "image_newline":  # norm weights
            value = 1.0 + 0.02 * noise
        else:
            value = std * noise
        param.copy_(value.to(param.dtype))
    placeholders = [t for t in (model.config.image_token_id,
                                getattr(model.config, "video_token_id", None)) if t is not None]
    model.get_output_embeddings().weight[placeholders] = 0.0


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype) -> Iterator[None]:
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(old)


def create_checkpoint(
    name: str, path: str | Path, *, dtype: torch.dtype = torch.float32, device: str = "cpu"
) -> Path:
    """Write built-in model ``name`` as a Hugging Face checkpoint folder at ``path``.

    Tiny models get a deterministic init (same bytes every time); full-size presets get
    HF's random init (std 0.02), built directly on ``device`` in ``dtype`` from a fixed seed
    (so hosts with the same kind of device create the same weights: a torchrun job's ranks
    agree).
    """
    import transformers

    if name not in BUILTIN_MODELS:
        raise ValueError(f"unknown built-in model {name!r}; available: {sorted(BUILTIN_MODELS)}")
    spec = BUILTIN_MODELS[name]
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer(spec.family)
    config = build_config(name, tokenizer)
    model_cls = getattr(transformers, spec.architecture)
    with torch.device(device), _default_dtype(dtype), torch.random.fork_rng(
            devices=[torch.device(device)] if torch.device(device).type == "cuda" else []):
        torch.manual_seed(0)  # also seeds every CUDA device
        model = model_cls(config)
    if spec.tiny:
        init_tiny_weights(model)
    model.eval()
    model.save_pretrained(path)
    tokenizer.save_pretrained(path, save_jinja_files=False)  # template in tokenizer_config.json
    with open(path / "preprocessor_config.json", "w") as f:
        json.dump(preprocessor_config(name), f, indent=2, sort_keys=True)
    if spec.family in ("llava", "llava_next"):  # what transformers' processor reads besides
        vision = spec.vision
        processor_class = "LlavaProcessor" if spec.family == "llava" else "LlavaNextProcessor"
        with open(path / "processor_config.json", "w") as f:
            json.dump({"processor_class": processor_class, "image_token": "<image>",
                       "patch_size": vision["patch_size"], "num_additional_image_tokens": 1,
                       "vision_feature_select_strategy": "default"}, f, indent=2,
                      sort_keys=True)
    return path


def cache_root() -> Path:
    """Where built-in checkpoints live: ``$VLMSERVE_CACHE`` or ``~/.cache/vlmserve``."""
    root = os.environ.get("VLMSERVE_CACHE")
    return Path(root) if root else Path.home() / ".cache" / "vlmserve"


def resolve_model(name_or_path: str, revision: str | None = None,
                  download_dir: str | None = None, trust_remote_code: bool = False) -> Path:
    """Checkpoint folder for an existing path, a built-in name (created once, then reused) or
    a Hugging Face model id ``org/name`` (`hub.download_model` at ``revision`` into the Hub's
    cache or ``download_dir``; its Python files too with ``trust_remote_code``), in that
    order. A folder resolves to itself, so resolving again is free and never reaches the Hub.

    Creation writes to a temporary folder beside the target and renames it into place, so a
    folder that exists is complete, and two processes racing both end with the same folder.
    Full-size presets are created in bfloat16, on the GPU when there is one.
    """
    path = Path(name_or_path).expanduser()
    if path.exists():
        return path
    if name_or_path not in BUILTIN_MODELS:
        if is_model_id(name_or_path):
            return download_model(name_or_path, revision, download_dir, trust_remote_code)
        raise ValueError(
            f"model {name_or_path!r} is neither an existing path, a built-in model nor a "
            f"Hugging Face model id (org/name); built-in models: "
            f"{', '.join(sorted(BUILTIN_MODELS))}"
        )
    root = cache_root()
    target = root / name_or_path
    if target.exists():
        return target
    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{name_or_path}.tmp-", dir=root))
    try:
        tmp.chmod(0o755)
        if BUILTIN_MODELS[name_or_path].tiny:
            create_checkpoint(name_or_path, tmp)
        else:
            device = "cuda" if torch.cuda.is_available() else "cpu"
            create_checkpoint(name_or_path, tmp, dtype=torch.bfloat16, device=device)
        try:
            os.rename(tmp, target)
        except OSError:
            if not target.exists():  # lost a race only if someone else's folder is there
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target
