"""Processed multimodal inputs: what admission hands to the scheduler and the worker.

Tensors appear here only as values: importing this module (and so `core/`) needs no torch."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    import torch


class PixelTransform(Protocol):
    """The part of an image processor that runs where the pixels are (the device, at encode
    time): ``[B, H, W, 3]`` uint8 images, all one size (or ``[B, tiles, H, W, 3]`` stacks of
    tiles, LLaVA-NeXT's), -> the vision tower's input rows."""

    def __call__(self, images: torch.Tensor, dtype: torch.dtype) -> torch.Tensor: ...


@dataclass(frozen=True)
class MultiModalFeature:
    """Where one image's rows sit in a prompt (``prompt_token_ids[offset : offset + length]``,
    by content hash): all that scheduling, the encoder cache and prefix keys need of it."""

    mm_hash: str
    offset: int
    length: int


@dataclass
class ImageInput:
    """One image of a prompt, after the host part of the image processor (resize): its
    `feature` and the encoder's input (pixels, transform, `encoder_meta`, or embeds).

    Its placeholder run is ``prompt_token_ids[offset : offset + length]`` and the vision tower
    turns ``transform(pixels)`` into exactly ``length`` embedding rows. Pixels stay uint8 until
    the device: a quarter of the bytes of 16-bit patches on the host and in the copy.
    """

    mm_hash: str  # content hash of the image plus model/processor settings
    offset: int  # index of the first placeholder token in the prompt
    length: int  # number of placeholder tokens == embedding rows
    pixels: torch.Tensor  # [H, W, 3] uint8 ([tiles, S, S, 3]: LLaVA-NeXT), resized as the
    # model's image processor would
    # what the model's `encode_images` needs to know of the image besides its pixels, set by
    # its processor and opaque to the engine (Qwen2-VL: the patch grid (t, h, w); LLaVA-NeXT:
    # tiles, original height, width; LLaVA-1.5: nothing)
    encoder_meta: tuple[int, ...]
    transform: PixelTransform | None  # rescale / normalize / patchify of `pixels`
    # the image's embedding rows [length, hidden] on the host, encoded elsewhere (an encoder
    # service): stored as they are instead of running the vision tower; `pixels` then empty
    embeds: torch.Tensor | None = None
    # what a message calls it: its modality and number in the prompt ("image 1", "video 0",
    # "video 0 patch 3": a Qwen3-VL temporal patch); empty: "image N", N its place among them
    name: str = ""

    @property
    def feature(self) -> MultiModalFeature:
        return MultiModalFeature(self.mm_hash, self.offset, self.length)

    @property
    def batch_key(self) -> tuple[int, ...]:
        """Images of equal keys (the shape of their pixels) are transformed in one call and
        sit side by side in the encoder's batch."""
        return tuple(self.pixels.shape)

    def without_pixels(self) -> ImageInput:
        """This image with its pixels left out: a tensor of their shape and dtype on the meta
        device (no bytes; `batch_key` unchanged), for a rank that is to receive its pixels
        later or never. An image encoded elsewhere (`embeds`) is returned as it is."""
        if self.embeds is not None:
            return self
        stand_in = self.pixels.new_empty(self.pixels.shape, device="meta")
        return replace(self, pixels=stand_in)


def encoder_order(images: Iterable[ImageInput]) -> list[ImageInput]:
    """``images`` as one encoder batch takes them: most rows first, equal batch keys together
    (so the vision attention batches equal sizes without gathering)."""
    return sorted(images, key=lambda img: (-img.length, img.batch_key))


def pixel_values(
    images: Sequence[ImageInput],
    pixels: Sequence[torch.Tensor] | None = None,
    dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """The vision tower's input for ``images`` in order (the HF image processor's
    ``pixel_values``), computed where ``pixels`` (default: each image's own) are, one batch
    per run of equal batch keys; ``dtype`` default float32."""
    import torch

    dtype = torch.float32 if dtype is None else dtype
    pixels = [img.pixels for img in images] if pixels is None else pixels
    out = []
    start = 0
    while start < len(images):
        end = start + 1
        while (end < len(images) and images[end].batch_key == images[start].batch_key
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
    # the model's position data (see layers/positions.py), opaque to the engine: the prompt
    # tokens' positions where the processor computes them ([rows, len(prompt_token_ids)]:
    # Qwen2-VL's mRoPE), None for token indices; token i >= len(prompt) sits at
    # i + position_offset
    prompt_positions: torch.Tensor | None = None
    position_offset: int = 0
