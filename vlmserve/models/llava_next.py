"""LLaVA-NeXT: anyres tiles through the CLIP tower -> projector -> unpadded tile grid with
``image_newline`` row markers after the base tile -> Mistral / Vicuna (Llama) decoder."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from vlmserve.models.llava import LlavaForConditionalGeneration
from vlmserve.models.llava_next_processing import LlavaNextInputProcessor, anyres_geometry


class LlavaNextForConditionalGeneration(LlavaForConditionalGeneration):
    input_processor_cls = LlavaNextInputProcessor
    encoder_prefixes = (*LlavaForConditionalGeneration.encoder_prefixes, "model.image_newline",
                        "image_newline")

    def __init__(self, hf_config) -> None:
        if hf_config.vision_feature_select_strategy != "default":
            raise ValueError("LLaVA-NeXT: only vision_feature_select_strategy 'default' is "
                             "supported")
        window = getattr(hf_config.text_config, "sliding_window", None)
        if window is not None and window < hf_config.text_config.max_position_embeddings:
            raise ValueError(f"sliding-window attention ({window}) is not supported")
        super().__init__(hf_config)

    def _init_vision(self, hf_config) -> None:
        """LLaVA's tower and projector, the tiling geometry and ``image_newline`` (on a
        model or a `LlavaEncoder`, hence no ``super()``)."""
        LlavaForConditionalGeneration._init_vision(self, hf_config)
        vc = hf_config.vision_config
        self.tile, self.patches = vc.image_size, vc.image_size // vc.patch_size
        self.pinpoints = [tuple(map(int, p)) for p in hf_config.image_grid_pinpoints]
        self.image_newline = nn.Parameter(torch.empty(hf_config.text_config.hidden_size))

    def encode_images(self, pixel_values: torch.Tensor,
                      encoder_meta: Sequence[tuple[int, ...]]) -> torch.Tensor:
        """``[sum of tiles, 3, S, S]`` (each image's base tile, then its grid row by row) and
        each image's ``encoder_meta`` (tiles, original height, original width) ->
        ``[sum of rows, hidden]``, image by image: the base tile's features, then each
        unpadded feature row of the grid followed by ``image_newline``."""
        feats = self.multi_modal_projector(self.vision_tower(pixel_values))  # [tiles, p*p, D]
        p, d = self.patches, feats.shape[-1]
        out, start = [], 0
        for n, height, width in encoder_meta:
            rows, cols, (top, bottom, left, right) = anyres_geometry(
                height, width, self.pinpoints, self.tile, p)
            assert n == 1 + rows * cols, f"{n} tiles for a {rows}x{cols} grid"
            image = feats[start:start + n]
            start += n
            grid = image[1:].view(rows, cols, p, p, d).permute(0, 2, 1, 3, 4)
            grid = grid.reshape(rows * p, cols * p, d)[top:bottom, left:right]  # [H', W', D]
            newline = self.image_newline.to(grid.dtype).expand(grid.shape[0], 1, d)
            out += [image[0], torch.cat([grid, newline], dim=1).reshape(-1, d)]
        assert start == feats.shape[0], f"{feats.shape[0]} tiles for {list(encoder_meta)}"
        return torch.cat(out)

    def load_weights(self, weights) -> set[str]:
        """LLaVA's names (hub or transformers 5.x layout) plus ``image_newline``."""
        rest, loaded = [], set()
        for name, tensor in weights:
            if name.removeprefix("model.") == "image_newline":
                with torch.no_grad():
                    self.image_newline.copy_(tensor)
                loaded.add("image_newline")
            else:
                rest.append((name, tensor))
        return loaded | super().load_weights(rest)
