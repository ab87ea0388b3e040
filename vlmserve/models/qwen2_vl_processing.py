"""Admission-time processing for the Qwen2-VL family: tokens, image patches, mRoPE positions.

The exact number of image tokens is decided here, before scheduling: each ``<|image_pad|>``
placeholder is expanded to ``t * h * w // merge**2`` tokens from the image processor's grid.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from PIL import Image

from vlmserve.errors import InvalidImageError, InvalidRequestError
from vlmserve.models.mrope import compute_mrope_positions
from vlmserve.models.processing import HFInputProcessor, NormalizedPixels
from vlmserve.models.qwen2_vl_video import video_normalization, video_processor_config
from vlmserve.multimodal.hashing import hash_image, hash_video
from vlmserve.multimodal.inputs import ImageInput, PreparedImage, ProcessedPrompt
from vlmserve.multimodal.video import MAX_FRAMES, Video

if TYPE_CHECKING:
    from transformers import PretrainedConfig


@dataclass(frozen=True)
class Qwen2VLPixels(NormalizedPixels):
    """The Qwen2-VL image processor's rescale, normalize (`NormalizedPixels`) and patchify,
    run where the pixels are; the rows are bit-identical to its ``pixel_values``. Videos are
    normalized as the video processor does (``video``: its own rescale, mean and std, in the
    torchvision order of transformers' video processors), so one transform serves both."""

    patch_size: int
    temporal_patch_size: int
    merge_size: int
    video: NormalizedPixels | None = None  # a video's normalization (None: the image's)

    def __call__(self, images: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """``[B, H, W, 3]`` uint8 images -> ``[B * (H/p) * (W/p), 3 * T * p * p]`` rows in
        ``dtype`` (each image repeated over the T frames of a temporal patch); ``[B, F, H, W,
        3]`` videos of F frames (a multiple of T) -> ``[B * (F/T) * (H/p) * (W/p), ...]``."""
        p, m, t = self.patch_size, self.merge_size, self.temporal_patch_size
        if images.dim() == 5:  # videos: T consecutive frames make one temporal patch
            b, f, h, w, _ = images.shape
            x = (self.video or self).normalized(images.reshape(b * f, h, w, 3)).to(dtype)
            gh, gw = h // p, w // p
            x = x.reshape(b, f // t, t, 3, gh // m, m, p, gw // m, m, p)
            x = x.permute(0, 1, 4, 7, 5, 8, 3, 2, 6, 9)  # [B, F/T, gh/m, gw/m, m, m, C, T, p, p]
            return x.reshape(b * (f // t) * gh * gw, 3 * t * p * p)
        x = self.normalized(images).to(dtype)
        b, c, h, w = x.shape
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
    takes_videos = True  # (Qwen2-VL, Qwen2.5-VL, Qwen3-VL: the models of this processor)

    def __init__(self, model_path: str | Path, hf_config: PretrainedConfig | None = None,
                 mm_processor_kwargs: dict | None = None, **load: Any) -> None:
        super().__init__(model_path, hf_config, **load)
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
        self._hash_extras: dict[tuple[int, int] | None, str] = {}
        # Qwen3-VL's temporal patches each follow their time as text ("<1.5 seconds>") in a
        # vision block of their own
        self.timestamped = hf_config.model_type in ("qwen3_vl", "qwen3_vl_moe", "qwen3_5",
                                                    "qwen3_5_moe")
        # the video processor's own settings (transformers' Qwen2VLVideoProcessor, or
        # Qwen3VLVideoProcessor: its class defaults where the checkpoint gives none)
        video = video_processor_config(self.model_path)
        self.video_settings = video
        size = video.get("size") or {}
        unit = (ip.patch_size * ip.merge_size) ** 2  # transformers' defaults: 128 to 768 units
        self.video_min_pixels: int = (video.get("min_pixels") or size.get("shortest_edge")
                                      or 128 * unit)
        self.video_max_pixels: int = (video.get("max_pixels") or size.get("longest_edge")
                                      or 768 * unit)
        # qwen-vl-utils' cap on a video's pixels (transformers: off unless set)
        self.video_cap: bool = bool(video.get("cap_pixels_per_frame"))
        self.max_video_tokens: int = int(video.get("max_video_tokens")
                                         or (768 if self.timestamped else 128000))
        self.video_resample = video.get("resample", ip.resample)
        self._max_video_item_tokens: int | None = None  # `max_video_item_tokens`, computed once
        self.pixel_transform = Qwen2VLPixels(
            patch_size=ip.patch_size, temporal_patch_size=ip.temporal_patch_size,
            merge_size=ip.merge_size, **NormalizedPixels.settings_of(ip),
            video=video_normalization(video, self.timestamped))
        # Qwen2.5-VL: a temporal patch's positions step by tokens_per_second * its seconds
        self.tokens_per_second: float | None = (
            getattr(hf_config.vision_config, "tokens_per_second", None)
            if hf_config.model_type == "qwen2_5_vl" else None)

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

    def pixel_tokens(self, shape: Sequence[int], encoder_meta: Sequence[int]) -> int:
        """The token count of an image preprocessed elsewhere, from the shape of its uint8
        pixels as this processor gives them (``[H, W, 3]``; a video's frames ``[F, H, W,
        3]``, F whole temporal patches), whose grid its ``encoder_meta`` must be;
        `InvalidImageError` naming the mismatch."""
        p, factor = self.patch_size, self.patch_size * self.merge_size
        frames_per_patch = self.pixel_transform.temporal_patch_size
        frames, height, width = ((1, *shape[:2]) if len(shape) == 3 else tuple(shape[:3])
                                 if len(shape) == 4 else (0, 0, 0))
        if not frames or height % factor or width % factor or (
                len(shape) == 4 and frames % frames_per_patch):
            raise InvalidImageError(
                f"pixels of shape {list(shape)}: this processor gives [H, W, 3] (a video: [F, "
                f"H, W, 3], F a multiple of {frames_per_patch}), H and W multiples of {factor}")
        grid = (max(1, frames // frames_per_patch), height // p, width // p)
        if tuple(encoder_meta) != grid:
            raise InvalidImageError(f"encoder_meta {list(encoder_meta)} does not fit pixels "
                                    f"of shape {list(shape)}: their patch grid is {list(grid)}")
        return self.num_image_tokens(grid)

    def described_prompt(self, prompt: str | None, prompt_token_ids: list[int] | None,
                         encoder_metas: Sequence[Sequence[int]]) -> ProcessedPrompt:
        """The prompt as `process` makes it for images with these ``encoder_meta``s (patch
        grids; images encoded elsewhere: their hashes empty, their pixels shapes on the meta
        device): token ids, offsets, lengths, grids and positions, what a client's
        embeddings are checked against. A grid this processor never gives an image (not
        (1, h, w) of positive h and w, multiples of the merge size, within
        `max_image_tokens`) is an `InvalidImageError`."""
        p, m = self.patch_size, self.merge_size
        prepared = []
        for i, meta in enumerate(encoder_metas):
            meta = list(meta)
            if (len(meta) != 3 or meta[0] != 1 or not all(0 < x <= 1 << 20 for x in meta)
                    or meta[1] % m or meta[2] % m
                    or self.num_image_tokens(meta) > self.max_image_tokens):
                raise InvalidImageError(
                    f"image {i}: encoder_meta {meta} is not an image's patch grid: expected "
                    f"[1, h, w], h and w positive multiples of {m}, at most "
                    f"{self.max_image_tokens} tokens")
            pixels = torch.empty((meta[1] * p, meta[2] * p, 3), dtype=torch.uint8,
                                 device="meta")
            prepared.append(PreparedImage("", pixels, 0))
        return self.process(prompt, prompt_token_ids, prepared)

    def prepare(self, image: Image.Image, options: tuple[int, int] | None = None
                ) -> PreparedImage:
        """The host part of the image processor for one image: its content hash and its
        resized pixels (what a cache of processed images keeps); ``options``: the pixel range
        of `image_options` (None: the engine's)."""
        rgb = image if image.mode == "RGB" else image.convert("RGB")
        array = np.array(rgb)  # writable: torch.from_numpy shares it
        return PreparedImage(hash_image(array, self._hash_extra(options)),
                             self._resize(rgb, array, options), image.width * image.height)

    def prepare_video(self, video: Video) -> tuple[str, torch.Tensor, tuple[int, int, int]]:
        """A video's content hash, its frames resized as the HF video processor resizes them
        (every frame to one size: `smart_resize` within the video pixel range) and padded to
        whole temporal patches by repeating the last frame, ``[F, H, W, 3]`` uint8, and its
        patch grid (F / T, H / p, W / p)."""
        frames = video.frames
        t = self.pixel_transform.temporal_patch_size
        extra = self.hash_extra(video=[self.video_min_pixels, self.video_max_pixels, video.fps,
                                       self.video_cap, self.max_video_tokens,
                                       self.video_resample, self.pixel_transform.video])
        mm_hash = hash_video(frames, extra)
        count, height, width = frames.shape[:3]
        factor = self.patch_size * self.merge_size
        max_pixels = self._video_max_pixels(count)
        try:
            if self.timestamped:  # Qwen3-VL's: the pixel range covers all frames
                from transformers.models.qwen3_vl.video_processing_qwen3_vl import (
                    smart_resize,
                )

                new_h, new_w = smart_resize(count, height, width, temporal_factor=t,
                                            factor=factor, min_pixels=self.video_min_pixels,
                                            max_pixels=max_pixels)
            else:
                new_h, new_w = self._smart_resize(height, width, factor=factor,
                                                  min_pixels=self.video_min_pixels,
                                                  max_pixels=max_pixels)
        except ValueError as e:
            raise InvalidImageError(f"video processor rejected a video: {e}") from e
        pixels = torch.from_numpy(frames)
        if (new_h, new_w) != (height, width):
            pixels = torch.stack([self._resize(Image.fromarray(f), f, None, (new_h, new_w),
                                               self.video_resample) for f in frames])
        if pad := -count % t:
            pixels = torch.cat([pixels, pixels[-1:].expand(pad, -1, -1, -1)])
        p = self.patch_size
        return mm_hash, pixels.contiguous(), ((count + pad) // t, new_h // p, new_w // p)

    def _video_max_pixels(self, count: int) -> int:
        """The pixel cap `smart_resize` holds a video of ``count`` frames to: the video
        processor's ``longest_edge`` (Qwen3-VL: all frames together), or with
        ``cap_pixels_per_frame`` qwen-vl-utils' cap as transformers applies it (Qwen2-VL:
        each frame within an even share of 90% of ``max_video_tokens`` tokens' pixels per
        temporal patch; Qwen3-VL: each frame within ``max_video_tokens`` tokens' pixels and an
        even share of ``longest_edge``; either at least 1.05 x ``shortest_edge``)."""
        if not self.video_cap:
            return self.video_max_pixels
        factor = self.patch_size * self.merge_size
        floor = int(self.video_min_pixels * 1.05)
        if self.timestamped:
            frame_cap = self.max_video_tokens * factor * factor
            return max(min(frame_cap, self.video_max_pixels // count), floor) * count
        total = int(self.max_video_tokens * factor * factor * 0.9)
        t = self.pixel_transform.temporal_patch_size
        return max(min(self.video_max_pixels, total * t // count), floor)

    def _video_step(self, video: Video) -> float:
        """The temporal position step of a video's patches (1 for Qwen2-VL)."""
        if self.tokens_per_second is None:
            return 1.0
        # transformers: seconds per temporal patch = T / fps, fps 24 where none is given
        fps = video.fps or 24.0
        return self.tokens_per_second * self.pixel_transform.temporal_patch_size / fps

    def _video_items(self, videos: Sequence[Video]) -> list[tuple]:
        """(name, hash, pixels, grid, temporal step) of each video's placeholder run: one a
        video, or with Qwen3-VL one a temporal patch (its T frames, grid (1, h, w): the tower
        attends within a frame, so each patch alone gives the video's rows)."""
        out = []
        for i, video in enumerate(videos):
            mm_hash, pixels, (t, h, w) = self.prepare_video(video)
            if not self.timestamped:
                out.append((f"video {i}", mm_hash, pixels, (t, h, w), self._video_step(video)))
                continue
            n = self.pixel_transform.temporal_patch_size
            out += [(f"video {i} patch {k}",
                     hashlib.sha256(f"{mm_hash} patch {k}".encode()).hexdigest(),
                     pixels[k * n:(k + 1) * n], (1, h, w), 1.0) for k in range(t)]
        return out

    def _timestamped(self, prompt: str, videos: Sequence[Video]) -> str:
        """Qwen3-VL's prompt text: each video's placeholder (with or without the chat
        template's vision start / end around it) replaced by, per temporal patch, its time
        ("<0.5 seconds>": the mean of its first and last frame's) and a vision block of one
        ``<|video_pad|>``, as transformers' processor writes it."""
        tokens = self.tokenizer.convert_ids_to_tokens(
            [self.hf_config.vision_start_token_id, self.video_token_id,
             self.hf_config.vision_end_token_id])
        block, pad = "".join(tokens), tokens[1]
        pieces = prompt.replace(block, pad).split(pad)
        if len(pieces) - 1 != len(videos):
            raise InvalidRequestError(f"the prompt has {len(pieces) - 1} video placeholder(s) "
                                      f"but {len(videos)} video(s) were given")
        n = self.pixel_transform.temporal_patch_size
        out = [pieces[0]]
        for video, piece in zip(videos, pieces[1:], strict=True):
            count = video.num_frames
            times = list(video.timestamps or [i / (video.fps or 24.0) for i in range(count)])
            times += times[-1:] * (-count % n)  # the last frame repeated, as its pixels are
            out += [f"<{(times[k] + times[k + n - 1]) / 2:.1f} seconds>{block}"
                    for k in range(0, len(times), n)]
            out.append(piece)
        return "".join(out)

    def process(
        self,
        prompt: str | None,
        prompt_token_ids: list[int] | None,
        images: Sequence[Image.Image | PreparedImage],
        options: tuple[int, int] | None = None,
        videos: Sequence[Video] = (),
    ) -> ProcessedPrompt:
        """Tokenize, run the image (and video) processor, expand placeholders, compute mRoPE
        positions.

        The prompt holds one ``<|image_pad|>`` per image and one ``<|video_pad|>`` per video
        (as the chat template renders them) or an already expanded run of exactly the right
        length.
        """
        video_items = self._video_items(videos)
        if videos and self.timestamped:
            if prompt is None:
                raise InvalidRequestError("Qwen3-VL videos need the prompt as text (their "
                                          "frames' times are text in it)")
            prompt_text = self._timestamped(prompt, videos)
            ids = self.token_ids(prompt_text, None)
        else:
            ids = self.token_ids(prompt, prompt_token_ids)
        frame = (self.hf_config.vision_start_token_id, self.hf_config.vision_end_token_id)
        runs = _item_runs(ids, self.image_token_id, len(images), frame)
        if len(runs) != len(images):
            raise InvalidRequestError(
                f"the prompt has {len(runs)} image placeholder(s) but {len(images)} image(s) "
                "were given"
            )
        video_runs = (_item_runs(ids, self.video_token_id, len(video_items), frame)
                      if self.video_token_id is not None else [])
        if len(video_runs) != len(video_items):
            raise InvalidRequestError(
                f"the prompt has {len(video_runs)} video placeholder(s) but {len(videos)} "
                "video(s) were given"
            )
        if not images and not videos:
            positions, delta = compute_mrope_positions(len(ids), [], self.merge_size)
            return ProcessedPrompt(
                prompt, ids, images=[], prompt_positions=positions, position_offset=delta
            )

        prepared = [img if isinstance(img, PreparedImage) else self.prepare(img, options)
                    for img in images]
        # (placeholder run, name, hash, pixels, grid, temporal step) of each item
        items = [(run, f"image {i}", p.mm_hash, p.pixels,
                  (1, p.pixels.shape[0] // self.patch_size, p.pixels.shape[1] // self.patch_size),
                  1.0) for i, (run, p) in enumerate(zip(runs, prepared, strict=True))]
        items += [(run, *item) for run, item in zip(video_runs, video_items, strict=True)]
        items.sort(key=lambda item: item[0][0])
        out_ids: list[int] = []
        placed: list[tuple[int, tuple[int, int, int], float]] = []
        image_inputs: list[ImageInput] = []
        cursor = 0
        for (start, length), name, mm_hash, px, grid, step in items:
            n = self.num_image_tokens(grid)
            if length not in (1, n):
                raise InvalidRequestError(
                    f"{name}: its placeholder run has {length} tokens; expected 1 or {n}"
                )
            token = ids[start]
            out_ids += ids[cursor:start]
            placed.append((len(out_ids), grid, step))
            image_inputs.append(ImageInput(mm_hash=mm_hash, offset=len(out_ids), length=n,
                                           pixels=px, encoder_meta=grid,
                                           transform=self.pixel_transform, name=name))
            out_ids += [token] * n
            cursor = start + length
        out_ids += ids[cursor:]
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

    @property
    def max_video_item_tokens(self) -> int:
        """Most placeholder tokens (embedding rows) one video encoder item can become: a whole
        video (Qwen2-VL, Qwen2.5-VL) or a temporal patch (Qwen3-VL), over every frame count a
        video may have (up to `MAX_FRAMES`), each frame at the most pixels the video processor
        leaves it for that count (`_video_max_pixels`); 0 for a model without videos."""
        if self.video_token_id is None:
            return 0
        if self._max_video_item_tokens is None:
            unit = (self.patch_size * self.merge_size) ** 2
            t = self.pixel_transform.temporal_patch_size
            most = 0
            for count in range(1, MAX_FRAMES + 1):
                cap = self._video_max_pixels(count)
                if not self.timestamped:  # every frame within cap, in ceil(count / t) patches
                    most = max(most, -(-count // t) * (cap // unit))
                elif count >= t:  # Qwen3-VL's smart_resize: t' x H x W within cap (t' the
                    # frames rounded to whole patches), or count x H x W when it shrinks them
                    frames = min(count, round(count / t) * t)
                    most = max(most, cap // frames // unit)
            self._max_video_item_tokens = max(most, 1)
        return self._max_video_item_tokens

    def _resize(self, image: Image.Image, array: np.ndarray,
                options: tuple[int, int] | None = None,
                size: tuple[int, int] | None = None, resample: int | None = None
                ) -> torch.Tensor:
        """The image at the size the HF processor gives it (or at ``size``, (H, W)),
        ``[H, W, 3]`` uint8, resized (only when the size changes) by the same library as the
        HF backend in use, with ``resample`` (default: the image processor's)."""
        ip = self.image_processor
        resample = ip.resample if resample is None else resample
        height, width = array.shape[:2]
        factor = self.patch_size * self.merge_size
        if size is not None:
            new_h, new_w = size
        elif not ip.do_resize:
            if height % factor or width % factor:
                raise InvalidImageError(f"image of {width}x{height} pixels: without resizing, "
                                        f"both sides must be multiples of {factor}")
            return torch.from_numpy(array)
        else:
            lo, hi = options or (self.min_pixels, self.max_pixels)
            try:
                new_h, new_w = self._smart_resize(height, width, factor=factor,
                                                  min_pixels=lo, max_pixels=hi)
            except ValueError as e:  # e.g. an aspect ratio the resizer refuses
                raise InvalidImageError(f"image processor rejected an image: {e}") from e
        if (new_h, new_w) == (height, width):
            return torch.from_numpy(array)
        if not self.pixel_transform.fused:  # the PIL backend
            return torch.from_numpy(np.array(image.resize((new_w, new_h), resample=resample)))
        from torchvision.transforms.v2 import functional as tvF
        from transformers.image_utils import pil_torch_interpolation_mapping

        chw = torch.from_numpy(array).permute(2, 0, 1).contiguous()
        out = tvF.resize(chw, [new_h, new_w], antialias=True,
                         interpolation=pil_torch_interpolation_mapping[resample])
        return out.permute(1, 2, 0).contiguous()


def _item_runs(ids: list[int], token_id: int, count: int,
               frame: tuple[int, int]) -> list[tuple[int, int]]:
    """The placeholder runs of ``count`` items: every run of ``token_id`` when there are that
    many, else the runs the chat template frames (vision start, run, vision end) when those are
    that many: a placeholder's text in a message (random prompts hold them) stays a plain token,
    as in vLLM. Other counts are the caller's error to report (all runs returned)."""
    runs = _placeholder_runs(ids, token_id)
    if len(runs) == count:
        return runs
    framed = [(s, n) for s, n in runs
              if s > 0 and ids[s - 1] == frame[0] and s + n < len(ids) and ids[s + n] == frame[1]]
    return framed if len(framed) == count else runs


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
