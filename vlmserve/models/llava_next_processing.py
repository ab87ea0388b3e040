"""Admission-time processing for LLaVA-NeXT: anyres tiles, exact token counts, hashes.

An image becomes a stack of crop-sized tiles: the whole image squashed to one tile (the
"base"), then the tiles of the image resized (aspect kept) into the best resolution of
``image_grid_pinpoints`` and zero-padded to it, row by row, as transformers'
``LlavaNextImageProcessor``. Resize and padding run on the host to uint8 (the HF backend's
library); rescale and normalize run on the device (``TiledClipPixels``). Its token count
(base tile + unpadded tile grid + one ``image_newline`` per row) is computed here, before
scheduling, with transformers' arithmetic (``select_best_resolution``, the unpadded size
rounded to 7 decimals and then truncated).

``ImageInput.encoder_meta`` of an image is ``(tiles, original height, original width)``: what
the model needs to unpad its features (see ``llava_next.py``).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from PIL import Image

from vlmserve.errors import InvalidImageError, InvalidRequestError
from vlmserve.models.llava_processing import ClipPixels, _size, image_token_id
from vlmserve.models.processing import HFInputProcessor, NormalizedPixels
from vlmserve.multimodal.hashing import hash_image
from vlmserve.multimodal.inputs import ImageInput, ProcessedPrompt

if TYPE_CHECKING:
    from transformers import PretrainedConfig


@dataclass(frozen=True)
class TiledClipPixels(ClipPixels):
    """``ClipPixels`` over stacks of tiles: ``[B, tiles, S, S, 3]`` uint8 (or ``[B, S, S, 3]``)
    -> ``[B * tiles, 3, S, S]``, image after image, tile after tile."""

    def __call__(self, images: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        return super().__call__(images.flatten(0, 1) if images.ndim == 5 else images, dtype)


MAX_SIDE = 1 << 20  # pixels a side of an image described by its encoder_meta, at most


def select_best_resolution(height: int, width: int,
                           pinpoints: Sequence[Sequence[int]]) -> tuple[int, int]:
    """The (height, width) of ``pinpoints`` that keeps the most of the image (its pixels after
    an aspect-preserving fit, truncated, at most the original's), ties to the least waste;
    transformers' ``select_best_resolution``."""
    best, best_effective, best_waste = None, 0, float("inf")
    for h, w in pinpoints:
        scale = min(w / width, h / height)
        effective = min(int(width * scale) * int(height * scale), width * height)
        waste = w * h - effective
        if effective > best_effective or (effective == best_effective and waste < best_waste):
            best, best_effective, best_waste = (h, w), effective, waste
    assert best is not None, "empty image_grid_pinpoints"
    return best


def unpadded_grid(height: int, width: int, rows: int, cols: int) -> tuple[int, int, int, int]:
    """The feature rows/columns (``top, bottom, left, right`` bounds) of a ``rows x cols``
    feature grid that cover an image of ``height x width`` fitted into it, as transformers'
    ``unpad_image``: the fitted side rounded to 7 decimals, truncated, padding halved down."""
    if width / height > cols / rows:
        new_rows = int(round(height * (cols / width), 7))
        pad = (rows - new_rows) // 2
        return pad, rows - pad, 0, cols
    new_cols = int(round(width * (rows / height), 7))
    pad = (cols - new_cols) // 2
    return 0, rows, pad, cols - pad


def anyres_geometry(height: int, width: int, pinpoints, tile: int, patches: int
                    ) -> tuple[int, int, tuple[int, int, int, int]]:
    """(tile rows, tile columns, unpadded feature bounds) of an image of ``height x width``:
    tiles of ``tile`` pixels, ``patches`` features a side per tile."""
    best_h, best_w = select_best_resolution(height, width, pinpoints)
    grid_h, grid_w = best_h // tile, best_w // tile
    return grid_h, grid_w, unpadded_grid(height, width, grid_h * patches, grid_w * patches)


def num_image_tokens(height: int, width: int, pinpoints, tile: int, patches: int) -> int:
    """Embedding rows of an image: base tile, then each unpadded feature row plus its
    ``image_newline`` (the ``"default"`` feature strategy: no class tokens)."""
    _, _, (top, bottom, left, right) = anyres_geometry(height, width, pinpoints, tile, patches)
    return patches * patches + (bottom - top) * (right - left + 1)


def _fit_size(height: int, width: int, target: tuple[int, int]) -> tuple[int, int]:
    """transformers' ``get_patch_output_size``: the aspect-preserving fit into ``target``,
    the scaled side rounded up."""
    th, tw = target
    if tw / width < th / height:
        return min(math.ceil(height * (tw / width)), th), tw
    return th, min(math.ceil(width * (th / height)), tw)


class LlavaNextInputProcessor(HFInputProcessor):
    """Turns a prompt (text or token ids) plus decoded images into a ``ProcessedPrompt``."""

    PIL_IMAGE_PROCESSOR = "LlavaNextImageProcessorPil"

    def __init__(self, model_path: str | Path, hf_config: PretrainedConfig | None = None,
                 mm_processor_kwargs: dict | None = None, **load: Any) -> None:
        super().__init__(model_path, hf_config, mm_processor_kwargs, **load)
        hf_config, ip = self.hf_config, self.image_processor
        self.image_token_id = image_token_id(hf_config)
        if hf_config.vision_feature_select_strategy != "default":
            raise ValueError("LLaVA-NeXT: only vision_feature_select_strategy 'default' is "
                             "supported")
        vc = hf_config.vision_config
        self.tile: int = vc.image_size
        self.patches: int = vc.image_size // vc.patch_size
        self.pinpoints = [tuple(map(int, p)) for p in hf_config.image_grid_pinpoints]
        proc_pinpoints = [tuple(map(int, p)) for p in ip.image_grid_pinpoints]
        if proc_pinpoints != self.pinpoints:
            raise ValueError(f"image processor pinpoints {proc_pinpoints} != the model's "
                             f"{self.pinpoints}")
        crop = _size(ip.crop_size) if ip.do_center_crop else None
        if not ip.do_resize or _edge(ip.size) != self.tile or crop not in (None, (
                self.tile, self.tile)):
            raise ValueError(f"LLaVA-NeXT image processor sizes {ip.size} / {ip.crop_size} "
                             f"must be the tower's {self.tile}x{self.tile}")
        self.pixel_transform = TiledClipPixels(**NormalizedPixels.settings_of(ip))
        self._hash_extra = self.hash_extra(pinpoints=self.pinpoints)
        self._max_image_tokens = max(
            self.patches**2 + (h // self.tile * self.patches) * (w // self.tile * self.patches + 1)
            for h, w in self.pinpoints)

    @property
    def max_image_tokens(self) -> int:
        """Most placeholder tokens one image can become: the largest pinpoint's grid with
        nothing unpadded (an image of exactly that shape)."""
        return self._max_image_tokens

    def num_image_tokens(self, height: int, width: int) -> int:
        return num_image_tokens(height, width, self.pinpoints, self.tile, self.patches)

    def meta_tokens(self, encoder_meta: Sequence[int]) -> int:
        """The token count of an image whose ``encoder_meta`` is (tiles, original height,
        width): the tiles must be those this processor cuts an image of that size into;
        `InvalidImageError` naming the mismatch."""
        if len(encoder_meta) != 3 or not all(0 < x <= MAX_SIDE for x in encoder_meta):
            raise InvalidImageError(f"encoder_meta {list(encoder_meta)}: expected (tiles, "
                                    f"height, width), each from 1 to {MAX_SIDE}")
        tiles, height, width = encoder_meta
        rows, cols, _ = anyres_geometry(height, width, self.pinpoints, self.tile, self.patches)
        if tiles != 1 + rows * cols:
            raise InvalidImageError(f"encoder_meta {list(encoder_meta)}: an image of {width}x"
                                    f"{height} pixels is {1 + rows * cols} tiles")
        return self.num_image_tokens(height, width)

    def described_prompt(self, prompt: str | None, prompt_token_ids: list[int] | None,
                         encoder_metas: Sequence[Sequence[int]]) -> ProcessedPrompt:
        """The prompt as `process` makes it for images encoded elsewhere, each described by
        its ``encoder_meta`` (`meta_tokens`; hashes and pixels left empty): what a client's
        embeddings are checked against."""
        counts = []
        for i, meta in enumerate(encoder_metas):
            try:
                counts.append(self.meta_tokens(tuple(meta)))
            except InvalidImageError as e:
                raise InvalidImageError(f"image {i}: {e}") from None
        out_ids, offsets = _expand(self.token_ids(prompt, prompt_token_ids),
                                   self.image_token_id, counts)
        empty = torch.empty(0, dtype=torch.uint8)
        return ProcessedPrompt(prompt, out_ids, images=[
            ImageInput("", off, n, empty, tuple(meta), None)
            for off, n, meta in zip(offsets, counts, encoder_metas, strict=True)])

    def pixel_tokens(self, shape: Sequence[int], encoder_meta: Sequence[int]) -> int:
        """The token count of an image preprocessed elsewhere: its tiles ``[tiles, S, S, 3]``
        and ``encoder_meta`` as this processor gives them (`meta_tokens`)."""
        n = self.meta_tokens(encoder_meta)
        s = self.tile
        if tuple(shape) != (encoder_meta[0], s, s, 3):
            raise InvalidImageError(f"pixels of shape {list(shape)} for encoder_meta "
                                    f"{list(encoder_meta)}: this processor gives "
                                    f"[{encoder_meta[0]}, {s}, {s}, 3]")
        return n

    def process(self, prompt: str | None, prompt_token_ids: list[int] | None,
                images: Sequence[Image.Image], options: None = None) -> ProcessedPrompt:
        """Tokenize, tile the images, expand each ``<image>`` placeholder to its image's count.

        The prompt holds one ``<image>`` token per image (as the chat template renders it), or
        every image's run already expanded to exactly its count.
        """
        ids = self.token_ids(prompt, prompt_token_ids)
        rgb = [img if img.mode == "RGB" else img.convert("RGB") for img in images]
        for img in rgb:
            if min(img.size) < 1:
                raise InvalidImageError(f"image of {img.size[0]}x{img.size[1]} pixels")
        counts = [self.num_image_tokens(img.height, img.width) for img in rgb]
        tid = self.image_token_id
        out_ids, offsets = _expand(ids, tid, counts)
        if not images:
            return ProcessedPrompt(prompt, out_ids, images=[])
        arrays = [np.array(img) for img in rgb]  # writable: torch.from_numpy shares it
        image_inputs = []
        for img, a, off, n in zip(rgb, arrays, offsets, counts, strict=True):
            tiles = self._tiles(img, a)
            image_inputs.append(ImageInput(
                mm_hash=hash_image(a, self._hash_extra), offset=off, length=n, pixels=tiles,
                encoder_meta=(tiles.shape[0], img.height, img.width),
                transform=self.pixel_transform))
        return ProcessedPrompt(prompt, out_ids, images=image_inputs)

    def _resize(self, image: Image.Image, array: np.ndarray, size: tuple[int, int]
                ) -> np.ndarray:
        """``[h, w, 3]`` uint8 resized to ``size`` (height, width) by the HF backend's
        library (PIL, or torchvision with antialiasing)."""
        if size == array.shape[:2]:
            return array
        ip = self.image_processor
        if not self.pixel_transform.fused:
            return np.array(image.resize((size[1], size[0]), resample=ip.resample))
        from torchvision.transforms.v2 import functional as tvF
        from transformers.image_utils import pil_torch_interpolation_mapping

        chw = tvF.resize(torch.from_numpy(array).permute(2, 0, 1).contiguous(), list(size),
                         antialias=True,
                         interpolation=pil_torch_interpolation_mapping[ip.resample])
        return chw.permute(1, 2, 0).numpy()

    def _tiles(self, image: Image.Image, array: np.ndarray) -> torch.Tensor:
        """``[1 + rows * cols, S, S, 3]`` uint8: the base tile, then the padded best-fit
        image's tiles row by row."""
        s = self.tile
        height, width = array.shape[:2]
        best = select_best_resolution(height, width, self.pinpoints)
        fit = _fit_size(height, width, best)
        resized = self._resize(image, array, fit)
        padded = np.zeros((best[0], best[1], 3), dtype=np.uint8)
        top, left = (best[0] - fit[0]) // 2, (best[1] - fit[1]) // 2
        padded[top:top + fit[0], left:left + fit[1]] = resized
        rows, cols = best[0] // s, best[1] // s
        grid = padded[:rows * s, :cols * s].reshape(rows, s, cols, s, 3).swapaxes(1, 2)
        base = self._resize(image, array, (s, s))
        out = np.concatenate([base[None], grid.reshape(rows * cols, s, s, 3)])
        return torch.from_numpy(np.ascontiguousarray(out))


def _expand(ids: list[int], tid: int, counts: list[int]) -> tuple[list[int], list[int]]:
    """Token ids with the i-th ``<image>`` expanded to ``counts[i]`` and each run's offset; or,
    when the runs are expanded already (each maximal run exactly some images' counts), the
    ids as they are."""
    positions = [i for i, t in enumerate(ids) if t == tid]
    if len(positions) == len(counts):  # one placeholder per image: expand each
        out: list[int] = []
        offsets: list[int] = []
        for t in ids:
            if t == tid:
                offsets.append(len(out))
                out += [tid] * counts[len(offsets) - 1]
            else:
                out.append(t)
        return out, offsets
    offsets, k, i = [], 0, 0
    while len(positions) == sum(counts) and i < len(ids):
        if ids[i] != tid:
            i += 1
            continue
        end = i
        while end < len(ids) and ids[end] == tid:
            end += 1
        while i < end and k < len(counts):
            offsets.append(i)
            i, k = i + counts[k], k + 1
        if i != end:
            break
    else:
        if len(positions) == sum(counts) and k == len(counts):
            return list(ids), offsets
    raise InvalidRequestError(
        f"the prompt has {len(positions)} image placeholder token(s) for {len(counts)} "
        f"image(s): expected one per image, or each image's count {counts}")


def _edge(size) -> int | None:
    """The square side a processor ``size`` resizes the base tile to."""
    fixed = _size(size)
    if fixed is not None:
        return fixed[0] if fixed[0] == fixed[1] else None
    get = size.get if isinstance(size, dict) else lambda k: getattr(size, k, None)
    return get("shortest_edge")
