"""vlmserve: a serving engine for vision-language models.

The public names load on first use, so `vlmserve --help` and `import vlmserve` need no torch.
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"
_EXPORTS = {
    "LLM": "vlmserve.llm",
    "SamplingParams": "vlmserve.sampling_params",
    "StructuredOutputsParams": "vlmserve.sampling_params",
    "RequestOutput": "vlmserve.outputs",
    "CompletionOutput": "vlmserve.outputs",
    "MultimodalEncoder": "vlmserve.encoder.encoder",
}
__all__ = list(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'vlmserve' has no attribute {name!r}")
    value = getattr(importlib.import_module(_EXPORTS[name]), name)
    globals()[name] = value  # once loaded, a plain attribute
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_EXPORTS])
