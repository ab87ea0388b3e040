"""vlmserve: a serving engine for vision-language models.

The public names load on first use, so `vlmserve --help` and `import vlmserve` need no torch.
A process without a CUDA device does not load Triton (`_NoTritonWithoutGPU`).
"""

from __future__ import annotations

import importlib
import importlib.abc
import os
import sys
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


def _triton_can_run() -> bool:
    """Triton's kernels can run in this process: Triton's interpreter is on (the kernels'
    tests without a GPU), or torch sees a CUDA (or XPU) device."""
    if os.environ.get("TRITON_INTERPRET", "").lower() in ("1", "true", "yes", "on", "y"):
        return True
    try:
        import torch

        xpu = getattr(torch, "xpu", None)
        return torch.cuda.is_available() or bool(xpu is not None and xpu.is_available())
    except Exception:  # torch half imported or broken: leave Triton to its own devices
        return True


class _NoTritonWithoutGPU(importlib.abc.MetaPathFinder):
    """`import triton` refused where its kernels cannot run: our kernel modules import it only
    on CUDA, but torch's dynamo probes for it (`has_triton_package`) when transformers loads,
    and a process that loaded it prints about 60 lines of nanobind leak reports as it exits.
    The probe takes the refusal as "not installed"."""

    def find_spec(self, name: str, path: Any = None, target: Any = None) -> None:
        if name == "triton" and not _triton_can_run():
            raise ModuleNotFoundError("triton is not loaded in a process without a GPU "
                                      "(vlmserve; TRITON_INTERPRET=1 loads it)", name=name)
        return None


if "triton" not in sys.modules and not any(isinstance(f, _NoTritonWithoutGPU)
                                           for f in sys.meta_path):
    sys.meta_path.insert(0, _NoTritonWithoutGPU())
