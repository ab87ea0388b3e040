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


def _fix_interpreter_fp8_rounding() -> None:
    """Triton's interpreter (3.9 and earlier) rounds float32 -> e4m3 (``.to(tl.float8e4nv)``)
    without carrying a mantissa rounded up into the exponent: 124.0 becomes 64, not 128. The
    GPU rounds to nearest even (``cvt.rn``), as torch does: convert through torch there
    (the FP8 KV cache's write kernels store such values). A fixed interpreter is left alone."""
    import numpy as np
    import triton.language as tl
    from triton.runtime import interpreter

    builder = interpreter.InterpreterBuilder
    original = builder.create_fp_to_fp
    probe = interpreter.TensorHandle(np.array([124.0], dtype=np.float32), tl.float32)
    if original(interpreter.interpreter_builder, probe, tl.float8e4nv, None).data[0] == 0x58:
        return  # 0x58: 128.0 in e4m3

    def create_fp_to_fp(self, src, dst_type, rounding_mode):
        if dst_type.scalar != tl.float8e4nv or src.dtype.scalar != tl.float32:
            return original(self, src, dst_type, rounding_mode)
        x = torch.from_numpy(np.ascontiguousarray(src.data, dtype=np.float32))
        return interpreter.TensorHandle(x.to(torch.float8_e4m3fn).view(torch.uint8).numpy(),
                                        dst_type.scalar)

    builder.create_fp_to_fp = create_fp_to_fp


if INTERPRET:
    _fix_interpreter_index_for_numpy_2_4()
    _fix_interpreter_fp8_rounding()

DEVICE = torch.device("cuda" if ON_GPU else "cpu")
