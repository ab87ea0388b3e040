"""What the engine needs from a vision-language model; the runner knows nothing else."""

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
    built with the checkpoint folder and its HF config); the engine asks nothing else."""

    tokenizer: Any
    #: id of the image placeholder token
    image_token_id: int
    #: the device-side part of image preprocessing (uint8 pixels -> the tower's input)
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

    def pixel_tokens(self, shape: Sequence[int], encoder_meta: Sequence[int]) -> int:
        """The token count of an image preprocessed elsewhere (the encoder server's pixel
        images): the shape of its uint8 pixels must be one this processor gives, and its
        ``encoder_meta`` what it computes for them; else `InvalidImageError` naming the
        mismatch."""

    def described_prompt(self, prompt: str | None, prompt_token_ids: list[int] | None,
                         encoder_metas: Sequence[Sequence[int]]) -> ProcessedPrompt:
        """The prompt as `process` makes it for images known only by their ``encoder_meta``
        (images encoded elsewhere: hashes and pixels empty): token ids, offsets, lengths,
        grids, positions, what a client's embeddings are checked against; an
        ``encoder_meta`` it never gives an image is an `InvalidImageError`."""

    def process(self, prompt: str | None, prompt_token_ids: list[int] | None,
                images: Sequence[Image.Image]) -> ProcessedPrompt:
        """Token ids with every image's placeholder run expanded to its exact length, one
        `ImageInput` per image (hash, offset, length, resized uint8 pixels, `encoder_meta`),
        and the position data the model's `position_scheme` reads (`prompt_positions`,
        `position_offset`)."""


class VisionLanguageModel(Protocol):
    #: how the decoder's positions are built from token indices and the processor's position
    #: data (`prompt_positions`, `position_offset`): `layers.positions.TokenPositions` ([T],
    #: LLaVA) or `MRopePositions` ([3, T], Qwen2-VL)
    position_scheme: PositionScheme
    #: class that turns prompt + images into a ProcessedPrompt (run at admission), a
    #: `ModelInputProcessor`
    input_processor_cls: type
    #: width of the LM's embeddings (== rows of an image embedding)
    hidden_size: int
    num_layers: int
    #: checkpoint name prefixes of the image encoder's weights (what `build_encoder` loads)
    encoder_prefixes: tuple[str, ...]

    @classmethod
    def build_encoder(cls, hf_config: Any) -> torch.nn.Module:
        """The image encoder alone, no language model (`vlmserve.MultimodalEncoder`): a module
        with `forward(pixel_values, encoder_meta)` (as `encode_images`), `load_weights(checkpoint
        names and tensors) -> loaded names`, `out_hidden_size` and `set_attention_backend`."""

    def embed_tokens(self, token_ids: torch.Tensor) -> torch.Tensor:
        """[T] -> [T, hidden]"""

    def encode_images(self, pixel_values: torch.Tensor,
                      encoder_meta: Sequence[tuple[int, ...]]) -> torch.Tensor:
        """All images due this step in one batch -> [sum of rows, hidden], in image order.
        `pixel_values` is the processor's `pixel_transform` output of the images (one call
        per run of equal `ImageInput.batch_key`, concatenated on dim 0); `encoder_meta` is
        each image's `ImageInput.encoder_meta`, as the model's processor made it (Qwen2-VL:
        patch grids; LLaVA-NeXT: tiles and original size; LLaVA-1.5: empty)."""

    def forward(self, inputs_embeds: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[torch.Tensor], meta: AttentionMetadata) -> torch.Tensor:
        """[T, hidden] -> final hidden states [T, hidden]"""

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[N, hidden] -> float32 [N, vocab]"""

    def kv_cache_shape(self, num_blocks: int, block_size: int) -> tuple[int, ...]:
        """Shape of one layer's KV cache tensor."""

    def set_attention_backend(self, fn) -> None:
        """Paged attention function used by every layer (see layers/attention.py)."""

    def set_vision_attention_backend(self, fn) -> None:
        """Variable-length attention of the vision tower (see layers/vision_attention.py)."""

    def set_fused_ops(self, ops) -> None:
        """Eager or compiled elementwise ops of the decoder (see layers/fused.py)."""

    def load_weights(self, weights) -> set[str]:
        """Copy (checkpoint name, tensor) pairs into the model; returns the names loaded."""
