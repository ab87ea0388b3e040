"""Tensor-parallel executor: rank 0 in this process; ranks 1..N-1 either spawned here (one
host), or started by torchrun on this and other hosts (`torchrun_env()`: every rank runs
`vlmserve serve`, rank 0 the server, the others `run_torchrun_worker`).

Rank 0 sends its engine config to the others when the group forms, so every rank builds the
same executor, and then each step's `SchedulerOutput` (a small picklable delta) on a gloo
group, in the vision tower's data mode without pixels (a rank gets those of its share of the
step's images from rank 0 as it encodes them: worker/encoder_runner.py); all ranks run the
same step, their sharded layers meet in collectives, and every rank takes rank 0's sampled
tokens, so every rank's request state stays identical. Rank 0's tokens go back to the
scheduler.
"""

from __future__ import annotations

import logging
from dataclasses import replace

from vlmserve.config import EngineConfig, ModelConfig
from vlmserve.core.scheduler_output import SchedulerOutput
from vlmserve.distributed.parallel_state import (
    TensorParallel,
    TorchrunEnv,
    init_tensor_parallel,
    torchrun_env,
)
from vlmserve.distributed.ranks import Followers
from vlmserve.executor.uniproc import UniprocExecutor
from vlmserve.layers.tensor_parallel import check_divisible
from vlmserve.layers.vision_tensor_parallel import check_vision_divisible
from vlmserve.models.metadata import local_model_config
from vlmserve.models.registry import resolve_model_class
from vlmserve.utils import limit_host_threads, resolve_device
from vlmserve.worker.model_runner import StepResult

logger = logging.getLogger(__name__)


def without_pixels(so: SchedulerOutput) -> SchedulerOutput:
    """`so` with each image's pixels left out (`ImageInput.without_pixels`)."""
    if not so.encoder_inputs:
        return so
    return replace(so, encoder_inputs={h: img.without_pixels()
                                       for h, img in so.encoder_inputs.items()})


def serve_rank(tp: TensorParallel, local: ModelConfig | None = None) -> None:
    """The loop of a rank other than 0: rank 0's config, this rank's share of the model, then
    rank 0's steps until it sends None. The model's folder is rank 0's (a rank spawned on its
    host), or for a torchrun rank that of its own host (``local``: its options with their
    model and tokenizer folders, `local_model_config`)."""
    from vlmserve.models.loader import load_hf_config

    config, max_model_len = tp.broadcast_object()
    if local is not None:
        config = replace(config, model_config=replace(
            config.model_config, model=local.model, tokenizer=local.tokenizer))
    model_path = config.model_config.model
    executor = UniprocExecutor(
        config, model_path,
        load_hf_config(model_path, config.model_config.model_impl,
                       trust_remote_code=config.model_config.trust_remote_code),
        max_model_len, tp=tp)
    tp.all_gather_object(executor.load_stats)
    if config.model_config.kernel_warmup:  # resolved by rank 0, as its own
        executor.warmup()  # the same fake steps as rank 0's: their collectives pair up
    previous = None
    while (so := tp.broadcast_object()) is not None:
        result = executor.execute_model(so)
        if previous is not None:  # read back one step late, like rank 0 with async scheduling
            previous.get()
        previous = result
    tp.close()


def run_torchrun_worker(config: EngineConfig, env: TorchrunEnv) -> int:
    """`vlmserve serve` on a torchrun rank other than 0: no server, the worker loop until
    rank 0 shuts down (0) or is gone (1). Its model is resolved on its own host (which may
    not be rank 0's)."""
    local = local_model_config(config.model_config)
    device = resolve_device(config.model_config.device, env.local_rank)
    if device.type == "cuda":
        limit_host_threads()
    tp = init_tensor_parallel(env.rank, env.world_size, "env://", device,
                              config.parallel_config.tp_timeout, env.local_rank)
    try:
        serve_rank(tp, local)
    except RuntimeError as e:  # a collective failed: rank 0 (or another rank) is gone
        logger.error("tensor-parallel rank %d stops: %s", env.rank, e)
        return 1
    return 0


class MultiprocExecutor:
    def __init__(self, config: EngineConfig, model_path, hf_config, max_model_len: int) -> None:
        world = config.parallel_config.tensor_parallel_size
        pc = config.parallel_config
        cls = resolve_model_class(hf_config)
        if hasattr(cls, "check_tensor_parallel"):  # the transformers backend
            cls.check_tensor_parallel(hf_config, world, pc)
        else:
            check_divisible(getattr(hf_config, "text_config", None) or hf_config, world,
                            pc.enable_expert_parallel)
            if pc.mm_encoder_tp_mode == "weights":
                check_vision_divisible(hf_config.vision_config, world)
        mc, timeout_s = config.model_config, config.parallel_config.tp_timeout
        env = torchrun_env()
        self.followers: Followers | None = None
        self._closed = False
        try:
            if env is None:  # one host: ranks 1..N-1 are ours
                self.followers = Followers(world, serve_rank, (), mc.device, timeout_s)
                self.tp = self.followers.connect(resolve_device(mc.device, 0))
            else:  # torchrun started every rank; this is rank 0 (the others: the worker loop)
                if env.rank != 0 or env.world_size != world:
                    raise ValueError(
                        f"under torchrun the engine runs on global rank 0 with WORLD_SIZE "
                        f"equal to tensor_parallel_size; this is rank {env.rank} of "
                        f"{env.world_size}, tensor_parallel_size={world}")
                self.tp = init_tensor_parallel(0, world, "env://",
                                               resolve_device(mc.device, env.local_rank),
                                               timeout_s, env.local_rank)
            self.tp.broadcast_object((config, max_model_len))
            self.local = UniprocExecutor(config, model_path, hf_config, max_model_len, tp=self.tp)
            self.rank_load_stats = self.tp.all_gather_object(self.local.load_stats)  # by rank
        except BaseException:
            self._stop(abort=True)
            raise
        for name in ("device", "dtype", "kv_dtype", "num_kv_blocks", "cache_groups",
                     "num_snapshot_slots", "mm_offload",
                     "bytes_per_embedding_row", "encoder_cache_rows", "runner"):
            setattr(self, name, getattr(self.local, name))
        # data mode: the followers get the pixels of their share only, as they encode it;
        # in the other modes every rank encodes every image
        self._pixels_to_all = config.parallel_config.mm_encoder_tp_mode != "data"

    def warmup(self, processor=None) -> float:
        """Rank 0's warm-up; the other ranks run theirs as they start (see `serve_rank`)."""
        return self.local.warmup(processor)

    def execute_model(self, so: SchedulerOutput) -> StepResult:
        """Every rank runs the step; a rank that exited, or a collective that failed (a peer
        gone, or past `--tp-timeout`), raises `RankFailedError`, which stops the engine."""
        self.tp.check()
        self.tp.broadcast_object(so if self._pixels_to_all else without_pixels(so))
        return self.local.execute_model(so)

    def _stop(self, abort: bool = False) -> None:
        if self._closed:
            return
        self._closed = True
        if self.followers is not None:
            self.followers.stop(abort=abort)
        elif getattr(self, "tp", None) is not None:
            self.tp.shutdown(abort)

    def shutdown(self) -> None:
        self._stop()

    def __del__(self) -> None:
        try:
            self.shutdown()
        except Exception:  # noqa: BLE001 - interpreter shutdown
            pass
