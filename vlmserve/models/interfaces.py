"""What the engine needs from a vision-language model; the runner knows nothing else."""

from __future__ import annotations

from typing import Protocol

import torch

from vlmserve.layers.attention import AttentionMetadata


class VisionLanguageModel(Protocol):
    #: whether positions are [3, T] mRoPE rows (Qwen-VL) or [T]
    uses_mrope: bool
    #: class that turns prompt + images into a ProcessedPrompt (run at admission)
    input_processor_cls: type
    #: width of the LM's embeddings (== rows of an image embedding)
    hidden_size: int
    num_layers: int

    def embed_tokens(self, token_ids: torch.Tensor) -> torch.Tensor:
        """[T] -> [T, hidden]"""

    def encode_images(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> torch.Tensor:
        """All images due this step in one batch -> [sum of rows, hidden], in image order."""

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
