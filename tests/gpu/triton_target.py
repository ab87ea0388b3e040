"""Where the Triton kernel tests run: CUDA at serving shapes, or CPU through Triton's
interpreter (`TRITON_INTERPRET=1`) at small shapes. Import first in a kernel test module;
it skips the module when neither is available."""

from __future__ import annotations

import os

import pytest
import torch

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
ON_GPU = torch.cuda.is_available() and not INTERPRET
if not (ON_GPU or INTERPRET):
    pytest.skip("needs CUDA or TRITON_INTERPRET=1", allow_module_level=True)
pytest.importorskip("triton")
if INTERPRET:
    import numpy as np

    # Triton 3.6's interpreter converts 1-element arrays to ints, which numpy 2.4 refuses
    if tuple(int(x) for x in np.__version__.split(".")[:2]) >= (2, 4):
        pytest.skip("Triton's interpreter needs numpy < 2.4", allow_module_level=True)

DEVICE = torch.device("cuda" if ON_GPU else "cpu")
