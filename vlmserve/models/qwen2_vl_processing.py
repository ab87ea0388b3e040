"""Admission-time processing for the Qwen2-VL family: tokens, image patches, mRoPE positions.

The exact number of image tokens is decided here, before scheduling: each ``<|image_pad|>``
placeholder is expanded to ``t * h * w // merge**2`` tokens from the image processor's grid.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch
from PIL import Image

from vlmserve.errors import InvalidImageError, InvalidRequestError
from vlmserve.multimodal.hashing import hash_image
from vlmserve.multimodal.inputs import ImageInput, ProcessedPrompt

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


class Qwen2VLInputProcessor:
    """Turns a prompt (text or token ids) plus decoded images into a ``ProcessedPrompt``."""

    def __init__(self, model_path: str | Path, hf_config: PretrainedConfig | None = None) -> None:
        from transformers import AutoConfig, AutoTokenizer

        self.model_path = Path(model_path)
        if hf_config is None:
            hf_config = AutoConfig.from_pretrained(self.model_path, local_files_only=True)
        self.hf_config = hf_config
        self.tokenizer = AutoTokenizer.from_pretrained(self.model_path, local_files_only=True)
        self._tokenizer_lock = threading.Lock()
        self.image_processor = _load_image_processor(self.model_path)
        self.image_token_id: int = hf_config.image_token_id
        self.video_token_id: int | None = getattr(hf_config, "video_token_id", None)
        self.merge_size: int = hf_config.vision_config.spatial_merge_size
        assert self.image_processor.merge_size == self.merge_size, "processor/model merge differ"
        settings = {
            k: v
            for k, v in self.image_processor.to_dict().items()
            if k not in ("image_processor_type", "processor_class", "_processor_class")
        }
        self._hash_extra = json.dumps(
            {"model": str(self.model_path.resolve()), "processor": settings},
            sort_keys=True,
            default=str,
        )

    def apply_chat_template(self, messages: list[dict]) -> str:
        """Render HF-style messages (string content or text/image parts) as a prompt."""
        return self.tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=True
        )

    def num_image_tokens(self, grid_thw: Sequence[int]) -> int:
        """Placeholder tokens (== embedding rows) of an image with patch grid ``grid_thw``."""
        t, h, w = (int(x) for x in grid_thw)
        return t * h * w // self.merge_size**2

    def process(
        self,
        prompt: str | None,
        prompt_token_ids: list[int] | None,
        images: Sequence[Image.Image],
    ) -> ProcessedPrompt:
        """Tokenize, run the image processor, expand placeholders, compute mRoPE positions.

        The prompt holds one ``<|image_pad|>`` per image (as the chat template renders it) or
        an already expanded run of exactly the right length.
        """
        if (prompt is None) == (prompt_token_ids is None):
            raise InvalidRequestError("give exactly one of prompt and prompt_token_ids")
        if prompt is not None:
            with self._tokenizer_lock:  # HF fast tokenizers are not safe to share across threads
                ids = list(self.tokenizer.encode(prompt))
        else:
            ids = list(prompt_token_ids)
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
                prompt, ids, images=[], mrope_positions=positions, mrope_delta=delta
            )

        # one (writable) array of each image's pixels serves the hash and the image processor,
        # which would otherwise convert the PIL image again
        arrays = [np.array(img if img.mode == "RGB" else img.convert("RGB")) for img in images]
        hashes = [hash_image(a, self._hash_extra) for a in arrays]
        pixel_values, grids = self._run_image_processor(arrays)
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

        sizes = [t * h * w for t, h, w in grids]
        image_inputs = [
            ImageInput(
                mm_hash=mm_hash,
                offset=offset,
                length=self.num_image_tokens(grid),
                pixel_values=pv,
                grid_thw=grid,
            )
            for mm_hash, (offset, grid), pv in zip(
                hashes, placed, torch.split(pixel_values, sizes), strict=True
            )
        ]
        positions, delta = compute_mrope_positions(len(out_ids), placed, self.merge_size)
        return ProcessedPrompt(
            prompt, out_ids, images=image_inputs, mrope_positions=positions, mrope_delta=delta
        )

    def _run_image_processor(
        self, images: Sequence[np.ndarray]
    ) -> tuple[torch.Tensor, list[tuple[int, int, int]]]:
        try:
            out = self.image_processor(images=list(images), return_tensors="pt")
        except ValueError as e:  # e.g. an aspect ratio the resizer refuses
            raise InvalidImageError(f"image processor rejected an image: {e}") from e
        grids = [tuple(int(x) for x in g) for g in out["image_grid_thw"].tolist()]
        return out["pixel_values"], grids


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


def _load_image_processor(path: Path):
    """``AutoImageProcessor``; without torchvision on transformers < 5.2x, the PIL backend."""
    from transformers import AutoImageProcessor

    try:
        return AutoImageProcessor.from_pretrained(path, local_files_only=True)
    except ImportError:
        from transformers import Qwen2VLImageProcessorPil

        return Qwen2VLImageProcessorPil.from_pretrained(path, local_files_only=True)
