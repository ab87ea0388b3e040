"""Starting an engine-core process, from a front end or a supervisor: this module imports no
engine code (the child imports `engine/core_proc.py` itself)."""

from __future__ import annotations

import multiprocessing as mp

from vlmserve.config import EngineConfig
from vlmserve.process import CoreHandle, start_core

__all__ = ["CoreHandle", "start_engine_core"]


def start_engine_core(config: EngineConfig, log_level: str = "info"
                      ) -> tuple[mp.process.BaseProcess, CoreHandle]:
    """Spawn an engine-core process for `config` (it dies with this process)."""
    return start_core("vlmserve.engine.core_proc:run_engine_core", "vlmserve-engine-core",
                      config, log_level)
