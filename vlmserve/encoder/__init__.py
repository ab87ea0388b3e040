"""The vision encoder as a service: `MultimodalEncoder`, embedding handles, their ledgers."""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "MultimodalEncoder": "vlmserve.encoder.encoder",
    "EncoderOutput": "vlmserve.transfer.encoded",
    "EncodedImage": "vlmserve.transfer.encoded",
    "EmbeddingHandle": "vlmserve.transfer.handles",
    "ShmHandle": "vlmserve.transfer.handles",
    "CudaIpcHandle": "vlmserve.transfer.handles",
    "BytesHandle": "vlmserve.transfer.handles",
    "HandleLedger": "vlmserve.encoder.ledger",
    "ConsumerLedger": "vlmserve.transfer.consumer_ledger",
    "consumer_ledger": "vlmserve.transfer.consumer_ledger",
    "EncoderRankError": "vlmserve.encoder.encoder",
    "EncoderClient": "vlmserve.encoder.client",
    "EncoderUnavailableError": "vlmserve.encoder.client",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:  # imported on first use: a consumer needs no model code
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name]), name)
