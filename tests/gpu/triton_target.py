"""Where the Triton kernel tests run: CUDA at serving shapes, or CPU through Triton's
interpreter at small shapes. Without CUDA, `tests/conftest.py` sets `TRITON_INTERPRET=1`
before any kernel is defined, so a plain `pytest` on a CPU machine (CI) runs every kernel.
Import first in a kernel test module; it skips the module only where triton is missing."""

from __future__ import annotations

import os

import pytest
import torch

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
ON_GPU = torch.cuda.is_available() and not INTERPRET
if not (ON_GPU or INTERPRET):
    pytest.skip("needs CUDA or TRITON_INTERPRET=1", allow_module_level=True)
pytest.importorskip("triton")


def _fix_interpreter_index_for_numpy_2_4() -> None:
    """Triton <= 3.6's interpreter turns a scalar (a 1-element array) into a Python int with
    ``int(array)``, which numpy 2.4 refuses for arrays of one dimension ("only 0-dimensional
    arrays can be converted"); Triton 3.9 squeezes first. Give older interpreters the same
    ``__index__`` (nothing else changes; newer ones are left alone)."""
    import inspect

    import numpy as np
    from triton.runtime import interpreter

    if tuple(int(x) for x in np.__version__.split(".")[:2]) < (2, 4):
        return
    patch = getattr(interpreter, "_patch_lang_tensor", None)
    if patch is None or "squeeze()" in inspect.getsource(patch):
        return

    def patched(tensor, scope):
        patch(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.squeeze()))

    interpreter._patch_lang_tensor = patched


if INTERPRET:
    _fix_interpreter_index_for_numpy_2_4()

DEVICE = torch.device("cuda" if ON_GPU else "cpu")
