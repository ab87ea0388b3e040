"""The scheduler's package is plain Python: importing `core/` loads no torch (issue 16)."""

from __future__ import annotations

import subprocess
import sys


def test_core_imports_without_torch() -> None:
    code = ("import sys\n"
            "import vlmserve.core.scheduler, vlmserve.core.scheduler_output\n"
            "import vlmserve.core.kv_cache_manager, vlmserve.core.mm_cache_manager\n"
            "heavy = [m for m in ('torch', 'numpy', 'transformers') if m in sys.modules]\n"
            "assert not heavy, heavy\n")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)
