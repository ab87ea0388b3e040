"""Processed multimodal inputs: what admission hands to the scheduler and the worker.

Tensors appear here only as values: importing this module (and so `core/`) needs no torch."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    import torch


class PixelTransform(Protocol):
    """The part of an image processor that runs where the pixels are (the device, at encode
    time): ``[B, H, W, 3]`` uint8 images, all one size (or ``[B, tiles, H, W, 3]`` stacks of
    tiles, LLaVA-NeXT's), -> the vision tower's input rows."""

    def __call__(self, images: torch.Tensor, dtype: torch.dtype) -> torch.Tensor: ...


@dataclass
class ImageInput:
    """One image of a prompt, after the host part of the image processor (resize).

    Its placeholder run is ``prompt_token_ids[offset : offset + length]`` and the vision tower
    turns ``transform(pixels)`` into exactly ``length`` embedding rows. Pixels stay uint8 until
    the device: a quarter of the bytes of 16-bit patches on the host and in the copy.
    """

    mm_hash: str  # content hash of the image plus model/processor settings
    offset: int  # index of the first placeholder token in the prompt
    length: int  # number of placeholder tokens == embedding rows
    pixels: torch.Tensor  # [H, W, 3] uint8 ([tiles, S, S, 3]: LLaVA-NeXT), resized as the
    # model's image processor would
    # the model's image geometry: Qwen2-VL's patch grid (t, h, w) before spatial merge;
    # LLaVA-NeXT's (tiles, original height, original width)
    grid_thw: tuple[int, int, int]
    transform: PixelTransform | None  # rescale / normalize / patchify of `pixels`
    # the image's embedding rows [length, hidden] on the host, encoded elsewhere (an encoder
    # service): stored as they are instead of running the vision tower; `pixels` then empty
    embeds: torch.Tensor | None = None


def pixel_values(
    images: Sequence[ImageInput],
    pixels: Sequence[torch.Tensor] | None = None,
    dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """The vision tower's input for ``images`` in order (the HF image processor's
    ``pixel_values``), computed where ``pixels`` (default: each image's own) are, one batch
    per run of equal sizes; ``dtype`` default float32."""
    import torch

    dtype = torch.float32 if dtype is None else dtype
    pixels = [img.pixels for img in images] if pixels is None else pixels
    out = []
    start = 0
    while start < len(images):
        end = start + 1
        while (end < len(images) and pixels[end].shape == pixels[start].shape
               and images[end].transform == images[start].transform):
            end += 1
        out.append(images[start].transform(torch.stack(pixels[start:end]), dtype))
        start = end
    return torch.cat(out)


@dataclass(frozen=True)
class PreparedImage:
    """An image after the host part of a model's image processor: its content hash, its
    resized ``[H, W, 3]`` uint8 pixels and the pixels of the image it came from (for a
    request's pixel limit). A model processor's ``process`` takes it in place of the image."""

    mm_hash: str
    pixels: torch.Tensor
    source_pixels: int


@dataclass
class ProcessedPrompt:
    """A prompt ready for scheduling: token ids with image runs expanded, images, positions."""

    prompt: str | None
    prompt_token_ids: list[int]
    images: list[ImageInput] = field(default_factory=list)
    # mRoPE positions of the prompt tokens, [3, len(prompt_token_ids)]; None for 1-D RoPE models.
    mrope_positions: torch.Tensor | None = None
    # position of token i >= len(prompt) is i + mrope_delta in all three sections.
    mrope_delta: int = 0
