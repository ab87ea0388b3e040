"""Starting an engine-core process, from a front end or a supervisor: this module imports no
engine code (the child imports `engine/core_proc.py` itself)."""

from __future__ import annotations

import multiprocessing as mp
import os
import tempfile
import uuid
from dataclasses import dataclass

from vlmserve.config import EngineConfig
from vlmserve.utils import run_by_name


@dataclass(frozen=True)
class CoreHandle:
    """Where an engine-core process listens, and its pid (to notice its death)."""

    address: str
    pid: int


def start_engine_core(config: EngineConfig, log_level: str = "info"
                      ) -> tuple[mp.process.BaseProcess, CoreHandle]:
    """Spawn an engine-core process for `config` (it dies with this process)."""
    address = f"ipc://{tempfile.gettempdir()}/vlmserve-core-{uuid.uuid4().hex[:12]}"
    proc = mp.get_context("spawn").Process(
        target=run_by_name, name="vlmserve-engine-core",
        args=("vlmserve.engine.core_proc:run_engine_core", config, address,
              os.getpid(), log_level), daemon=False)
    proc.start()
    return proc, CoreHandle(address, proc.pid)
