"""Processed multimodal inputs: what admission hands to the scheduler and the worker."""

from dataclasses import dataclass, field

import torch


@dataclass
class ImageInput:
    """One image of a prompt, after the HF image processor.

    Its placeholder run is ``prompt_token_ids[offset : offset + length]`` and the vision tower
    turns ``pixel_values`` into exactly ``length`` embedding rows.
    """

    mm_hash: str  # content hash of the image plus model/processor settings
    offset: int  # index of the first placeholder token in the prompt
    length: int  # number of placeholder tokens == embedding rows
    pixel_values: torch.Tensor  # [num_patches, C * temporal_patch * patch * patch]
    grid_thw: tuple[int, int, int]  # patch grid (t, h, w) before spatial merge


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
