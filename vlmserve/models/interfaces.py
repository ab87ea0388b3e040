"""What the engine needs from a vision-language model; the runner knows nothing else."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

import torch
from PIL import Image

from vlmserve.layers.attention import AttentionMetadata
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

    def apply_chat_template(self, messages: list[dict]) -> str:
        """HF-style messages (string content or text/image parts) -> prompt text."""

    def process(self, prompt: str | None, prompt_token_ids: list[int] | None,
                images: Sequence[Image.Image]) -> ProcessedPrompt:
        """Token ids with every image's placeholder run expanded to its exact length, one
        `ImageInput` per image (hash, offset, length, resized uint8 pixels), and mRoPE
        positions when the model `uses_mrope`."""


class VisionLanguageModel(Protocol):
    #: whether positions are [3, T] mRoPE rows (Qwen-VL, from the processor's
    #: `mrope_positions` / `mrope_delta`) or [T] token indices (LLaVA)
    uses_mrope: bool
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
        with `forward(pixel_values, grid_thw)` (as `encode_images`), `load_weights(checkpoint
        names and tensors) -> loaded names`, `out_hidden_size` and `set_attention_backend`."""

    def embed_tokens(self, token_ids: torch.Tensor) -> torch.Tensor:
        """[T] -> [T, hidden]"""

    def encode_images(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> torch.Tensor:
        """All images due this step in one batch -> [sum of rows, hidden], in image order.
        `pixel_values` is the processor's `pixel_transform` output of the images (one call
        per run of equal sizes, concatenated on dim 0); `grid_thw` [N, 3] is each image's
        `ImageInput.grid_thw` (a model whose images are all one size may ignore it; LLaVA-NeXT
        reads its tiles and original size there)."""

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
