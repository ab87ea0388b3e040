"""Admission-time processing for LLaVA-1.5: tokens, CLIP-sized images, hashes.

Every image becomes the same number of tokens, ``(image_size / patch_size)**2`` (plus one when
``vision_feature_select_strategy`` is ``"full"``: the class token is kept), so each ``<image>``
placeholder is expanded to that count here, before scheduling. Positions are plain token
indices (no mRoPE). The image processor's resize (shortest edge, bicubic) and center crop run
on the host to uint8, by the same library as the HF backend in use; rescale and normalize run
on the device (``ClipPixels``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from PIL import Image

from vlmserve.errors import InvalidImageError, InvalidRequestError
from vlmserve.models.processing import HFInputProcessor, NormalizedPixels
from vlmserve.multimodal.hashing import hash_image
from vlmserve.multimodal.inputs import ImageInput, ProcessedPrompt

if TYPE_CHECKING:
    from transformers import PretrainedConfig


@dataclass(frozen=True)
class ClipPixels(NormalizedPixels):
    """The CLIP image processor's rescale and normalize (`NormalizedPixels`), run where the
    pixels are: ``[B, H, W, 3]`` uint8 -> ``[B, 3, H, W]`` in ``dtype``, bit-identical to its
    ``pixel_values``."""

    def __call__(self, images: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        return self.normalized(images).to(dtype).contiguous()


def tokens_per_image(hf_config) -> int:
    """Embedding rows (== placeholder tokens) of one image: the tower's patches, plus the
    class token under the ``"full"`` feature strategy."""
    vc = hf_config.vision_config
    strategy = hf_config.vision_feature_select_strategy
    if strategy not in ("default", "full"):
        raise ValueError(f"unsupported vision_feature_select_strategy {strategy!r}")
    return (vc.image_size // vc.patch_size) ** 2 + int(strategy == "full")


def image_token_id(hf_config) -> int:
    tid = getattr(hf_config, "image_token_id", None)
    return int(tid if tid is not None else hf_config.image_token_index)


class LlavaInputProcessor(HFInputProcessor):
    """Turns a prompt (text or token ids) plus decoded images into a ``ProcessedPrompt``."""

    PIL_IMAGE_PROCESSOR = "CLIPImageProcessorPil"

    def __init__(self, model_path: str | Path, hf_config: PretrainedConfig | None = None,
                 mm_processor_kwargs: dict | None = None, **load: Any) -> None:
        super().__init__(model_path, hf_config, mm_processor_kwargs, **load)
        hf_config, ip = self.hf_config, self.image_processor
        self.image_token_id = image_token_id(hf_config)
        self.num_image_tokens = tokens_per_image(hf_config)
        vc = hf_config.vision_config
        self.image_size: int = vc.image_size
        if getattr(ip, "do_pad", False):
            raise ValueError("LLaVA image processors that pad to a square (do_pad) are not "
                             "supported")
        crop = _size(ip.crop_size) if ip.do_center_crop else None
        if crop is not None and crop != (self.image_size, self.image_size):
            raise ValueError(f"image processor crops to {crop}, the vision tower takes "
                             f"{self.image_size}x{self.image_size}")
        self.pixel_transform = ClipPixels(**NormalizedPixels.settings_of(ip))
        self._hash_extra = self.hash_extra(tokens=self.num_image_tokens)

    @property
    def max_image_tokens(self) -> int:
        """Most placeholder tokens one image can become (every image: the same)."""
        return self.num_image_tokens

    def pixel_tokens(self, shape: Sequence[int], encoder_meta: Sequence[int]) -> int:
        """The token count of an image preprocessed elsewhere: its pixels must be the
        tower's square (``[S, S, 3]``) and its ``encoder_meta`` empty, as this processor gives
        them; `InvalidImageError` naming the mismatch."""
        s = self.image_size
        if tuple(shape) != (s, s, 3):
            raise InvalidImageError(f"pixels of shape {list(shape)}: this processor gives "
                                    f"[{s}, {s}, 3]")
        if tuple(encoder_meta):
            raise InvalidImageError(f"encoder_meta {list(encoder_meta)}: this model's images "
                                    "have none ([])")
        return self.num_image_tokens

    def process(self, prompt: str | None, prompt_token_ids: list[int] | None,
                images: Sequence[Image.Image], options: None = None) -> ProcessedPrompt:
        """Tokenize, resize and crop the images, expand each ``<image>`` placeholder.

        The prompt holds one ``<image>`` token per image (as the chat template renders it), or
        every image's run already expanded to exactly ``num_image_tokens``.
        """
        out_ids, offsets = self._expanded(self.token_ids(prompt, prompt_token_ids),
                                          len(images))
        n = self.num_image_tokens
        if not images:
            return ProcessedPrompt(prompt, out_ids, images=[])
        rgb = [img if img.mode == "RGB" else img.convert("RGB") for img in images]
        arrays = [np.array(img) for img in rgb]  # writable: torch.from_numpy shares it
        hashes = [hash_image(a, self._hash_extra) for a in arrays]
        image_inputs = [
            ImageInput(mm_hash=h, offset=off, length=n, pixels=self._resize_crop(img, a),
                       encoder_meta=(), transform=self.pixel_transform)
            for h, off, img, a in zip(hashes, offsets, rgb, arrays, strict=True)
        ]
        return ProcessedPrompt(prompt, out_ids, images=image_inputs)

    def _expanded(self, ids: list[int], num_images: int) -> tuple[list[int], list[int]]:
        """The token ids with each image's placeholder expanded, and each run's offset."""
        n, tid = self.num_image_tokens, self.image_token_id
        count = ids.count(tid)
        if count == num_images:  # one placeholder per image: expand each
            out_ids: list[int] = []
            offsets: list[int] = []
            for t in ids:
                if t == tid:
                    offsets.append(len(out_ids))
                    out_ids += [tid] * n
                else:
                    out_ids.append(t)
            return out_ids, offsets
        if count == n * num_images and _runs_of(ids, tid, n):  # expanded already
            return ids, [i for i, t in enumerate(ids) if t == tid][::n]
        raise InvalidRequestError(
            f"the prompt has {count} image placeholder token(s) for {num_images} "
            f"image(s): expected one per image, or {n} per image")

    def described_prompt(self, prompt: str | None, prompt_token_ids: list[int] | None,
                         encoder_metas: Sequence[Sequence[int]]) -> ProcessedPrompt:
        """The prompt as `process` makes it for images encoded elsewhere (their
        ``encoder_meta``s must be empty, as this processor's; hashes and pixels left empty):
        what a client's embeddings are checked against."""
        for i, meta in enumerate(encoder_metas):
            if tuple(meta):
                raise InvalidImageError(f"image {i}: encoder_meta {list(meta)}: this model's "
                                        "images have none ([])")
        out_ids, offsets = self._expanded(self.token_ids(prompt, prompt_token_ids),
                                          len(encoder_metas))
        empty = torch.empty(0, dtype=torch.uint8)
        return ProcessedPrompt(prompt, out_ids, images=[
            ImageInput("", off, self.num_image_tokens, empty, (), None) for off in offsets])

    def _resize_crop(self, image: Image.Image, array: np.ndarray) -> torch.Tensor:
        """The image as the HF processor sizes it (resize, then center crop), ``[H, W, 3]``
        uint8, resized by the HF backend's library."""
        ip = self.image_processor
        height, width = array.shape[:2]
        if min(height, width) < 1:
            raise InvalidImageError(f"image of {width}x{height} pixels")
        chw = None
        fused = self.pixel_transform.fused
        if ip.do_resize:
            new_h, new_w = _resize_size(ip.size, height, width)
            if (new_h, new_w) != (height, width):
                if not fused:  # the PIL backend
                    array = np.array(image.resize((new_w, new_h), resample=ip.resample))
                else:
                    from torchvision.transforms.v2 import functional as tvF
                    from transformers.image_utils import pil_torch_interpolation_mapping

                    chw = tvF.resize(torch.from_numpy(array).permute(2, 0, 1).contiguous(),
                                     [new_h, new_w], antialias=True,
                                     interpolation=pil_torch_interpolation_mapping[ip.resample])
                    array = chw.permute(1, 2, 0).numpy()
        if ip.do_center_crop:
            array = _center_crop(array, _size(ip.crop_size), ceil_pad=not fused)
        if array.shape[:2] != (self.image_size, self.image_size):
            raise InvalidImageError(f"image processor made a {array.shape[1]}x{array.shape[0]}"
                                    f" image; the vision tower takes {self.image_size}x"
                                    f"{self.image_size}")
        return torch.from_numpy(np.ascontiguousarray(array))


def _size(size) -> tuple[int, int] | None:
    get = size.get if isinstance(size, dict) else lambda k: getattr(size, k, None)
    if get("height") and get("width"):
        return int(get("height")), int(get("width"))
    return None


def _resize_size(size, height: int, width: int) -> tuple[int, int]:
    """(height, width) after the processor's resize, as HF's ``get_resize_output_image_size``
    (shortest edge to ``size``, the other scaled and truncated) or a fixed size."""
    fixed = _size(size)
    if fixed is not None:
        return fixed
    get = size.get if isinstance(size, dict) else lambda k: getattr(size, k, None)
    edge, longest = get("shortest_edge"), get("longest_edge")
    if not edge or longest:
        raise ValueError(f"unsupported image processor size {size!r}")
    short, long = (width, height) if width <= height else (height, width)
    new_short, new_long = edge, int(edge * long / short)
    return (new_long, new_short) if width <= height else (new_short, new_long)


def _center_crop(array: np.ndarray, size: tuple[int, int], ceil_pad: bool) -> np.ndarray:
    """``[H, W, 3]`` center crop; a side shorter than the crop is zero-padded first (the PIL
    backend puts the odd pixel of padding before the image, torchvision after)."""
    ch, cw = size
    h, w = array.shape[:2]
    if ch > h or cw > w:
        ph, pw = max(ch - h, 0), max(cw - w, 0)
        top = (ph + 1) // 2 if ceil_pad else ph // 2
        left = (pw + 1) // 2 if ceil_pad else pw // 2
        padded = np.zeros((h + ph, w + pw, array.shape[2]), dtype=array.dtype)
        padded[top:top + h, left:left + w] = array
        array, h, w = padded, h + ph, w + pw
    top, left = (h - ch) // 2, (w - cw) // 2
    return array[top:top + ch, left:left + cw]


def _runs_of(ids: list[int], token_id: int, n: int) -> bool:
    """Whether every maximal run of ``token_id`` has a multiple of ``n`` tokens."""
    run = 0
    for t in [*ids, None]:
        if t == token_id:
            run += 1
        else:
            if run % n:
                return False
            run = 0
    return True
