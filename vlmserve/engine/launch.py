"""Starting engine-core processes, from a front end or a supervisor: this module imports no
engine code (the child imports `engine/core_proc.py` itself)."""

from __future__ import annotations

import contextlib
import logging
import multiprocessing as mp
import os
from collections.abc import Iterator

import torch

from vlmserve.config import EngineConfig
from vlmserve.process import CoreHandle, start_core
from vlmserve.utils import resolve_device

__all__ = ["CoreHandle", "start_engine_core", "start_engine_cores"]
logger = logging.getLogger(__name__)


def start_engine_core(config: EngineConfig, log_level: str = "info"
                      ) -> tuple[mp.process.BaseProcess, CoreHandle]:
    """Spawn an engine-core process for `config` (it dies with this process)."""
    return start_core("vlmserve.engine.core_proc:run_engine_core", "vlmserve-engine-core",
                      config, log_level)


def start_engine_cores(config: EngineConfig, count: int, log_level: str = "info"
                       ) -> list[tuple[mp.process.BaseProcess, CoreHandle]]:
    """Spawn `count` engine cores (data parallelism), each with the environment of
    `core_environment`; all load at once."""
    if count == 1:
        return [start_engine_core(config, log_level)]
    started = []
    try:
        for env in core_environment(config, count):
            with _environ(env):
                started.append(start_engine_core(config, log_level))
    except BaseException:
        for proc, _ in started:
            proc.kill()
        raise
    return started


def core_environment(config: EngineConfig, count: int) -> list[dict[str, str]]:
    """Each of `count` engine cores' environment: on CUDA its GPUs (`CUDA_VISIBLE_DEVICES`:
    core i the i-th group of tensor-parallel-size GPUs of those visible; with fewer GPUs than
    that and no tensor parallelism, cores share them in turn, each within
    --gpu-memory-utilization of a GPU, which must leave room for the others); on the CPU a
    share of the host's cores (`OMP_NUM_THREADS`, unless set). `ValueError` when the cores
    cannot fit."""
    device = resolve_device(config.model_config.device)
    if device.type != "cuda":
        if "OMP_NUM_THREADS" in os.environ:
            return [{}] * count
        cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (
            os.cpu_count() or 1)
        return [{"OMP_NUM_THREADS": str(max(1, cpus // count))}] * count
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    ids = ([d.strip() for d in visible.split(",") if d.strip()] if visible is not None
           else [str(i) for i in range(torch.cuda.device_count())])
    tp = config.parallel_config.tensor_parallel_size
    if len(ids) >= count * tp:
        return [{"CUDA_VISIBLE_DEVICES": ",".join(ids[i * tp:(i + 1) * tp])}
                for i in range(count)]
    if tp > 1 or not ids:
        raise ValueError(f"--data-parallel-size {count} x --tensor-parallel-size {tp} needs "
                         f"{count * tp} GPUs; {len(ids)} are visible")
    sharing = -(-count // len(ids))
    share = config.cache_config.gpu_memory_utilization
    if share * sharing > 1.0:
        raise ValueError(f"--data-parallel-size {count} on {len(ids)} GPU(s) puts {sharing} "
                         f"engine cores on a GPU, each using --gpu-memory-utilization {share:g} "
                         f"of it: at most {1 / sharing:.2f} each")
    logger.info("%d engine cores share %d GPU(s), %d a GPU", count, len(ids), sharing)
    return [{"CUDA_VISIBLE_DEVICES": ids[i % len(ids)]} for i in range(count)]


@contextlib.contextmanager
def _environ(env: dict[str, str]) -> Iterator[None]:
    """`env` set in this process while a child is spawned (it inherits the environment)."""
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
