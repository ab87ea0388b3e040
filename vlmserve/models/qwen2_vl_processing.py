"""Admission-time processing for the Qwen2-VL family: tokens, image patches, mRoPE positions.

The exact number of image tokens is decided here, before scheduling: each ``<|image_pad|>``
placeholder is expanded to ``t * h * w // merge**2`` tokens from the image processor's grid.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch
from PIL import Image

from vlmserve.errors import InvalidImageError, InvalidRequestError
from vlmserve.models.processing import HFInputProcessor, NormalizedPixels
from vlmserve.multimodal.hashing import hash_image
from vlmserve.multimodal.inputs import ImageInput, PreparedImage, ProcessedPrompt

if TYPE_CHECKING:
    from transformers import PretrainedConfig


def compute_mrope_positions(
    num_tokens: int,
    images: Sequence[tuple[int, tuple[int, int, int]]],
    spatial_merge_size: int,
) -> tuple[torch.Tensor, int]:
    """mRoPE positions [3, num_tokens] and delta, as HF's ``get_rope_index`` for images.

    ``images`` holds ``(offset, (t, h, w))`` per image in prompt order. Text tokens count up
    by one in all three sections; an image's tokens take (t, h, w) indices of the merged grid
    plus the position it starts at, and the text after it resumes at start + max(h, w) //
    merge. The delta is max position + 1 - num_tokens: token i beyond the prompt sits at
    i + delta.
    """
    pieces: list[torch.Tensor] = []
    pos = 0  # next position id
    cursor = 0  # next token index
    for offset, (t, h, w) in images:
        assert offset >= cursor, "images must be in prompt order and not overlap"
        text_len = offset - cursor
        pieces.append(torch.arange(pos, pos + text_len).expand(3, -1))
        pos += text_len
        gh, gw = h // spatial_merge_size, w // spatial_merge_size
        grid = torch.stack(
            torch.meshgrid(torch.arange(t), torch.arange(gh), torch.arange(gw), indexing="ij")
        )  # [3, t, gh, gw]
        pieces.append(grid.reshape(3, -1) + pos)
        pos += max(h, w) // spatial_merge_size
        cursor = offset + t * gh * gw
    assert cursor <= num_tokens
    pieces.append(torch.arange(pos, pos + num_tokens - cursor).expand(3, -1))
    positions = torch.cat(pieces, dim=1).contiguous()  # [3, num_tokens]
    delta = int(positions.max()) + 1 - num_tokens if num_tokens else 0
    return positions, delta


@dataclass(frozen=True)
class Qwen2VLPixels(NormalizedPixels):
    """The Qwen2-VL image processor's rescale, normalize (`NormalizedPixels`) and patchify,
    run where the pixels are; the rows are bit-identical to its ``pixel_values``."""

    patch_size: int
    temporal_patch_size: int
    merge_size: int

    def __call__(self, images: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """``[B, H, W, 3]`` uint8 -> ``[B * (H/p) * (W/p), 3 * T * p * p]`` rows in ``dtype``."""
        x = self.normalized(images).to(dtype)
        b, c, h, w = x.shape
        p, m, t = self.patch_size, self.merge_size, self.temporal_patch_size
        gh, gw = h // p, w // p
        x = x.reshape(b, c, gh // m, m, p, gw // m, m, p).permute(0, 2, 5, 3, 6, 1, 4, 7)
        x = x.unsqueeze(6).expand(*x.shape[:6], t, p, p)  # [B, gh/m, gw/m, m, m, C, T, p, p]
        return x.reshape(b * gh * gw, c * t * p * p)


def _smart_resize():
    """HF's ``smart_resize`` of Qwen2-VL, from whichever processor module imports here."""
    try:
        from transformers.models.qwen2_vl.image_processing_qwen2_vl import smart_resize
    except ImportError:  # that module needs torchvision
        from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize
    return smart_resize


class Qwen2VLInputProcessor(HFInputProcessor):
    """Turns a prompt (text or token ids) plus decoded images into a ``ProcessedPrompt``."""

    PIL_IMAGE_PROCESSOR = "Qwen2VLImageProcessorPil"

    def __init__(self, model_path: str | Path, hf_config: PretrainedConfig | None = None,
                 mm_processor_kwargs: dict | None = None) -> None:
        super().__init__(model_path, hf_config)
        hf_config = self.hf_config
        self.image_token_id: int = hf_config.image_token_id
        self.video_token_id: int | None = getattr(hf_config, "video_token_id", None)
        self.merge_size: int = hf_config.vision_config.spatial_merge_size
        ip = self.image_processor
        assert ip.merge_size == self.merge_size, "processor/model merge differ"
        edge = (ip.size.get if isinstance(ip.size, dict)
                else lambda k: getattr(ip.size, k, None))
        self.min_pixels: int = edge("shortest_edge") or ip.min_pixels
        self.max_pixels: int = edge("longest_edge") or ip.max_pixels
        self.min_pixels, self.max_pixels = (self.image_options(mm_processor_kwargs)
                                            or (self.min_pixels, self.max_pixels))
        self._smart_resize = _smart_resize()
        self.pixel_transform = Qwen2VLPixels(
            patch_size=ip.patch_size, temporal_patch_size=ip.temporal_patch_size,
            merge_size=ip.merge_size, **NormalizedPixels.settings_of(ip))
        self._hash_extras: dict[tuple[int, int] | None, str] = {}

    def image_options(self, kwargs: dict | None) -> tuple[int, int] | None:
        """A request's `mm_processor_kwargs` as the (min_pixels, max_pixels) its images are
        resized into (None: the engine's): ``min_pixels``, ``max_pixels``, or transformers'
        ``size`` ({shortest_edge, longest_edge}), each a positive number of pixels."""
        if not kwargs:
            return None
        if not isinstance(kwargs, dict):
            raise InvalidRequestError("mm_processor_kwargs must be an object")
        unknown = sorted(set(kwargs) - {"min_pixels", "max_pixels", "size"})
        if unknown:
            raise InvalidRequestError(f"mm_processor_kwargs: unknown option(s) {unknown}; "
                                      "this model's image processor takes min_pixels, "
                                      "max_pixels and size")
        size = kwargs.get("size") or {}
        if not isinstance(size, dict) or set(size) - {"shortest_edge", "longest_edge"}:
            raise InvalidRequestError("mm_processor_kwargs: size must be an object of "
                                      "shortest_edge and longest_edge")
        lo = kwargs.get("min_pixels", size.get("shortest_edge", self.min_pixels))
        hi = kwargs.get("max_pixels", size.get("longest_edge", self.max_pixels))
        for name, v in (("min_pixels", lo), ("max_pixels", hi)):
            if isinstance(v, bool) or not isinstance(v, int) or not 0 < v <= 1 << 40:
                raise InvalidRequestError(f"mm_processor_kwargs: {name} must be a positive "
                                          f"integer, got {v!r}")
        if lo > hi:
            raise InvalidRequestError(f"mm_processor_kwargs: min_pixels {lo} exceeds "
                                      f"max_pixels {hi}")
        return None if (lo, hi) == (self.min_pixels, self.max_pixels) else (lo, hi)

    def _hash_extra(self, options: tuple[int, int] | None) -> str:
        """What an image's hash adds to its pixels: the processor's settings and the pixel
        range it is resized into."""
        extra = self._hash_extras.get(options)
        if extra is None:
            if len(self._hash_extras) > 64:  # requests' own ranges: a few, usually
                self._hash_extras.clear()
            extra = self._hash_extras[options] = self.hash_extra(
                pixels=list(options or (self.min_pixels, self.max_pixels)))
        return extra

    def num_image_tokens(self, grid_thw: Sequence[int]) -> int:
        """Placeholder tokens (== embedding rows) of an image with patch grid ``grid_thw``."""
        t, h, w = (int(x) for x in grid_thw)
        return t * h * w // self.merge_size**2

    def prepare(self, image: Image.Image, options: tuple[int, int] | None = None
                ) -> PreparedImage:
        """The host part of the image processor for one image: its content hash and its
        resized pixels (what a cache of processed images keeps); ``options``: the pixel range
        of `image_options` (None: the engine's)."""
        rgb = image if image.mode == "RGB" else image.convert("RGB")
        array = np.array(rgb)  # writable: torch.from_numpy shares it
        return PreparedImage(hash_image(array, self._hash_extra(options)),
                             self._resize(rgb, array, options), image.width * image.height)

    def process(
        self,
        prompt: str | None,
        prompt_token_ids: list[int] | None,
        images: Sequence[Image.Image | PreparedImage],
        options: tuple[int, int] | None = None,
    ) -> ProcessedPrompt:
        """Tokenize, run the image processor, expand placeholders, compute mRoPE positions.

        The prompt holds one ``<|image_pad|>`` per image (as the chat template renders it) or
        an already expanded run of exactly the right length.
        """
        ids = self.token_ids(prompt, prompt_token_ids)
        if self.video_token_id is not None and self.video_token_id in ids:
            raise InvalidRequestError("video inputs are not supported")
        runs = _placeholder_runs(ids, self.image_token_id)
        if len(runs) != len(images):
            raise InvalidRequestError(
                f"the prompt has {len(runs)} image placeholder(s) but {len(images)} image(s) "
                "were given"
            )
        if not images:
            positions, delta = compute_mrope_positions(len(ids), [], self.merge_size)
            return ProcessedPrompt(
                prompt, ids, images=[], prompt_positions=positions, position_offset=delta
            )

        prepared = [img if isinstance(img, PreparedImage) else self.prepare(img, options)
                    for img in images]
        hashes = [p.mm_hash for p in prepared]
        resized = [p.pixels for p in prepared]
        grids = [(1, px.shape[0] // self.patch_size, px.shape[1] // self.patch_size)
                 for px in resized]
        out_ids: list[int] = []
        placed: list[tuple[int, tuple[int, int, int]]] = []
        cursor = 0
        for i, ((start, length), grid) in enumerate(zip(runs, grids, strict=True)):
            n = self.num_image_tokens(grid)
            if length not in (1, n):
                raise InvalidRequestError(
                    f"image {i}: its placeholder run has {length} tokens; expected 1 or {n}"
                )
            out_ids += ids[cursor:start]
            placed.append((len(out_ids), grid))
            out_ids += [self.image_token_id] * n
            cursor = start + length
        out_ids += ids[cursor:]

        image_inputs = [
            ImageInput(
                mm_hash=mm_hash,
                offset=offset,
                length=self.num_image_tokens(grid),
                pixels=px,
                encoder_meta=grid,
                transform=self.pixel_transform,
            )
            for mm_hash, (offset, grid), px in zip(hashes, placed, resized, strict=True)
        ]
        positions, delta = compute_mrope_positions(len(out_ids), placed, self.merge_size)
        return ProcessedPrompt(
            prompt, out_ids, images=image_inputs, prompt_positions=positions, position_offset=delta
        )

    @property
    def patch_size(self) -> int:
        return self.pixel_transform.patch_size

    @property
    def max_image_tokens(self) -> int:
        """Most placeholder tokens one image can become (from the processor's pixel cap)."""
        unit = self.patch_size * self.merge_size
        return max(int(self.max_pixels) // (unit * unit), 1)

    def _resize(self, image: Image.Image, array: np.ndarray,
                options: tuple[int, int] | None = None) -> torch.Tensor:
        """The image at the size the HF processor gives it, ``[H, W, 3]`` uint8, resized (only
        when the size changes) by the same library as the HF backend in use."""
        ip = self.image_processor
        height, width = array.shape[:2]
        factor = self.patch_size * self.merge_size
        if not ip.do_resize:
            if height % factor or width % factor:
                raise InvalidImageError(f"image of {width}x{height} pixels: without resizing, "
                                        f"both sides must be multiples of {factor}")
            return torch.from_numpy(array)
        lo, hi = options or (self.min_pixels, self.max_pixels)
        try:
            new_h, new_w = self._smart_resize(height, width, factor=factor,
                                              min_pixels=lo, max_pixels=hi)
        except ValueError as e:  # e.g. an aspect ratio the resizer refuses
            raise InvalidImageError(f"image processor rejected an image: {e}") from e
        if (new_h, new_w) == (height, width):
            return torch.from_numpy(array)
        if not self.pixel_transform.fused:  # the PIL backend
            return torch.from_numpy(np.array(image.resize((new_w, new_h), resample=ip.resample)))
        from torchvision.transforms.v2 import functional as tvF
        from transformers.image_utils import pil_torch_interpolation_mapping

        chw = torch.from_numpy(array).permute(2, 0, 1).contiguous()
        out = tvF.resize(chw, [new_h, new_w], antialias=True,
                         interpolation=pil_torch_interpolation_mapping[ip.resample])
        return out.permute(1, 2, 0).contiguous()


def _placeholder_runs(ids: list[int], token_id: int) -> list[tuple[int, int]]:
    """(start, length) of every maximal run of ``token_id`` in ``ids``."""
    runs: list[tuple[int, int]] = []
    i = 0
    while i < len(ids):
        if ids[i] == token_id:
            j = i
            while j < len(ids) and ids[j] == token_id:
                j += 1
            runs.append((i, j - i))
            i = j
        else:
            i += 1
    return runs
