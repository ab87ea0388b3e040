"""Position schemes: how a decoder's position input is built. A model names its scheme
(`position_scheme`); the runner and the CUDA graphs ask it, never which model it is.

A request's position data comes from the model's processor and is opaque to the engine:
``prompt_positions`` (the prompt's positions where the processor computes them, e.g. mRoPE's
three rows; None: token indices) and ``position_offset`` (token i past the prompt sits at
position i + offset).
"""

from __future__ import annotations

from typing import Protocol

import torch


class PositionScheme(Protocol):
    def for_tokens(self, positions: torch.Tensor) -> torch.Tensor:
        """Positions ``[T]`` of tokens past their prompts (index + offset) -> the decoder's
        input, as a view (the CUDA graphs capture it over their persistent buffer)."""

    def build(self, token_positions: list[int],
              prompt_spans: list[tuple[int, torch.Tensor]]) -> torch.Tensor:
        """A step's positions on the host: ``token_positions`` (index + offset of every token
        in batch order), overwritten by ``prompt_spans`` ((first token in the step, the
        processor's positions of those prompt tokens))."""


class TokenPositions:
    """Plain RoPE: positions ``[T]``, a token's index (plus its request's offset, 0); no
    precomputed prompt positions."""

    def for_tokens(self, positions: torch.Tensor) -> torch.Tensor:
        return positions

    def build(self, token_positions: list[int],
              prompt_spans: list[tuple[int, torch.Tensor]]) -> torch.Tensor:
        assert not prompt_spans, "1-D positions take no precomputed prompt positions"
        return torch.tensor(token_positions, dtype=torch.int64)


class MRopePositions:
    """Multimodal RoPE (Qwen2-VL): positions ``[rows, T]``. The processor computes a prompt's
    (``prompt_positions`` ``[rows, num_prompt_tokens]``); a token past the prompt has its
    index plus offset in every row."""

    def __init__(self, rows: int = 3) -> None:
        self.rows = rows

    def for_tokens(self, positions: torch.Tensor) -> torch.Tensor:
        return positions.expand(self.rows, -1)  # equal rows

    def build(self, token_positions: list[int],
              prompt_spans: list[tuple[int, torch.Tensor]]) -> torch.Tensor:
        pos = self.for_tokens(torch.tensor(token_positions, dtype=torch.int64)).clone()
        for offset, rows in prompt_spans:
            pos[:, offset:offset + rows.shape[1]] = rows
        return pos
