"""mRoPE positions of a prompt (Qwen2-VL, Qwen2.5-VL, Qwen3-VL, Qwen3.5): three rows (time,
height, width) per token, computed at admission from where each image or video sits."""

from __future__ import annotations

from collections.abc import Sequence

import torch


def compute_mrope_positions(
    num_tokens: int,
    images: Sequence[tuple[int, tuple[int, int, int]] | tuple[int, tuple[int, int, int], float]],
    spatial_merge_size: int,
) -> tuple[torch.Tensor, int]:
    """mRoPE positions [3, num_tokens] and delta, as HF's ``get_rope_index``.

    ``images`` holds ``(offset, (t, h, w))`` per image or video in prompt order, with a
    video's temporal step as a third item (Qwen2.5-VL: tokens_per_second * seconds per
    temporal patch; default 1). Text tokens count up by one in all three sections; an item's
    tokens take (t * step rounded down, h, w) indices of the merged grid plus the position it
    starts at, and the text after it resumes one past its largest position: start +
    max(h, w) // merge for an image, and for a video whose times run past its extent one
    past its last time. That is the rule the checkpoints were released with: the
    `get_rope_index` Qwen contributed to transformers with Qwen2-VL (4.45) and Qwen2.5-VL
    (4.49), ``st_idx = llm_pos_ids_list[-1].max() + 1``, Qwen's fine-tuning code and vLLM.
    transformers 5.x resumes at start + max(h, w) // merge whatever the times, so there the
    text after such a video repeats positions of the video's own; we keep the released rule.
    The delta is max position + 1 - num_tokens: token i beyond the prompt sits at i + delta.
    """
    pieces: list[torch.Tensor] = []
    pos = 0  # next position id
    cursor = 0  # next token index
    for offset, (t, h, w), *step in images:
        assert offset >= cursor, "images must be in prompt order and not overlap"
        text_len = offset - cursor
        pieces.append(torch.arange(pos, pos + text_len).expand(3, -1))
        pos += text_len
        gh, gw = h // spatial_merge_size, w // spatial_merge_size
        times = (torch.arange(t) * (step[0] if step else 1)).long()
        grid = torch.stack(
            torch.meshgrid(times, torch.arange(gh), torch.arange(gw), indexing="ij")
        )  # [3, t, gh, gw]
        pieces.append(grid.reshape(3, -1) + pos)
        pos += max(max(h, w) // spatial_merge_size, int(times[-1]) + 1)
        cursor = offset + t * gh * gw
    assert cursor <= num_tokens
    pieces.append(torch.arange(pos, pos + num_tokens - cursor).expand(3, -1))
    positions = torch.cat(pieces, dim=1).contiguous()  # [3, num_tokens]
    delta = int(positions.max()) + 1 - num_tokens if num_tokens else 0
    return positions, delta
