"""A request as an encoder returns it: the prompt the LLM's admission would compute, and each
image's rows behind an embedding handle."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from vlmserve.transfer.consumer_ledger import consumer_ledger
from vlmserve.transfer.handles import EmbeddingHandle


@dataclass
class EncodedImage:
    """One image of a prompt: its placeholder run ``prompt_token_ids[offset:offset+length]``
    and, in ``handle``, its ``length`` embedding rows (None where this rank does not
    deliver results)."""

    mm_hash: str
    offset: int
    length: int
    encoder_meta: tuple[int, ...]
    handle: EmbeddingHandle | None


@dataclass
class EncoderOutput:
    """A request encoded: everything the LLM's admission would compute, plus the rows."""

    prompt: str | None
    prompt_token_ids: list[int]  # image placeholders expanded
    images: list[EncodedImage] = field(default_factory=list)
    # the model's position data, as `ProcessedPrompt`'s: [rows, len(prompt_token_ids)] int64
    # or None; token i >= len(prompt) sits at i + position_offset
    prompt_positions: torch.Tensor | None = None
    position_offset: int = 0

    def release(self) -> None:
        """Release every handle not opened or released yet (a consumer that gives up)."""
        seen = consumer_ledger()
        for img in self.images:
            if img.handle is not None:
                try:
                    img.handle.release(seen)
                except RuntimeError:  # already opened or released here
                    pass
