"""What the engine needs from a vision-language model, and the check that a model class has it.

The runner, executor, loader, scheduler and encoder service know a model only through
`VisionLanguageModel` (and its input processor through `ModelInputProcessor`). A class is
checked against `MODEL_CLASS_ATTRIBUTES` when the registry first hands it out
(`check_model_class`): a family missing a part fails at once, naming it, not in the middle of
a step.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

import torch
from PIL import Image

from vlmserve.layers.attention import AttentionMetadata
from vlmserve.layers.positions import PositionScheme
from vlmserve.multimodal.inputs import PixelTransform, ProcessedPrompt


class ModelInputProcessor(Protocol):
    """What admission and the engine ask of a model's input processor (`input_processor_cls`,
    built with the checkpoint folder, its HF config and the engine's `mm_processor_kwargs`)."""

    tokenizer: Any
    #: id of the image placeholder token
    image_token_id: int
    #: the device-side part of image preprocessing (an image's pixels -> the tower's input)
    pixel_transform: PixelTransform

    @property
    def max_image_tokens(self) -> int:
        """Most placeholder tokens (== embedding rows) one image can become: the encoder
        budget is at least this."""

    def apply_chat_template(self, messages: list[dict], tools: list[dict] | None = None,
                            options: Any = None) -> str:
        """HF-style messages (string content or text/image parts) -> prompt text, with the
        tools (OpenAI's function definitions) where the template shows them; ``options``:
        another template, no generation prompt, the last message continued, template
        variables."""

    def image_options(self, kwargs: dict | None) -> Any:
        """A request's `mm_processor_kwargs`, checked, as the options its images are
        processed with (None: the engine's); `InvalidRequestError` for options it refuses."""

    def prepare(self, image: Image.Image, options: Any = None) -> Any:
        """(Optional: the front end's cache of processed images needs it.) The host part of
        image preprocessing for one image: a `PreparedImage` (content hash, pixels) that
        `process` takes in place of the image."""

    def pixel_tokens(self, shape: Sequence[int], encoder_meta: Sequence[int]) -> int:
        """The token count of an image preprocessed elsewhere (the encoder server's pixel
        images): the shape of its pixels must be one this processor gives, and its
        ``encoder_meta`` what it computes for them; else `InvalidImageError` naming the
        mismatch."""

    def described_prompt(self, prompt: str | None, prompt_token_ids: list[int] | None,
                         encoder_metas: Sequence[Sequence[int]]) -> ProcessedPrompt:
        """The prompt as `process` makes it for images known only by their ``encoder_meta``
        (images encoded elsewhere: hashes and pixels empty): token ids, offsets, lengths,
        grids, positions, what a client's embeddings are checked against."""

    def process(self, prompt: str | None, prompt_token_ids: list[int] | None,
                images: Sequence[Any], options: Any = None) -> ProcessedPrompt:
        """Token ids with every image's span expanded to its exact length, one `ImageInput`
        per image (hash, offset, length, pixels, `encoder_meta`), and the position data the
        model's `position_scheme` reads (`prompt_positions`, `position_offset`)."""


class VisionLanguageModel(Protocol):
    """A model as the engine runs it: the language model over the paged KV cache, the image
    encoder, and the family's declarations."""

    # ---- declarations (class attributes) -------------------------------------------------
    #: the class that turns prompt + images into a `ProcessedPrompt` (`ModelInputProcessor`)
    input_processor_cls: type
    #: checkpoint name prefixes of the image encoder's weights (what `build_encoder` loads;
    #: empty: the encoder service cannot run this family)
    encoder_prefixes: tuple[str, ...]
    #: how the decoder's positions are built from token indices and the processor's position
    #: data: `layers.positions.TokenPositions` ([T]) or `MRopePositions` ([rows, T])
    position_scheme: PositionScheme

    @classmethod
    def image_row_width(cls, hf_config: Any) -> int:
        """Width of an image's embedding rows (what the encoder gives and the store holds)."""

    @classmethod
    def reads_images_both_ways(cls, hf_config: Any) -> bool:
        """Whether each image's tokens attend to each other both ways (each image is then
        computed whole in one prefill chunk)."""

    @classmethod
    def reads_prompt_both_ways(cls, hf_config: Any) -> bool:
        """Whether the whole prompt attends both ways in prefill (PaliGemma's prefix): each
        prompt is then computed in one step, and no prefix of it is cached."""

    # ---- sizes ---------------------------------------------------------------------------
    #: width of the LM's embeddings
    hidden_size: int
    #: `image_row_width` of this model
    row_width: int
    #: KV cache tensors: one per layer
    num_layers: int

    def kv_cache_shape(self, num_blocks: int, block_size: int) -> tuple[int, ...]:
        """Shape of one layer's KV cache tensor."""

    # ---- a step --------------------------------------------------------------------------
    def embed_tokens(self, token_ids: torch.Tensor) -> torch.Tensor:
        """[T] -> [T, hidden]"""

    def encode_images(self, pixel_values: torch.Tensor,
                      encoder_meta: Sequence[tuple[int, ...]]) -> torch.Tensor:
        """All images due this step in one batch -> [sum of rows, row width], in image
        order. `pixel_values` is the processor's `pixel_transform` output of the images (one
        call per run of equal `ImageInput.batch_key`, concatenated on dim 0); `encoder_meta`
        is each image's `ImageInput.encoder_meta`, as the model's processor made it."""

    def merge_image_rows(self, embeds: torch.Tensor, dest: torch.Tensor,
                         rows: torch.Tensor) -> dict:
        """Image rows into the token embeddings at ``dest``; returns what `forward` takes
        besides (Qwen3-VL: the DeepStack rows)."""

    def forward(self, inputs_embeds: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[torch.Tensor], meta: AttentionMetadata,
                **extra: Any) -> torch.Tensor:
        """[T, hidden] -> final hidden states [T, hidden]"""

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[N, hidden] -> float32 [N, vocab]"""

    # ---- kernels -------------------------------------------------------------------------
    def set_attention_backend(self, fn) -> None:
        """Paged attention function used by every layer (see layers/attention.py)."""

    def set_vision_attention_backend(self, fn) -> None:
        """Variable-length attention of the vision tower (see layers/vision_attention.py)."""

    def set_fused_ops(self, ops) -> None:
        """Eager or compiled elementwise ops of the decoder (see layers/fused.py)."""

    def set_kv_cache_scales(self, scales: list[torch.Tensor | None]) -> None:
        """Optional, what an FP8 KV cache needs (layers/kv_quant.py): each decoder layer's
        ``[k_scale, v_scale]`` (None: no paged KV) to its attention, which passes them to
        the KV write and the paged attention; a model without it is refused one."""

    # ---- loading: one of the two ---------------------------------------------------------
    def load_weights(self, weights) -> set[str]:
        """Copy (checkpoint name, tensor) pairs into the model built by ``cls(hf_config)``;
        returns the names loaded (`models/loader.py` builds, shards and fills it)."""

    # or a classmethod ``from_checkpoint(path, hf_config, dtype, device, tp)`` that builds
    # and loads the model itself, this rank's share of it with ``tp`` (the transformers
    # backend; its classmethod ``check_tensor_parallel(hf_config, world, parallel_config)``
    # refuses a split it cannot make before any rank starts)


#: what `check_model_class` asks of a class: attributes and methods every model has
MODEL_CLASS_ATTRIBUTES = (
    "input_processor_cls", "encoder_prefixes", "image_row_width", "reads_images_both_ways",
    "reads_prompt_both_ways",
    "kv_cache_shape", "embed_tokens", "encode_images", "merge_image_rows", "forward",
    "compute_logits", "set_attention_backend", "set_vision_attention_backend",
    "set_fused_ops",
)
#: what every input processor class has
PROCESSOR_CLASS_ATTRIBUTES = (
    "max_image_tokens", "apply_chat_template", "image_options", "pixel_tokens",
    "described_prompt", "process",
)


def check_model_class(cls: type) -> type:
    """``cls`` if it has every part of `VisionLanguageModel` a class can show before it is
    built (and its input processor every part of `ModelInputProcessor`), one way to load
    (`load_weights` or `from_checkpoint`); else `TypeError` naming what is missing."""
    missing = [name for name in MODEL_CLASS_ATTRIBUTES if not hasattr(cls, name)]
    if not (hasattr(cls, "load_weights") or hasattr(cls, "from_checkpoint")):
        missing.append("load_weights or from_checkpoint")
    processor = getattr(cls, "input_processor_cls", None)
    if processor is not None:
        missing += [f"input_processor_cls.{name}" for name in PROCESSOR_CLASS_ATTRIBUTES
                    if not hasattr(processor, name)]
    if missing:
        raise TypeError(f"model class {cls.__module__}.{cls.__qualname__} lacks "
                        f"{', '.join(missing)} (models/interfaces.py)")
    return cls
