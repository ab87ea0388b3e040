"""Tensor-parallel executor: rank 0 in this process, ranks 1..N-1 in spawned processes.

Every step rank 0 broadcasts the `SchedulerOutput` (a small picklable delta) on a gloo group;
all ranks run the same step, their sharded layers meet in all-reduces, and each computes the
same logits and samples the same tokens, so every rank's request state stays identical. Rank
0's tokens go back to the scheduler.
"""

from __future__ import annotations

import multiprocessing as mp
import socket

import torch.distributed as dist

from vlmserve.config import EngineConfig
from vlmserve.core.scheduler_output import SchedulerOutput
from vlmserve.distributed.parallel_state import RankFailedError, init_tensor_parallel
from vlmserve.distributed.tensor_parallel import check_divisible
from vlmserve.executor.uniproc import UniprocExecutor, resolve_device
from vlmserve.worker.model_runner import StepResult


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world: int, port: int, config: EngineConfig, model_path,
            max_model_len: int) -> None:
    from vlmserve.models.loader import load_hf_config

    tp = init_tensor_parallel(rank, world, port, resolve_device(config.model_config.device),
                              config.parallel_config.tp_timeout)
    executor = UniprocExecutor(config, model_path, load_hf_config(model_path), max_model_len,
                               tp=tp)
    warmup = config.model_config.kernel_warmup
    if warmup or (warmup is None and executor.device.type == "cuda"):
        executor.warmup()  # the same fake steps as rank 0's: their collectives pair up
    previous = None
    while (so := tp.broadcast_object()) is not None:
        result = executor.execute_model(so)
        if previous is not None:  # read back one step late, like rank 0 with async scheduling
            previous.get()
        previous = result
    dist.destroy_process_group()


class MultiprocExecutor:
    def __init__(self, config: EngineConfig, model_path, hf_config, max_model_len: int) -> None:
        world = config.parallel_config.tensor_parallel_size
        check_divisible(getattr(hf_config, "text_config", None) or hf_config, world)
        port = _free_port()
        ctx = mp.get_context("spawn")
        self._procs = [ctx.Process(target=_worker, daemon=True, name=f"vlmserve-tp{rank}",
                                   args=(rank, world, port, config, model_path, max_model_len))
                       for rank in range(1, world)]
        for p in self._procs:
            p.start()
        self.timeout_s = config.parallel_config.tp_timeout
        self.tp = init_tensor_parallel(0, world, port, resolve_device(config.model_config.device),
                                       self.timeout_s)
        try:
            self.local = UniprocExecutor(config, model_path, hf_config, max_model_len, tp=self.tp)
        except BaseException:
            for p in self._procs:
                p.terminate()
            dist.destroy_process_group()
            raise
        for name in ("device", "dtype", "num_kv_blocks", "mm_offload",
                     "bytes_per_embedding_row", "encoder_cache_rows", "runner"):
            setattr(self, name, getattr(self.local, name))
        self._closed = False

    def warmup(self, processor=None) -> float:
        """Rank 0's warm-up; the other ranks run theirs as they start (see `_worker`)."""
        return self.local.warmup(processor)

    def execute_model(self, so: SchedulerOutput) -> StepResult:
        self._check_ranks()
        try:
            self.tp.broadcast_object(so)
            return self.local.execute_model(so)
        except RuntimeError as e:  # a collective failed: a rank that died is the cause
            self._check_ranks(wait_s=1.0)
            if "timed out" in str(e).lower() or "timeout" in str(e).lower():
                raise RankFailedError(f"a tensor-parallel rank did not answer within "
                                      f"{self.timeout_s:g} s (--tp-timeout): {e}") from e
            raise

    def _check_ranks(self, wait_s: float = 0.0) -> None:
        """Raise `RankFailedError` if a rank's process has exited."""
        for rank, p in enumerate(self._procs, 1):
            p.join(wait_s if rank == 1 else 0.0)
            if p.exitcode is not None:
                raise RankFailedError(f"tensor-parallel rank {rank} exited (exit code "
                                      f"{p.exitcode}); the engine cannot go on")

    def shutdown(self) -> None:
        if self._closed:
            return
        self._closed = True
        if all(p.is_alive() for p in self._procs):
            try:
                self.tp.broadcast_object(None)
            except RuntimeError:  # a rank went meanwhile
                pass
        for p in self._procs:
            p.join(timeout=30 if p.is_alive() else 0)
            if p.is_alive():
                p.terminate()
                p.join(5)
        dist.destroy_process_group()

    def __del__(self) -> None:
        try:
            self.shutdown()
        except Exception:  # noqa: BLE001 - interpreter shutdown
            pass
