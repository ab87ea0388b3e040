"""Tiny, deterministic Hugging Face checkpoints of transformers' image-text-to-text
architectures: config (transformers' own classes), float32 safetensors weights, a small byte-level
BPE tokenizer with each processor's special tokens, and the full processor (PIL image processor,
chat template), so that ``AutoProcessor`` / ``AutoModelForImageTextToText.from_pretrained`` work
on the folder without torchvision.

Sizes: text hidden 64, 2 layers (more only where the model mixes layer kinds), 4 heads / 2 KV
heads, head_dim 16, intermediate 128; vision towers of hidden 32 and one or two layers, images of
a few dozen tokens. After the model is built under ``torch.manual_seed(0)`` every floating
parameter except the norms is redrawn from N(0, 0.2) (a seeded generator), since with the default
std 0.02 a tiny model emits one token over and over.

``TINY_ARCHS`` maps each supported ``model_type`` to a note of what is special about it;
``build_tiny(model_type, path)`` writes the checkpoint folder and returns it.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from vlmserve.models.builtin_tokenizer import _CORPUS, TOKENIZER_BPE_VOCAB

INIT_STD = 0.2
BASE_SPECIALS = ("<unk>", "<s>", "</s>", "<pad>")  # ids 0-3

# text sizes shared by every decoder
TEXT = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            head_dim=16, intermediate_size=128, max_position_embeddings=4096,
            tie_word_embeddings=False)


# --------------------------------------------------------------------------------- tokenizer
def make_tokenizer(
    specials: list[str] | tuple[str, ...] = (),
    *,
    extra: dict[str, str] | None = None,
    bos: str | None = "<s>",
    eos: str = "</s>",
    pad: str = "<pad>",
    unk: str | None = "<unk>",
    add_bos: bool = True,
    chat_template: str | None = None,
    base: tuple[str, ...] = BASE_SPECIALS,
    plain_tokens: list[str] | tuple[str, ...] = (),
    **kwargs: Any,
):
    """The built-in tiny byte-level BPE (trained on ``builtin_tokenizer``'s corpus) with
    ``base`` special tokens at ids 0.., then ``specials`` (and the values of ``extra``, named
    special tokens such as ``image_token``) as added special tokens; BOS prepended when
    ``add_bos``."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers
    from tokenizers.processors import TemplateProcessing
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token=unk) if unk else models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=TOKENIZER_BPE_VOCAB,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=list(base),
        show_progress=False,
    )
    tok.train_from_iterator(_CORPUS.splitlines(), trainer=trainer)
    added = list(dict.fromkeys([*specials, *(extra or {}).values()]))
    added = [t for t in added if tok.token_to_id(t) is None]
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in added])
    if plain_tokens:
        tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in plain_tokens])
    if add_bos and bos:
        tok.post_processor = TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B",
            special_tokens=[(bos, tok.token_to_id(bos))])
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token=bos, eos_token=eos, unk_token=unk, pad_token=pad,
        extra_special_tokens=extra or {}, chat_template=chat_template, model_max_length=8192,
        **kwargs)


def ids(tok, *tokens: str) -> list[int]:
    out = [tok.convert_tokens_to_ids(t) for t in tokens]
    assert all(isinstance(i, int) and i != tok.unk_token_id for i in out), (tokens, out)
    return out


def special_ids(tok) -> dict[str, int]:
    return dict(bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                pad_token_id=tok.pad_token_id)


def chat_template(image: str, *, user: str = "USER: ", assistant: str = "ASSISTANT:",
                  end: str = "\n", images_first: bool = False, bos: str = "") -> str:
    """A simple Jinja chat template: ``{"type": "image"}`` parts render as ``image`` (the
    processor's placeholder text), text parts as their text."""
    img = "{% if part['type'] in ('image', 'image_url') %}" + _jinja_str(image) + "{% endif %}"
    txt = "{% if part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
    parts = ("{% for part in message['content'] %}" + img + "{% endfor %}"
             "{% for part in message['content'] %}" + txt + "{% endfor %}") if images_first \
        else "{% for part in message['content'] %}" + img + txt + "{% endfor %}"
    return (
        _jinja_str(bos) +
        "{% for message in messages %}"
        "{% if message['role'] == 'user' %}" + _jinja_str(user) +
        "{% elif message['role'] == 'system' %}" + _jinja_str("SYSTEM: ") +
        "{% else %}" + _jinja_str(assistant) + "{% endif %}"
        "{% if message['content'] is string %}{{ message['content'] }}{% else %}" + parts +
        "{% endif %}" + _jinja_str(end) +
        "{% endfor %}"
        "{% if add_generation_prompt %}" + _jinja_str(assistant) + "{% endif %}"
    )


def _jinja_str(s: str) -> str:
    return "{{ " + json.dumps(s) + " }}" if s else ""


# --------------------------------------------------------------------------------- weights
def _is_norm(name: str) -> bool:
    n = name.lower()
    return any(k in n for k in ("norm", "ln_", ".ln", "layernorm", "layer_norm")) \
        and not n.endswith("proj.weight")


@torch.no_grad()
def reinit(model: torch.nn.Module, std: float = INIT_STD, seed: int = 0) -> None:
    """Every floating parameter N(0, std) from a seeded generator, except norms (as built)."""
    gen = torch.Generator().manual_seed(seed)
    for name, p in model.named_parameters():
        if not p.is_floating_point() or _is_norm(name):
            continue
        p.copy_(torch.randn(p.shape, generator=gen, dtype=torch.float32).to(p.dtype) * std)


def save_model(path: Path, config, model_cls) -> None:
    config.dtype = torch.float32
    for c in {id(config): config, id(config.get_text_config()): config.get_text_config()}.values():
        c.tie_word_embeddings = False  # an untied LM head: tied tiny heads repeat tokens
    config.architectures = [model_cls.__name__]
    torch.manual_seed(0)
    model = model_cls(config).to(torch.float32).eval()
    reinit(model)
    model.save_pretrained(path)
    if model.generation_config is not None:
        model.generation_config.save_pretrained(path)


def _finish(path: Path, config, model_cls, processor) -> Path:
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    save_model(path, config, model_cls)
    processor.save_pretrained(path)
    return path


def clip_vision(image_size: int = 56, patch_size: int = 14, **kw) -> dict:
    return dict(model_type="clip_vision_model", **{
        **dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
               image_size=image_size, patch_size=patch_size, projection_dim=32), **kw})


def siglip_vision(image_size: int = 56, patch_size: int = 14, **kw) -> dict:
    return dict(model_type="siglip_vision_model", hidden_size=32, intermediate_size=64,
                num_hidden_layers=2, num_attention_heads=4, image_size=image_size,
                patch_size=patch_size, **kw)


def text_cfg(model_type: str, vocab: int, **kw) -> dict:
    return dict(model_type=model_type, vocab_size=vocab, **{**TEXT, **kw})


# --------------------------------------------------------------------------------- builders
CLIP_MEAN = [0.48145466, 0.4578275, 0.40821073]
CLIP_STD = [0.26862954, 0.26130258, 0.27577711]


def _build_llava(path: Path) -> Path:
    import transformers as tf

    tok = make_tokenizer(["<image>"], extra={"image_token": "<image>"})
    ip = tf.CLIPImageProcessorPil(size={"shortest_edge": 56},
                                  crop_size={"height": 56, "width": 56})
    proc = tf.LlavaProcessor(image_processor=ip, tokenizer=tok, patch_size=14,
                             vision_feature_select_strategy="default",
                             num_additional_image_tokens=1,
                             chat_template=chat_template("<image>\n", images_first=True))
    config = tf.LlavaConfig(
        text_config=text_cfg("llama", len(tok), **special_ids(tok)),
        vision_config=clip_vision(56), image_token_index=ids(tok, "<image>")[0],
        vision_feature_layer=-2, vision_feature_select_strategy="default",
        **special_ids(tok))
    return _finish(path, config, tf.LlavaForConditionalGeneration, proc)


def _build_llava_next(path: Path) -> Path:
    import transformers as tf

    pinpoints = [[56, 56], [56, 112], [112, 56], [112, 112]]
    tok = make_tokenizer(["<image>"], extra={"image_token": "<image>"})
    ip = tf.LlavaNextImageProcessorPil(size={"shortest_edge": 56},
                                       crop_size={"height": 56, "width": 56},
                                       image_grid_pinpoints=pinpoints)
    proc = tf.LlavaNextProcessor(image_processor=ip, tokenizer=tok, patch_size=14,
                                 vision_feature_select_strategy="default",
                                 num_additional_image_tokens=1,
                                 chat_template=chat_template("<image>\n", user="[INST] ",
                                                             assistant=" [/INST]", end=""))
    config = tf.LlavaNextConfig(
        text_config=text_cfg("mistral", len(tok), sliding_window=None, **special_ids(tok)),
        vision_config=clip_vision(56), image_token_index=ids(tok, "<image>")[0],
        image_grid_pinpoints=pinpoints, vision_feature_layer=-2,
        vision_feature_select_strategy="default", **special_ids(tok))
    return _finish(path, config, tf.LlavaNextForConditionalGeneration, proc)


def _build_vipllava(path: Path) -> Path:
    import transformers as tf

    tok = make_tokenizer(["<image>"], extra={"image_token": "<image>"})
    ip = tf.CLIPImageProcessorPil(size={"shortest_edge": 56},
                                  crop_size={"height": 56, "width": 56})
    proc = tf.LlavaProcessor(image_processor=ip, tokenizer=tok, patch_size=14,
                             vision_feature_select_strategy="default",
                             num_additional_image_tokens=1,
                             chat_template=chat_template("<image>\n", user="USER: ",
                                                         images_first=True))
    config = tf.VipLlavaConfig(
        text_config=text_cfg("llama", len(tok), **special_ids(tok)),
        vision_config=clip_vision(56), image_token_index=ids(tok, "<image>")[0],
        vision_feature_layers=[-2, -1], **special_ids(tok))
    return _finish(path, config, tf.VipLlavaForConditionalGeneration, proc)


def _idefics_tokens() -> list[str]:
    return ["<fake_token_around_image>", "<image>", "<end_of_utterance>", "<global-img>",
            *[f"<row_{i}_col_{j}>" for i in range(1, 7) for j in range(1, 7)]]


def _idefics_template(image: str = "<image>") -> str:
    return chat_template(image, user="User:", assistant="Assistant:", end="<end_of_utterance>\n")


def _idefics_vision(model_type: str, image_size: int, patch_size: int) -> dict:
    return dict(model_type=model_type, hidden_size=32, intermediate_size=64,
                num_hidden_layers=2, num_attention_heads=4, image_size=image_size,
                patch_size=patch_size)


def _build_idefics2(path: Path) -> Path:
    import transformers as tf

    tok = make_tokenizer(_idefics_tokens()[:3], extra={
        "image_token": "<image>", "image_boundary_token": "<fake_token_around_image>"})
    ip = tf.Idefics2ImageProcessorPil(do_image_splitting=False,
                                      size={"shortest_edge": 28, "longest_edge": 56})
    proc = tf.Idefics2Processor(image_processor=ip, tokenizer=tok, image_seq_len=4,
                                chat_template=_idefics_template())
    config = tf.Idefics2Config(
        text_config=text_cfg("mistral", len(tok), sliding_window=None, **special_ids(tok)),
        vision_config=_idefics_vision("idefics2_vision", 56, 14),
        perceiver_config=dict(model_type="idefics2_perceiver", hidden_size=64,
                              resampler_n_latents=4, resampler_depth=1, resampler_n_heads=4,
                              resampler_head_dim=16, num_key_value_heads=2),
        image_token_id=ids(tok, "<image>")[0], **special_ids(tok))
    return _finish(path, config, tf.Idefics2ForConditionalGeneration, proc)


def _build_idefics3(path: Path) -> Path:
    import transformers as tf

    tok = make_tokenizer(_idefics_tokens(), extra={"image_token": "<image>"})
    ip = tf.Idefics3ImageProcessorPil(size={"longest_edge": 64},
                                      max_image_size={"longest_edge": 32})
    proc = tf.Idefics3Processor(image_processor=ip, tokenizer=tok, image_seq_len=4,
                                chat_template=_idefics_template())
    config = tf.Idefics3Config(
        text_config=text_cfg("llama", len(tok), **special_ids(tok)),
        vision_config=_idefics_vision("idefics3_vision", 32, 8), scale_factor=2,
        image_token_id=ids(tok, "<image>")[0], **special_ids(tok))
    return _finish(path, config, tf.Idefics3ForConditionalGeneration, proc)


GEMMA_TURNS = ["<start_of_turn>", "<end_of_turn>"]
SLIDING = ["sliding_attention", "full_attention"]


def _gemma_template(image: str) -> str:
    return chat_template(image, user="<start_of_turn>user\n",
                         assistant="<start_of_turn>model\n", end="<end_of_turn>\n")


def _build_gemma3(path: Path) -> Path:
    import transformers as tf

    tok = make_tokenizer([*GEMMA_TURNS, "<start_of_image>", "<end_of_image>",
                          "<image_soft_token>"],
                         extra={"boi_token": "<start_of_image>", "eoi_token": "<end_of_image>",
                                "image_token": "<image_soft_token>"})
    ip = tf.Gemma3ImageProcessorPil(size={"height": 56, "width": 56})
    proc = tf.Gemma3Processor(image_processor=ip, tokenizer=tok, image_seq_length=4,
                              chat_template=_gemma_template("<start_of_image>"))
    boi, eoi, img = ids(tok, "<start_of_image>", "<end_of_image>", "<image_soft_token>")
    config = tf.Gemma3Config(
        text_config=text_cfg("gemma3_text", len(tok), layer_types=SLIDING, sliding_window=16,
                             query_pre_attn_scalar=16, **special_ids(tok)),
        vision_config=siglip_vision(56, 14), mm_tokens_per_image=4, boi_token_index=boi,
        eoi_token_index=eoi, image_token_index=img, **special_ids(tok))
    return _finish(path, config, tf.Gemma3ForConditionalGeneration, proc)


GEMMA4_MARKS = {"boi_token": "<|image>", "eoi_token": "<image|>", "image_token": "<|image|>",
                "boa_token": "<|audio>", "eoa_token": "<audio|>", "audio_token": "<|audio|>"}


def _build_gemma4(path: Path, **moe) -> Path:
    import transformers as tf

    # the processor adds <|video|> to its tokenizer: present from the start, in the vocabulary
    tok = make_tokenizer([*GEMMA_TURNS, *GEMMA4_MARKS.values(), "<|video|>"],
                         extra=GEMMA4_MARKS)
    # max_soft_tokens 70 (its least): up to 280 patches of 8 px, pooled 2x2
    sizes = dict(patch_size=8, pooling_kernel_size=2, max_soft_tokens=70)
    proc = tf.Gemma4Processor(feature_extractor=tf.Gemma4AudioFeatureExtractor(),
                              image_processor=tf.Gemma4ImageProcessorPil(**sizes),
                              tokenizer=tok, video_processor=tf.Gemma4VideoProcessor(**sizes),
                              chat_template=_gemma_template("<|image|>"))
    marks = dict(zip(GEMMA4_MARKS, ids(tok, *GEMMA4_MARKS.values()), strict=True))
    # sliding, full, full, then two layers reusing the K/V of layers 0 and 2: the full layer
    # 1's image rows reach the output through layer 2's keys
    kinds = [*SLIDING, *SLIDING[::-1], SLIDING[1]]
    text = text_cfg(
        "gemma4_text", len(tok), num_hidden_layers=5, layer_types=kinds,
        sliding_window=16, num_kv_shared_layers=2, hidden_size_per_layer_input=8,
        vocab_size_per_layer_input=len(tok), global_head_dim=32, attention_k_eq_v=True,
        num_global_key_value_heads=1, use_bidirectional_attention="vision",
        final_logit_softcapping=30.0, **moe, **special_ids(tok))
    vision = dict(model_type="gemma4_vision", hidden_size=32, intermediate_size=64,
                  num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=4,
                  head_dim=8, patch_size=8, pooling_kernel_size=2, position_embedding_size=64)
    config = tf.Gemma4Config(
        text_config=text, vision_config=vision, audio_config=None,
        boi_token_id=marks["boi_token"], eoi_token_id=marks["eoi_token"],
        image_token_id=marks["image_token"], video_token_id=ids(tok, "<|video|>")[0],
        boa_token_id=marks["boa_token"], eoa_token_index=marks["eoa_token"],
        audio_token_id=marks["audio_token"], **special_ids(tok))
    return _finish(path, config, tf.Gemma4ForConditionalGeneration, proc)


def _build_paligemma(path: Path) -> Path:
    import transformers as tf

    tok = make_tokenizer(["<image>"], extra={"image_token": "<image>"}, add_bos=False)
    ip = tf.SiglipImageProcessorPil(size={"height": 56, "width": 56})
    ip.image_seq_length = 16
    proc = tf.PaliGemmaProcessor(image_processor=ip, tokenizer=tok,
                                 chat_template=chat_template("<image>", user="", assistant="",
                                                             end="", images_first=True))
    config = tf.PaliGemmaConfig(
        text_config=text_cfg("gemma2", len(tok), layer_types=SLIDING, sliding_window=16,
                             query_pre_attn_scalar=16, **special_ids(tok)),
        vision_config=siglip_vision(56, 14, projection_dim=64), projection_dim=64,
        hidden_size=64, image_token_index=ids(tok, "<image>")[0], **special_ids(tok))
    return _finish(path, config, tf.PaliGemmaForConditionalGeneration, proc)


def _build_aya_vision(path: Path) -> Path:
    import transformers as tf

    marks = ["<|START_OF_IMG|>", "<|END_OF_IMG|>", "<|IMG_PATCH|>", "<|IMG_LINE_BREAK|>",
             "<image>"]
    tok = make_tokenizer(marks, extra={"image_token": "<image>"})
    ip = tf.GotOcr2ImageProcessorPil(size={"height": 56, "width": 56}, crop_to_patches=True,
                                     min_patches=1, max_patches=4)
    proc = tf.AyaVisionProcessor(image_processor=ip, tokenizer=tok, patch_size=14, img_size=56,
                                 downsample_factor=2, chat_template=chat_template("<image>"))
    config = tf.AyaVisionConfig(
        text_config=text_cfg("cohere2", len(tok), layer_types=SLIDING, sliding_window=16,
                             logit_scale=1.0, **special_ids(tok)),
        vision_config=siglip_vision(56, 14), downsample_factor=2,
        image_token_index=ids(tok, "<|IMG_PATCH|>")[0], **special_ids(tok))
    return _finish(path, config, tf.AyaVisionForConditionalGeneration, proc)


def pixtral_vision(image_size: int = 56, patch_size: int = 14) -> dict:
    return dict(model_type="pixtral", hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                num_attention_heads=4, head_dim=8, image_size=image_size, patch_size=patch_size)


def _build_lighton_ocr(path: Path) -> Path:
    import transformers as tf

    marks = ["<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>",
             "<|image_pad|>", "[IMG_BREAK]", "[IMG_END]"]
    tok = make_tokenizer(marks, extra={"image_token": "<|image_pad|>",
                                       "image_break_token": "[IMG_BREAK]",
                                       "image_end_token": "[IMG_END]"}, add_bos=False)
    ip = tf.PixtralImageProcessorPil(size={"longest_edge": 84}, patch_size=28)
    proc = tf.LightOnOcrProcessor(
        image_processor=ip, tokenizer=tok, patch_size=14, spatial_merge_size=2,
        chat_template=chat_template("<|image_pad|>", user="<|im_start|>user\n",
                                    assistant="<|im_start|>assistant\n", end="<|im_end|>\n"))
    config = tf.LightOnOcrConfig(
        text_config=text_cfg("qwen3", len(tok), **special_ids(tok)),
        vision_config=pixtral_vision(84, 14), spatial_merge_size=2,
        image_token_id=ids(tok, "<|image_pad|>")[0], **special_ids(tok))
    return _finish(path, config, tf.LightOnOcrForConditionalGeneration, proc)


CHATML = ["<|im_start|>", "<|im_end|>"]


def _chatml(image: str) -> str:
    return chat_template(image, user="<|im_start|>user\n", assistant="<|im_start|>assistant\n",
                         end="<|im_end|>\n")


def _build_deepseek_vl(path: Path) -> Path:
    import transformers as tf

    tok = make_tokenizer(["<image_placeholder>"], extra={"image_token": "<image_placeholder>"})
    ip = tf.DeepseekVLImageProcessorPil(size={"height": 56, "width": 56})
    proc = tf.DeepseekVLProcessor(image_processor=ip, tokenizer=tok, num_image_tokens=16,
                                  chat_template=chat_template("<image_placeholder>",
                                                              user="User: ",
                                                              assistant="Assistant:"))
    config = tf.DeepseekVLConfig(
        text_config=text_cfg("llama", len(tok), **special_ids(tok)),
        vision_config=siglip_vision(56, 14),
        image_token_id=ids(tok, "<image_placeholder>")[0], **special_ids(tok))
    return _finish(path, config, tf.DeepseekVLForConditionalGeneration, proc)


def _build_got_ocr2(path: Path) -> Path:
    import transformers as tf

    marks = [*CHATML, "<img>", "</img>", "<imgpad>"]
    tok = make_tokenizer(marks, extra={"image_token": "<imgpad>"}, add_bos=False,
                         bos="<|im_start|>", eos="<|im_end|>")
    ip = tf.GotOcr2ImageProcessorPil(size={"height": 256, "width": 256})
    proc = tf.GotOcr2Processor(image_processor=ip, tokenizer=tok,
                               chat_template=_chatml("<img><imgpad></img>\n"))
    config = tf.GotOcr2Config(
        text_config=text_cfg("qwen2", len(tok), **special_ids(tok)),
        vision_config=dict(hidden_size=32, output_channels=16, num_hidden_layers=2,
                           num_attention_heads=4, image_size=256, patch_size=4, window_size=8,
                           global_attn_indexes=[], mlp_dim=64),
        image_token_index=ids(tok, "<imgpad>")[0], image_seq_length=256, **special_ids(tok))
    return _finish(path, config, tf.GotOcr2ForConditionalGeneration, proc)


def _intern_vision(tok) -> dict:
    """An InternVL-style tower on 56 px tiles, pixel shuffle 0.5: 4 <IMG_CONTEXT> a tile."""
    return dict(vision_config=dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                   intermediate_size=64, image_size=56, patch_size=14),
                image_token_id=ids(tok, "<IMG_CONTEXT>")[0], image_seq_length=4,
                downsample_ratio=0.5, **special_ids(tok))


def _build_qianfan_ocr(path: Path) -> Path:
    import transformers as tf

    marks = [*CHATML, "<img>", "</img>", "<IMG_CONTEXT>", "<image>"]
    tok = make_tokenizer(marks, extra={"start_image_token": "<img>",
                                       "end_image_token": "</img>",
                                       "context_image_token": "<IMG_CONTEXT>"},
                         add_bos=False, bos="<|im_start|>", eos="<|im_end|>")
    ip = tf.GotOcr2ImageProcessorPil(size={"height": 56, "width": 56}, crop_to_patches=True,
                                     min_patches=1, max_patches=4)
    proc = tf.QianfanOCRProcessor(image_processor=ip, tokenizer=tok, image_seq_length=4,
                                  chat_template=_chatml("<image>\n"))
    config = tf.QianfanOCRConfig(
        text_config=text_cfg("qwen3", len(tok), **special_ids(tok)),
        **_intern_vision(tok))
    return _finish(path, config, tf.QianfanOCRForConditionalGeneration, proc)


def _build_ovis2(path: Path) -> Path:
    import transformers as tf

    marks = [*CHATML, "<image>", "<IMG_START>", "<IMG_ATOM>", "<IMG_GRID>", "<IMG_COL>",
             "<IMG_ROW>", "<IMG_END>"]
    tok = make_tokenizer(marks, extra={"image_token": "<image>"}, add_bos=False,
                         bos="<|im_start|>", eos="<|im_end|>")
    ip = tf.Ovis2ImageProcessorPil(size={"height": 56, "width": 56}, crop_to_patches=True,
                                   min_patches=1, max_patches=4)
    proc = tf.Ovis2Processor(image_processor=ip, tokenizer=tok, image_seq_length=4,
                             chat_template=_chatml("<image>\n"))
    indicators = ids(tok, "<IMG_START>", "<IMG_GRID>", "<IMG_COL>", "<IMG_ROW>", "<IMG_END>")
    config = tf.Ovis2Config(
        text_config=text_cfg("qwen2", len(tok), **special_ids(tok)),
        vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                           num_attention_heads=4, image_size=56, patch_size=14, vocab_size=64,
                           hidden_stride=2, num_visual_indicator_tokens=5),
        image_token_id=ids(tok, "<IMG_ATOM>")[0], visual_indicator_token_ids=indicators,
        vocab_size=len(tok), hidden_size=64, **special_ids(tok))
    return _finish(path, config, tf.Ovis2ForConditionalGeneration, proc)


def _build_janus(path: Path) -> Path:
    import transformers as tf

    marks = ["<image_placeholder>", "<begin_of_image>", "<end_of_image>"]
    tok = make_tokenizer(marks, extra={"image_token": "<image_placeholder>",
                                       "boi_token": "<begin_of_image>",
                                       "eoi_token": "<end_of_image>"})
    ip = tf.JanusImageProcessorPil(size={"height": 32, "width": 32})
    proc = tf.JanusProcessor(image_processor=ip, tokenizer=tok, num_image_tokens=16,
                             chat_template=chat_template("<image_placeholder>\n",
                                                         user="<|User|>: ",
                                                         assistant="<|Assistant|>:"))
    config = tf.JanusConfig(
        text_config=text_cfg("llama", len(tok), **special_ids(tok)),
        vision_config=dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                           image_size=32, patch_size=8, mlp_ratio=2.0, projection_dim=64,
                           depth=2, num_image_tokens=16),
        vq_config=dict(embed_dim=8, num_embeddings=32, latent_channels=32, base_channels=32,
                       channel_multiplier=[1, 1], num_res_blocks=1, num_patches=8,
                       projection_dim=64, image_token_embed_dim=64, num_hidden_layers=1),
        image_token_id=ids(tok, "<image_placeholder>")[0], **special_ids(tok))
    return _finish(path, config, tf.JanusForConditionalGeneration, proc)


def _build_deepseek_vl_hybrid(path: Path) -> Path:
    import transformers as tf

    tok = make_tokenizer(["<image_placeholder>"], extra={"image_token": "<image_placeholder>"})
    ip = tf.DeepseekVLHybridImageProcessorPil(size={"height": 56, "width": 56},
                                              high_res_size={"height": 64, "width": 64})
    proc = tf.DeepseekVLHybridProcessor(
        image_processor=ip, tokenizer=tok, num_image_tokens=16,
        chat_template=chat_template("<image_placeholder>", user="User: ",
                                    assistant="Assistant:"))
    config = tf.DeepseekVLHybridConfig(
        text_config=text_cfg("llama", len(tok), **special_ids(tok)),
        vision_config=siglip_vision(56, 14),
        high_res_vision_config=dict(model_type="sam_vision_model", hidden_size=32,
                                    output_channels=16, num_hidden_layers=2,
                                    num_attention_heads=4, image_size=64, patch_size=8,
                                    window_size=4, global_attn_indexes=[1], mlp_dim=64),
        image_token_id=ids(tok, "<image_placeholder>")[0], **special_ids(tok))
    return _finish(path, config, tf.DeepseekVLHybridForConditionalGeneration, proc)


def _qwen_marks() -> list[str]:
    return [*CHATML, "<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]


def _build_paddleocr_vl(path: Path) -> Path:
    import transformers as tf

    tok = make_tokenizer(_qwen_marks(), extra={"image_token": "<|image_pad|>"}, add_bos=False,
                         bos="<|im_start|>", eos="<|im_end|>")
    ip = tf.PaddleOCRVLImageProcessorPil(size={"shortest_edge": 56 * 56,
                                               "longest_edge": 112 * 112},
                                         patch_size=14, merge_size=2)
    proc = tf.PaddleOCRVLProcessor(
        image_processor=ip, tokenizer=tok,
        chat_template=_chatml("<|vision_start|><|image_pad|><|vision_end|>"))
    img, vid, vs, ve = ids(tok, "<|image_pad|>", "<|video_pad|>", "<|vision_start|>",
                           "<|vision_end|>")
    config = tf.PaddleOCRVLConfig(
        text_config=text_cfg("paddleocr_vl_text", len(tok), use_bias=False,
                             rope_parameters=dict(rope_type="default", rope_theta=10000.0,
                                                  mrope_section=[2, 3, 3]),
                             **special_ids(tok)),
        vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                           num_attention_heads=4, image_size=56, patch_size=14,
                           spatial_merge_size=2),
        image_token_id=img, video_token_id=vid, vision_start_token_id=vs,
        vision_end_token_id=ve, **special_ids(tok))
    return _finish(path, config, tf.PaddleOCRVLForConditionalGeneration, proc)


def _build_hunyuan_vl(path: Path) -> Path:
    import transformers as tf

    marks = [*CHATML, "<image>", "<img>", "</img>", "<img_newline>"]
    tok = make_tokenizer(marks, extra={"image_token": "<image>", "image_start_token": "<img>",
                                       "image_end_token": "</img>"})
    ip = tf.HunYuanVLImageProcessorPil(size={"shortest_edge": 32 * 32,
                                             "longest_edge": 4 * 32 * 32},
                                       patch_size=16, merge_size=2)
    proc = tf.HunYuanVLProcessor(image_processor=ip, tokenizer=tok,
                                 chat_template=_chatml("<img><image></img>"))
    img, start, end, nl = ids(tok, "<image>", "<img>", "</img>", "<img_newline>")
    config = tf.HunYuanVLConfig(
        text_config=text_cfg("hunyuan_vl_text", len(tok),
                             rope_parameters=dict(rope_type="default", rope_theta=10000.0,
                                                  mrope_section=[2, 2, 2, 2]),
                             **special_ids(tok)),
        vision_config=dict(hidden_size=32, intermediate_size=64, num_attention_heads=4,
                           num_hidden_layers=2, out_hidden_size=64, patch_size=16,
                           spatial_merge_size=2, text_hidden_size=64, max_image_size=128,
                           min_image_size=32),
        image_token_id=img, im_start_id=start, im_end_id=end, im_newline_id=nl,
        **special_ids(tok))
    return _finish(path, config, tf.HunYuanVLForConditionalGeneration, proc)


def _build_shieldgemma2(path: Path) -> Path:
    import transformers as tf

    tok = make_tokenizer([*GEMMA_TURNS, "<start_of_image>", "<end_of_image>",
                          "<image_soft_token>"],
                         extra={"boi_token": "<start_of_image>", "eoi_token": "<end_of_image>",
                                "image_token": "<image_soft_token>"})
    ip = tf.Gemma3ImageProcessorPil(size={"height": 56, "width": 56})
    proc = tf.ShieldGemma2Processor(
        image_processor=ip, tokenizer=tok, image_seq_length=4,
        policy_definitions={"dangerous": "No dangerous content."},
        chat_template=_gemma_template("<start_of_image>"))
    boi, eoi, img = ids(tok, "<start_of_image>", "<end_of_image>", "<image_soft_token>")
    config = tf.ShieldGemma2Config(
        text_config=text_cfg("gemma3_text", len(tok), layer_types=SLIDING, sliding_window=16,
                             query_pre_attn_scalar=16, **special_ids(tok)),
        vision_config=siglip_vision(56, 14), mm_tokens_per_image=4, boi_token_index=boi,
        eoi_token_index=eoi, image_token_index=img, **special_ids(tok))
    return _finish(path, config, tf.Gemma3ForConditionalGeneration, proc)


def _build_blip_2(path: Path) -> Path:
    import transformers as tf

    tok = make_tokenizer(["<image>"])  # Blip2Processor wants no tokenizer.image_token
    ip = tf.BlipImageProcessorPil(size={"height": 56, "width": 56})
    proc = tf.Blip2Processor(image_processor=ip, tokenizer=tok, num_query_tokens=4)
    config = tf.Blip2Config(
        text_config=dict(model_type="opt", vocab_size=len(tok), hidden_size=64,
                         num_hidden_layers=2, num_attention_heads=4, ffn_dim=128,
                         word_embed_proj_dim=64, max_position_embeddings=512,
                         **special_ids(tok)),
        vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                           num_attention_heads=4, image_size=56, patch_size=14),
        qformer_config=dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                            intermediate_size=64, encoder_hidden_size=32,
                            cross_attention_frequency=1, vocab_size=len(tok)),
        num_query_tokens=4, image_text_hidden_size=32,
        image_token_index=ids(tok, "<image>")[0], **special_ids(tok))
    return _finish(path, config, tf.Blip2ForConditionalGeneration, proc)


def _build_instructblip(path: Path) -> Path:
    import transformers as tf

    tok = make_tokenizer(["<image>"])  # as BLIP-2: the processor wants no image_token attribute
    # the Q-Former reads the prompt too, through its own (BERT-like) tokenizer
    qtok = make_tokenizer(["[CLS]", "[SEP]", "[MASK]"], bos="[CLS]", eos="[SEP]",
                          add_bos=True)
    ip = tf.BlipImageProcessorPil(size={"height": 56, "width": 56})
    proc = tf.InstructBlipProcessor(image_processor=ip, tokenizer=tok, qformer_tokenizer=qtok,
                                    num_query_tokens=4)
    config = tf.InstructBlipConfig(
        text_config=text_cfg("llama", len(tok), **special_ids(tok)),
        vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                           num_attention_heads=4, image_size=56, patch_size=14),
        qformer_config=dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                            intermediate_size=64, encoder_hidden_size=32,
                            cross_attention_frequency=1, vocab_size=len(qtok),
                            pad_token_id=qtok.pad_token_id),
        num_query_tokens=4, image_token_index=ids(tok, "<image>")[0], **special_ids(tok))
    return _finish(path, config, tf.InstructBlipForConditionalGeneration, proc)


def _build_chameleon(path: Path) -> Path:
    import transformers as tf

    num_codes = 32
    codes = ["IMGIMG" + "".join(chr(ord("A") + int(c)) for c in str(i)) + "Z"
             for i in range(num_codes)]
    tok = make_tokenizer(["<image>", "<racm3:break>", "<eoss>"],
                         extra={"image_token": "<image>", "boi_token": "<racm3:break>",
                                "eoi_token": "<eoss>"}, plain_tokens=codes)
    ip = tf.ChameleonImageProcessorPil(size={"shortest_edge": 32},
                                       crop_size={"height": 32, "width": 32})
    proc = tf.ChameleonProcessor(image_processor=ip, tokenizer=tok, image_seq_length=64)
    config = tf.ChameleonConfig(
        **text_cfg("chameleon", len(tok)), **special_ids(tok),
        vq_config=dict(embed_dim=8, num_embeddings=num_codes, latent_channels=32,
                       resolution=32, base_channels=32, channel_multiplier=[1, 1, 2],
                       num_res_blocks=1, attn_resolutions=[]),
        vocabulary_map=tok.get_vocab())
    return _finish(path, config, tf.ChameleonForConditionalGeneration, proc)


def _build_aria(path: Path) -> Path:
    import transformers as tf

    tok = make_tokenizer([*CHATML, "<|img|>", "<fim_prefix>", "<fim_suffix>"],
                         extra={"image_token": "<|img|>"})
    # the processor passes max_image_size=980 itself: a 70 px patch keeps it at 14x14 patches
    ip = tf.AriaImageProcessorPil(max_image_size=980, min_image_size=490)
    proc = tf.AriaProcessor(image_processor=ip, tokenizer=tok, size_conversion={980: 4, 490: 4},
                            chat_template=_chatml("<fim_prefix><|img|><fim_suffix>"))
    config = tf.AriaConfig(
        text_config=text_cfg("aria_text", len(tok), moe_num_experts=4, moe_topk=2,
                             moe_num_shared_experts=1, **special_ids(tok)),
        vision_config=_idefics_vision("idefics3_vision", 980, 70),
        projector_patch_to_query_dict={196: 4, 49: 4},
        image_token_index=ids(tok, "<|img|>")[0], **special_ids(tok))
    return _finish(path, config, tf.AriaForConditionalGeneration, proc)


def _build_granite4_vision(path: Path) -> Path:
    import transformers as tf

    pinpoints = [[56, 56], [56, 112], [112, 56], [112, 112]]
    tok = make_tokenizer(["<image>"], extra={"image_token": "<image>"})
    ip = tf.LlavaNextImageProcessorPil(size={"shortest_edge": 56},
                                       crop_size={"height": 56, "width": 56},
                                       image_grid_pinpoints=pinpoints)
    proc = tf.Granite4VisionProcessor(
        image_processor=ip, tokenizer=tok, patch_size=14,
        vision_feature_select_strategy="default", num_additional_image_tokens=1,
        downsample_rate="1/2", chat_template=chat_template("<image>\n", images_first=True))
    config = tf.Granite4VisionConfig(
        text_config=text_cfg("granite4_vision_text", len(tok), num_hidden_layers=4,
                             **special_ids(tok)),
        # the window Q-Former takes vision hidden // 64 heads: a 64-wide tower
        vision_config=clip_vision(56, hidden_size=64, intermediate_size=128),
        image_token_index=ids(tok, "<image>")[0], image_grid_pinpoints=pinpoints,
        vision_feature_layer=-1,
        vision_feature_select_strategy="default", downsample_rate="1/2",
        deepstack_layer_map=[[-2, 0], [-1, 1]], spatial_vision_layer=-1,
        spatial_target_layers=[0, 1, 2, 3], projector_dropout=0.0,
        qformer_config=dict(num_hidden_layers=1, intermediate_size=128),
        **special_ids(tok))
    return _finish(path, config, tf.Granite4VisionForConditionalGeneration, proc)


def _build_granite_docling(path: Path) -> Path:
    import transformers as tf

    roles = ["<|start_of_role|>", "<|end_of_role|>", "<|end_of_text|>"]
    tok = make_tokenizer([*roles, *_idefics_tokens()], extra={"image_token": "<image>"},
                         add_bos=False, bos="<|end_of_text|>", eos="<|end_of_text|>")
    # 32 px tiles (up to 4 + a thumbnail), 4 px patches, pixel shuffle x4: 4 tokens a tile
    ip = tf.GraniteDoclingImageProcessorPil(size={"height": 32, "width": 32}, max_patches=4)
    proc = tf.GraniteDoclingProcessor(
        image_processor=ip, tokenizer=tok, image_seq_len=4,
        chat_template=chat_template("<image>", user="<|start_of_role|>user<|end_of_role|>",
                                    assistant="<|start_of_role|>assistant<|end_of_role|>",
                                    end="<|end_of_text|>\n"))
    config = tf.GraniteDoclingConfig(
        text_config=text_cfg("granite_docling_text", len(tok), **special_ids(tok)),
        vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                           num_attention_heads=4, image_size=32, patch_size=4,
                           out_hidden_size=64, scale_factor=4, deepstack_visual_indexes=[0, 1],
                           use_fine_route=False),
        image_token_id=ids(tok, "<image>")[0], **special_ids(tok))
    return _finish(path, config, tf.GraniteDoclingForConditionalGeneration, proc)


def _build_deepseek_ocr2(path: Path) -> Path:
    import transformers as tf

    tok = make_tokenizer(["<image>", "<|User|>", "<|Assistant|>"],
                         extra={"image_token": "<image>"})
    # the encoder's learned queries are fixed: 256 for a view of 16x16 SAM features (global),
    # 144 for 12x12 (a tile): 128 px global / 96 px tiles at SAM patch 2, two stride-2 convs
    ip = tf.DeepseekOcr2ImageProcessorPil(size={"height": 128, "width": 128}, tile_size=96)
    proc = tf.DeepseekOcr2Processor(
        image_processor=ip, tokenizer=tok, patch_size=2, downsample_ratio=4,
        chat_template=chat_template("<image>\n", user="<|User|>", assistant="<|Assistant|>"))
    config = tf.DeepseekOcr2Config(
        text_config=text_cfg("deepseek_ocr2_text", len(tok), num_key_value_heads=4,
                             n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1,
                             moe_intermediate_size=32, num_hidden_layers=3,
                             # a sparse layer early makes the tiny model repeat one token
                             mlp_layer_types=["dense", "dense", "sparse"],
                             **special_ids(tok)),
        vision_config=dict(
            sam_config=dict(hidden_size=32, output_channels=16, num_hidden_layers=2,
                            num_attention_heads=4, image_size=128, patch_size=2,
                            window_size=8, global_attn_indexes=[], mlp_dim=64,
                            downsample_channels=[16, 32]),
            encoder_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                                vocab_size=1)),
        image_token_id=ids(tok, "<image>")[0], **special_ids(tok))
    return _finish(path, config, tf.DeepseekOcr2ForConditionalGeneration, proc)


def _build_emu3(path: Path) -> Path:
    import transformers as tf

    num_codes = 32
    codes = [f"<|visual token {i:06d}|>" for i in range(num_codes)]
    marks = ["<image>", "<|image start|>", "<|image end|>", "<|image token|>", "<|extra_200|>",
             "<|extra_201|>"]
    tok = make_tokenizer(marks, extra={"image_token": "<image>", "boi_token": "<|image start|>",
                                       "eoi_token": "<|image end|>",
                                       "image_wrapper_token": "<|image token|>",
                                       "eof_token": "<|extra_201|>"},
                         plain_tokens=codes, add_bos=False)  # the processor adds the BOS
    ip = tf.Emu3ImageProcessor(min_pixels=32 * 32, max_pixels=40 * 40, spatial_factor=8)
    proc = tf.Emu3Processor(image_processor=ip, tokenizer=tok,
                            chat_template=chat_template("<image>"))
    config = tf.Emu3Config(
        text_config=text_cfg("emu3_text", len(tok), **special_ids(tok)),
        vq_config=dict(codebook_size=num_codes, embed_dim=4, latent_channels=4,
                       base_channels=32, channel_multiplier=[1, 1, 1, 1], num_res_blocks=1,
                       attn_resolutions=[], hidden_size=32, num_attention_heads=1,
                       temporal_downsample_factor=4),
        vocabulary_map=tok.get_vocab(), **special_ids(tok))
    return _finish(path, config, tf.Emu3ForConditionalGeneration, proc)


# ------------------------------------------------- builders whose processors need torchvision
def _build_internvl(path: Path) -> Path:
    import transformers as tf

    marks = [*CHATML, "<img>", "</img>", "<IMG_CONTEXT>", "<video>"]
    tok = make_tokenizer(marks, extra={"start_image_token": "<img>",
                                       "end_image_token": "</img>",
                                       "context_image_token": "<IMG_CONTEXT>",
                                       "video_token": "<video>"},
                         add_bos=False, bos="<|im_start|>", eos="<|im_end|>")
    ip = tf.GotOcr2ImageProcessor(size={"height": 56, "width": 56}, crop_to_patches=True,
                                  min_patches=1, max_patches=4)
    proc = tf.InternVLProcessor(image_processor=ip, tokenizer=tok,
                                video_processor=tf.InternVLVideoProcessor(),
                                image_seq_length=4, chat_template=_chatml("<IMG_CONTEXT>\n"))
    config = tf.InternVLConfig(
        text_config=text_cfg("qwen2", len(tok), **special_ids(tok)),
        **_intern_vision(tok))
    return _finish(path, config, tf.InternVLForConditionalGeneration, proc)


def _build_mistral3(path: Path) -> Path:
    import transformers as tf

    marks = ["[INST]", "[/INST]", "[IMG]", "[IMG_BREAK]", "[IMG_END]"]
    tok = make_tokenizer(marks, extra={"image_token": "[IMG]"})
    ip = tf.PixtralImageProcessor(size={"longest_edge": 84}, patch_size=14)
    proc = tf.PixtralProcessor(image_processor=ip, tokenizer=tok, patch_size=14,
                               spatial_merge_size=2, image_token="[IMG]",
                               image_break_token="[IMG_BREAK]", image_end_token="[IMG_END]",
                               chat_template=chat_template("[IMG]", user="[INST]",
                                                           assistant="[/INST]", end=""))
    config = tf.Mistral3Config(
        text_config=text_cfg("mistral", len(tok), sliding_window=None, **special_ids(tok)),
        vision_config=pixtral_vision(84, 14), spatial_merge_size=2,
        image_token_index=ids(tok, "[IMG]")[0], **special_ids(tok))
    return _finish(path, config, tf.Mistral3ForConditionalGeneration, proc)


def _build_smolvlm(path: Path) -> Path:
    import transformers as tf

    tok = make_tokenizer([*_idefics_tokens(), "<video>"], extra={
        "image_token": "<image>", "fake_image_token": "<fake_token_around_image>",
        "global_image_token": "<global-img>", "end_of_utterance_token": "<end_of_utterance>",
        "video_token": "<video>"})
    ip = tf.SmolVLMImageProcessor(size={"longest_edge": 64},
                                  max_image_size={"longest_edge": 32})
    proc = tf.SmolVLMProcessor(image_processor=ip, tokenizer=tok,
                               video_processor=tf.SmolVLMVideoProcessor(), image_seq_len=4,
                               chat_template=_idefics_template())
    config = tf.SmolVLMConfig(
        text_config=text_cfg("llama", len(tok), **special_ids(tok)),
        vision_config=_idefics_vision("smolvlm_vision", 32, 8), scale_factor=2,
        image_token_id=ids(tok, "<image>")[0], **special_ids(tok))
    return _finish(path, config, tf.SmolVLMForConditionalGeneration, proc)


def _build_llava_onevision(path: Path) -> Path:
    import transformers as tf

    pinpoints = [[56, 56], [56, 112], [112, 56], [112, 112]]
    tok = make_tokenizer([*CHATML, "<image>", "<video>"],
                         extra={"image_token": "<image>", "video_token": "<video>"},
                         add_bos=False, bos="<|im_start|>", eos="<|im_end|>")
    ip = tf.LlavaOnevisionImageProcessor(size={"height": 56, "width": 56},
                                         image_grid_pinpoints=pinpoints)
    proc = tf.LlavaOnevisionProcessor(
        image_processor=ip, tokenizer=tok, video_processor=tf.LlavaOnevisionVideoProcessor(),
        num_image_tokens=16, vision_feature_select_strategy="full",
        vision_aspect_ratio="anyres_max_9", chat_template=_chatml("<image>\n"))
    config = tf.LlavaOnevisionConfig(
        text_config=text_cfg("qwen2", len(tok), **special_ids(tok)),
        vision_config=siglip_vision(56, 14), image_grid_pinpoints=pinpoints,
        vision_feature_select_strategy="full", vision_feature_layer=-1,
        image_token_index=ids(tok, "<image>")[0], video_token_index=ids(tok, "<video>")[0],
        **special_ids(tok))
    return _finish(path, config, tf.LlavaOnevisionForConditionalGeneration, proc)


def _build_glm4v(path: Path) -> Path:
    import transformers as tf

    marks = ["<|user|>", "<|assistant|>", "<|begin_of_image|>", "<|end_of_image|>",
             "<|image|>", "<|begin_of_video|>", "<|end_of_video|>", "<|video|>"]
    tok = make_tokenizer(marks, extra={"image_token": "<|image|>", "video_token": "<|video|>"},
                         add_bos=False)
    ip = tf.Glm4vImageProcessor(size={"shortest_edge": 28 * 28, "longest_edge": 112 * 112},
                                patch_size=14, temporal_patch_size=2, merge_size=2)
    proc = tf.Glm4vProcessor(
        image_processor=ip, tokenizer=tok, video_processor=tf.Glm4vVideoProcessor(),
        chat_template=chat_template("<|begin_of_image|><|image|><|end_of_image|>",
                                    user="<|user|>\n", assistant="<|assistant|>\n", end="\n"))
    img, vid, bi, ei, bv, ev = ids(tok, "<|image|>", "<|video|>", "<|begin_of_image|>",
                                   "<|end_of_image|>", "<|begin_of_video|>", "<|end_of_video|>")
    config = tf.Glm4vConfig(
        text_config=text_cfg("glm4v_text", len(tok),
                             rope_parameters=dict(rope_type="default", rope_theta=10000.0,
                                                  mrope_section=[2, 3, 3],
                                                  partial_rotary_factor=1.0),
                             **special_ids(tok)),
        vision_config=dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=4,
                           image_size=56, patch_size=14, spatial_merge_size=2,
                           temporal_patch_size=2, out_hidden_size=64),
        image_token_id=img, video_token_id=vid, image_start_token_id=bi,
        image_end_token_id=ei, video_start_token_id=bv, video_end_token_id=ev,
        **special_ids(tok))
    return _finish(path, config, tf.Glm4vForConditionalGeneration, proc)


def _build_llama4(path: Path) -> Path:
    import transformers as tf

    marks = ["<|header_start|>", "<|header_end|>", "<|eot|>", "<|image_start|>",
             "<|image_end|>", "<|image|>", "<|patch|>", "<|tile_x_separator|>",
             "<|tile_y_separator|>"]
    tok = make_tokenizer(marks, extra={"image_token": "<|image|>"})
    ip = tf.Llama4ImageProcessor(size={"height": 56, "width": 56}, max_patches=4)
    proc = tf.Llama4Processor(
        image_processor=ip, tokenizer=tok, patch_size=14, pixel_shuffle_ratio=0.5,
        chat_template=chat_template("<|image|>", user="<|header_start|>user<|header_end|>\n",
                                    assistant="<|header_start|>assistant<|header_end|>\n",
                                    end="<|eot|>"))
    boi, eoi, patch = ids(tok, "<|image_start|>", "<|image_end|>", "<|patch|>")
    config = tf.Llama4Config(
        # 4 layers: chunked attention (16 tokens) with RoPE on layers 0-2, full attention
        # without RoPE on layer 3; MoE (4 experts, top-1, a shared expert) on layers 1 and 3
        text_config=text_cfg("llama4_text", len(tok), num_hidden_layers=4,
                             intermediate_size_mlp=128, num_local_experts=4,
                             num_experts_per_tok=1, interleave_moe_layer_step=2,
                             attention_chunk_size=16, no_rope_layer_interval=4,
                             **special_ids(tok)),
        vision_config=dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                           intermediate_size=128, vision_output_dim=64, image_size=56,
                           patch_size=14, pixel_shuffle_ratio=0.5, projector_input_dim=64,
                           projector_output_dim=64),
        boi_token_index=boi, eoi_token_index=eoi, image_token_index=patch,
        **special_ids(tok))
    return _finish(path, config, tf.Llama4ForConditionalGeneration, proc)


def _build_cohere2_vision(path: Path) -> Path:
    import transformers as tf

    marks = ["<|START_OF_IMG|>", "<|END_OF_IMG|>", "<|IMG_PATCH|>", "<|IMG_LINE_BREAK|>"]
    tok = make_tokenizer(marks, extra={"image_token": "<|IMG_PATCH|>",
                                       "boi_token": "<|START_OF_IMG|>",
                                       "eoi_token": "<|END_OF_IMG|>",
                                       "img_line_break_token": "<|IMG_LINE_BREAK|>"})
    ip = tf.Cohere2VisionImageProcessor(size={"height": 56, "width": 56},
                                        crop_to_patches=True, min_patches=1, max_patches=4,
                                        patch_size=2)  # tokens a tile's side
    proc = tf.Cohere2VisionProcessor(image_processor=ip, tokenizer=tok,
                                     chat_template=chat_template("<|IMG_PATCH|>"))
    config = tf.Cohere2VisionConfig(
        text_config=text_cfg("cohere2", len(tok), layer_types=SLIDING, sliding_window=16,
                             logit_scale=1.0, **special_ids(tok)),
        vision_config=siglip_vision(56, 14), downsample_factor=2,
        alignment_intermediate_size=64, image_token_id=ids(tok, "<|IMG_PATCH|>")[0],
        **special_ids(tok))
    return _finish(path, config, tf.Cohere2VisionForConditionalGeneration, proc)


def _build_lfm2_vl(path: Path) -> Path:
    import transformers as tf

    marks = [*CHATML, "<image>", "<|image_start|>", "<|image_end|>", "<|img_thumbnail|>"]
    tok = make_tokenizer(marks, extra={"image_token": "<image>"}, add_bos=False,
                         bos="<|im_start|>", eos="<|im_end|>")
    ip = tf.Lfm2VlImageProcessor(do_image_splitting=False, min_image_tokens=4,
                                 max_image_tokens=16, encoder_patch_size=14, tile_size=56)
    proc = tf.Lfm2VlProcessor(image_processor=ip, tokenizer=tok,
                              chat_template=_chatml("<image>"))
    config = tf.Lfm2VlConfig(
        text_config=text_cfg("lfm2", len(tok), num_hidden_layers=3,
                             layer_types=["conv", "full_attention", "conv"],
                             **special_ids(tok)),
        vision_config=dict(model_type="siglip2_vision_model", hidden_size=32,
                           intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
                           patch_size=14, num_patches=16),
        projector_hidden_size=64, image_token_id=ids(tok, "<image>")[0], **special_ids(tok))
    return _finish(path, config, tf.Lfm2VlForConditionalGeneration, proc)


# tried and left out, with the reason (transformers 5.25)
UNSUPPORTED: dict[str, str] = {
    "fuyu": "FuyuProcessor passes torch tensors to FuyuImageProcessorPil.patchify_image, "
            "which calls numpy-style transpose (TypeError)",
    "pp_chart2table": "not tried: PPChart2TableProcessor defines no replace_image_token",
    "qwen2_vl": "the built-in tiny-qwen2-vl (and the other Qwen built-ins) run instead",
    "perception_lm": "its vision tower is a timm model (timm is not a test dependency)",
    "idefics": "cross-attention (gated xattn) layers; skipped by design",
    "mllama": "cross-attention layers; skipped by design",
}
# architectures whose processors need torchvision (their rows skip where it does not import)
# the model_type of a table entry that is a variant of another's architecture
MODEL_TYPE = {"gemma4_moe": "gemma4"}
NEEDS_TORCHVISION: frozenset[str] = frozenset({
    "internvl", "mistral3", "smolvlm", "llava_onevision", "glm4v", "llama4", "cohere2_vision",
    "lfm2_vl", "gemma4", "gemma4_moe"})

_BUILDERS: dict[str, tuple[Callable[[Path], Path], str]] = {
    "llava": (_build_llava, "CLIP tower (CLS dropped, feature layer -2), 16 tokens an image"),
    "llava_next": (_build_llava_next, "anyres tiles (pinpoints up to 112x112) + base image, "
                   "an image_newline token per row; Mistral text"),
    "vipllava": (_build_vipllava, "features of several CLIP layers concatenated"),
    "idefics2": (_build_idefics2, "perceiver resampler (4 latents an image), "
                 "<fake_token_around_image> around each image; Mistral text"),
    "idefics3": (_build_idefics3, "tiles (32 px, up to 2x2) + global image, <row_i_col_j> / "
                 "<global-img> markers between, pixel shuffle x2 (4 tokens a tile)"),
    "gemma3": (_build_gemma3, "layer_types sliding(16)+full; images bidirectional within "
               "themselves; <start_of_image> expands to boi + 4 soft tokens + eoi; "
               "token_type_ids from the processor"),
    "paligemma": (_build_paligemma, "gemma2 text (sliding 16 + full), whole prefix "
                  "bidirectional; processor puts images first, then BOS; 16 tokens an image"),
    "aya_vision": (_build_aya_vision, "GotOcr2 tiles (56 px, up to 4 + global) with TILE_i / "
                   "TILE_GLOBAL text markers, pixel shuffle x2; cohere2 text sliding(16)+full"),
    "deepseek_vl": (_build_deepseek_vl, "SigLIP tower + MLP aligner, 16 <image_placeholder> an "
                    "image"),
    "got_ocr2": (_build_got_ocr2, "SAM-style tower (64x64 patches, windowed attention only: a "
                 "global layer over 4096 patches costs seconds; rel. pos) + two stride-2 convs; "
                 "256 <imgpad> an image (the processor's fixed count); flat images list"),
    "qianfan_ocr": (_build_qianfan_ocr, "InternVL-style: tiles (56 px, up to 4 + thumbnail), "
                    "pixel shuffle 0.5, <img><IMG_CONTEXT>x4 a tile</img>"),
    "ovis2": (_build_ovis2, "visual tokenizer (softmax over a 64-entry visual vocab), tiles "
              "with <IMG_START>/<IMG_GRID>/<IMG_COL>/<IMG_ROW>/<IMG_END> indicator tokens"),
    "janus": (_build_janus, "SigLIP-style tower + aligner for understanding; VQ model and gen "
              "head present (unused for text)"),
    "deepseek_vl_hybrid": (_build_deepseek_vl_hybrid, "SigLIP low-res (56 px) + SAM high-res "
                           "(64 px) towers fused; pixel_values + high_res_pixel_values"),
    "paddleocr_vl": (_build_paddleocr_vl, "Qwen2-VL-style: image_grid_thw, 2x2 merge, mRoPE "
                     "(mrope_section [2, 3, 3]); Ernie-4.5 text"),
    "hunyuan_vl": (_build_hunyuan_vl, "image_grid_thw, 2x2 merge, <img>..</img> around the "
                   "expanded tokens (+ newline per row)"),
    "shieldgemma2": (_build_shieldgemma2, "Gemma3ForConditionalGeneration with "
                     "ShieldGemma2Config; processor wraps each image in a policy prompt"),
    "blip-2": (_build_blip_2, "Q-Former (4 query tokens) + OPT decoder; processor prepends "
               "the <image> tokens itself (no chat template); one image a prompt"),
    "instructblip": (_build_instructblip, "BLIP-2-like Q-Former (4 query tokens) that also "
                     "reads the prompt (qformer_input_ids from a second tokenizer); Llama "
                     "(Vicuna) text; processor prepends the <image> tokens; one image a "
                     "prompt"),
    "chameleon": (_build_chameleon, "early fusion: a VQ-VAE turns the 32 px image into 64 "
                  "codes mapped to BPE ids (IMGIMG..Z tokens) via vocabulary_map; "
                  "<racm3:break> / <eoss> around; qk layernorm; no chat template"),
    "aria": (_build_aria, "idefics3-style tower + cross-attention projector (4 queries); MoE "
             "text (4 experts, top-2, 1 shared)"),
    "granite4_vision": (_build_granite4_vision, "llava_next-style anyres tiles; window Q-Former "
                        "downsampler (1/2); deepstack: CLIP layers -2/-1 injected at LLM "
                        "layers 0/1, 4 spatial-offset groups at layers 0-3 (4 text layers)"),
    "granite_docling": (_build_granite_docling, "idefics3-style tiles (32 px, up to 4 + "
                        "thumbnail) with <row_i_col_j> / <global-img> markers, pixel shuffle x4 "
                        "(4 tokens a tile); deepstack: vision layers 0/1 added at LLM layers "
                        "0/1; granite text (embedding/residual/logit multipliers)"),
    "deepseek_ocr2": (_build_deepseek_ocr2, "SAM tower (patch 2, windowed) + two stride-2 "
                      "convs, then a Qwen2-style encoder over features + learned queries (256 "
                      "global / 144 a tile: fixed counts); 96 px tiles past 96 px; a view "
                      "separator; DeepSeek-V2 MoE text (2 dense + 1 sparse layer, 4 experts, "
                      "top-2, 1 shared)"),
    "emu3": (_build_emu3, "early fusion: a VQ-VAE (8x down) turns the image into codes mapped "
             "to <|visual token N|> BPE ids; H*W header text, an <|extra_200|> per row"),
    "lighton_ocr": (_build_lighton_ocr, "Pixtral tower + 2x2 merger, qwen3 text; "
                    "placeholder <|image_pad|> only (no break tokens)"),
    # processors that need torchvision
    "internvl": (_build_internvl, "tiles (56 px, up to 4 + thumbnail), pixel shuffle 0.5, "
                 "<img><IMG_CONTEXT>x4 a tile</img>; qwen2 text"),
    "mistral3": (_build_mistral3, "PixtralProcessor: [IMG] rows with [IMG_BREAK] between, "
                 "[IMG_END]; Pixtral tower (2-D RoPE, any size up to 84 px) + 2x2 patch "
                 "merger; Mistral text"),
    "smolvlm": (_build_smolvlm, "idefics3-style tiles (32 px, up to 2x2) + global image, "
                "<row_i_col_j> / <global-img> markers, pixel shuffle x2 (4 tokens a tile)"),
    "llava_onevision": (_build_llava_onevision, "anyres tiles (pinpoints up to 112x112) + "
                        "base image, SigLIP (full features), newline rows, anyres_max_9 "
                        "unpadding; qwen2 text"),
    "glm4v": (_build_glm4v, "image_grid_thw, 2x2 merge, 3-axis mRoPE (its own get_rope_index), "
              "<|begin_of_image|>..<|end_of_image|> around the expanded <|image|> tokens"),
    "llama4": (_build_llama4, "tiles (56 px, up to 4 + global), pixel shuffle 0.5 (4 <|patch|> "
               "a tile), tile separators; chunked attention (16) on RoPE layers, full "
               "attention without RoPE on layer 3; MoE (4 experts, top-1, shared expert) on "
               "layers 1 and 3"),
    "lfm2_vl": (_build_lfm2_vl, "lfm2 text: gated short-convolution layers (kernel 3, "
                "their conv state in the engine's state pools) around a full-attention layer; "
                "SigLIP2 tower (4 to 16 tokens an image, no tiling), pixel unshuffle x2"),
    "cohere2_vision": (_build_cohere2_vision, "tiles (56 px, up to 4 + global), pixel shuffle "
                       "x2, a line break per tile; cohere2 text sliding(16)+full"),
    "gemma4": (_build_gemma4, "layer_types sliding(16)+full with a rotary each, full layers "
               "of head_dim 32 and one KV head (k = v) beside sliding ones of 16 and two; the "
               "last two layers reuse the K/V of layers 0/2; per-layer inputs (8 a layer) from "
               "the token ids; images (up to 70 soft tokens, longer than the window) both ways "
               "within themselves on sliding layers only; logit soft-capping; no audio tower"),
    # (its model_type is gemma4's: `MODEL_TYPE`)
    "gemma4_moe": (lambda path: _build_gemma4(path, enable_moe_block=True, num_experts=4,
                                              top_k_experts=2, moe_intermediate_size=32),
                   "gemma4's layers with a block of 4 experts (2 a token) beside each MLP"),
}

TINY_ARCHS: dict[str, str] = {k: note for k, (_, note) in _BUILDERS.items()}
# archs whose processor or model takes one image a prompt
SINGLE_IMAGE: frozenset[str] = frozenset({"got_ocr2", "blip-2", "shieldgemma2",
                                          "instructblip"})
# archs whose processor keeps no chat template (the prompt is plain text; images go first)
NO_CHAT_TEMPLATE: frozenset[str] = frozenset({"blip-2", "chameleon", "instructblip"})


def plain_prompt(model_type: str, num_images: int) -> str:
    """The prompt of an arch in ``NO_CHAT_TEMPLATE`` (BLIP-2's processor adds the image tokens)."""
    if model_type == "chameleon":
        return "<image>" * num_images + "Describe the image.\n"
    return "Describe the image.\n"
# archs whose processor takes a flat list of images (one a prompt), not one list per prompt
FLAT_IMAGES: frozenset[str] = frozenset({"got_ocr2"})


def build_tiny(model_type: str, path: Path) -> Path:
    """Write the tiny ``model_type`` checkpoint (config, weights, tokenizer, processor) into
    ``path`` and return it."""
    if model_type not in _BUILDERS:
        raise KeyError(f"no tiny builder for {model_type!r}; known: {sorted(_BUILDERS)}")
    return _BUILDERS[model_type][0](Path(path))
