"""The default executor: model, KV cache and runner in this process, on one device."""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Sequence

import torch

from vlmserve.config import EngineConfig
from vlmserve.core.kv_cache_groups import FULL, LayerKind, size_cache_groups
from vlmserve.core.scheduler_output import SchedulerOutput
from vlmserve.distributed.parallel_state import TensorParallel
from vlmserve.layers.fused import FusedOps
from vlmserve.layers.kv_quant import check_fp8_support, kv_cache_dtype
from vlmserve.layers.vision_attention import get_vision_attention_backend, graph_attention
from vlmserve.models.loader import LoadStats, load_model, peak_rss_delta, weight_bytes
from vlmserve.models.metadata import model_processor
from vlmserve.models.quantization import kv_cache_scales
from vlmserve.models.registry import resolve_model_class
from vlmserve.utils import DeviceShare, resolve_device, resolve_dtype
from vlmserve.worker.kv_cache import kv_block_bytes, layer_block_bytes
from vlmserve.worker.linear_states import state_bytes_per_slot
from vlmserve.worker.model_runner import ModelRunner, StepResult
from vlmserve.worker.vision_graphs import attach_vision_graphs
from vlmserve.worker.warmup import DEFAULT_IMAGE_SIZES
from vlmserve.worker.warmup_plan import Limits

logger = logging.getLogger(__name__)


def model_layer_kinds(model) -> list[LayerKind]:
    """Each decoder layer's kind, as the model declares it (`layer_kinds`; all full
    attention where it declares none)."""
    return list(getattr(model, "layer_kinds", None) or [FULL] * model.num_layers)


class UniprocExecutor:
    """Model, KV cache and runner in this process. With `tp`, this process is one rank of a
    tensor-parallel group (see executor/multiproc.py). `config` is resolved
    (`config.resolve_config`: rank 0's, on every rank)."""

    def __init__(self, config: EngineConfig, model_path, hf_config, max_model_len: int,
                 tp: TensorParallel | None = None) -> None:
        assert config.resolved is not None, "the executor takes a resolved config"
        mc, cc = config.model_config, config.cache_config
        self.config, self.model_path, self.hf_config = config, model_path, hf_config
        self.max_model_len = max_model_len
        self.device = resolve_device(mc.device, tp.local_rank if tp else None)
        self.dtype = resolve_dtype(mc.dtype, self.device)
        self.kv_dtype = kv_cache_dtype(cc.kv_cache_dtype, self.dtype)
        # the model's load and the caches' sizing, alone on this GPU among this host's engines
        with DeviceShare(self.device, cc.gpu_memory_utilization, lock=tp is None) as self._share:
            self._load(config, model_path, hf_config, max_model_len, tp)

    def _load(self, config: EngineConfig, model_path, hf_config, max_model_len: int,
              tp: TensorParallel | None) -> None:
        """The model, its state slots and KV cache, and the runner, within `self._share`."""
        mc, cc, sc = config.model_config, config.cache_config, config.scheduler_config
        torch.manual_seed(mc.seed)  # every rank draws the same random numbers
        model_cls = resolve_model_class(hf_config)  # imported before the load is measured
        if cc.kv_cache_dtype != "auto":
            check_fp8_support(model_cls, self.device,
                              "triton" in (mc.attention_backend, mc.fused_ops))
        with peak_rss_delta() as rss:  # a tensor-parallel rank reads and holds its share
            model = load_model(model_path, hf_config, self.dtype, self.device, tp,
                               shard_vision=config.parallel_config.mm_encoder_tp_mode == "weights",
                               quantization=mc.quantization,
                               expert_parallel=config.parallel_config.enable_expert_parallel)
        self.load_stats = LoadStats(weight_bytes(model), rss[0])
        # linear-attention layers: a state slot per running request, and with prefix
        # caching as many snapshot slots (fewer where they would take over half the budget)
        slot_bytes = state_bytes_per_slot(model, self.dtype)
        self.num_snapshot_slots = 0
        if slot_bytes and cc.enable_prefix_caching:
            self.num_snapshot_slots = sc.max_num_seqs
            budget = self._memory_budget(config)
            if budget is not None:
                fit = int(budget // 2 // slot_bytes) - sc.max_num_seqs
                self.num_snapshot_slots = max(min(self.num_snapshot_slots, fit), 0)
            if tp is not None:
                self.num_snapshot_slots = tp.min_int(self.num_snapshot_slots)
        self.num_state_slots = sc.max_num_seqs + self.num_snapshot_slots if slot_bytes else 0
        state_bytes = (self.num_state_slots + 1) * slot_bytes
        self.num_kv_blocks = cc.num_kv_blocks or self._default_num_blocks(
            model, config, max_model_len, state_bytes)
        if tp is not None:
            self.num_kv_blocks = tp.min_int(self.num_kv_blocks)
        # one cache group per attention kind of the model's layers (a full-attention model:
        # one group of every layer); `num_kv_blocks` is then the first group's
        self.cache_groups = size_cache_groups(
            model_layer_kinds(model), self.num_kv_blocks, block_size=cc.block_size,
            max_num_seqs=sc.max_num_seqs, max_model_len=max_model_len,
            chunk_tokens=sc.max_num_batched_tokens,
            layer_bytes=layer_block_bytes(model, cc.block_size, self.kv_dtype))
        self.num_kv_blocks = self.cache_groups[0].num_blocks
        # an FP8 cache's per-tensor scales: the checkpoint's, the same on every rank
        kv_scales = (kv_cache_scales(model_path, model.num_layers, tuple(model.encoder_prefixes))
                     if cc.kv_cache_dtype != "auto" else {})
        self.mm_offload = cc.mm_embedding_offload
        self.bytes_per_embedding_row = model.row_width * self.dtype.itemsize
        # the encoder cache's capacity: the scheduler's budget and, offloaded, the host rows
        self.encoder_cache_rows = config.resolved.encoder_cache_rows
        self.fused_ops = FusedOps.for_device(mc.fused_ops, self.device)
        model.set_fused_ops(self.fused_ops)
        self.vision_attention_fn = get_vision_attention_backend(mc.vision_attention_backend,
                                                                self.device, self.dtype)
        model.set_vision_attention_backend(self.vision_attention_fn)
        if config.resolved.vision_cuda_graph_max_rows:
            attach_vision_graphs(model, config.resolved.vision_cuda_graph_max_rows,
                                 attention=graph_attention(self.device, self.dtype))
        self.runner = ModelRunner(
            model, self.device, self.dtype, self.num_kv_blocks, cc.block_size,
            cache_groups=self.cache_groups,
            mm_offload=self.mm_offload, max_num_batched_tokens=sc.max_num_batched_tokens,
            attention_backend=mc.attention_backend,
            cuda_graph_max_batch=(sc.max_num_seqs if config.resolved.cuda_graphs
                                  and getattr(model, "cuda_graphs_safe", True) else 0),
            max_model_len=max_model_len, encoder_cache_rows=self.encoder_cache_rows,
            tp=tp,
            encoder_tp=config.parallel_config.mm_encoder_tp_mode == "data",
            num_state_slots=self.num_state_slots,
            linear_attention_backend=mc.linear_attention_backend,
            kv_dtype=self.kv_dtype, kv_scales=kv_scales)
        self.load_stats = dataclasses.replace(
            self.load_stats, host_cache_bytes=self.runner.store.host_pool_bytes)
        logger.info("model on %s (%s), %d KV blocks of %d tokens in %s%s", self.device,
                    self.dtype, self.num_kv_blocks, cc.block_size, cc.kv_cache_dtype,
                    f" (scales of {len(kv_scales)} layers from the checkpoint, else 1.0)"
                    if cc.kv_cache_dtype != "auto" else "")

    def _memory_budget(self, config: EngineConfig) -> float | None:
        """Device bytes the caches may take (CUDA: what this process has not yet taken of
        its gpu_memory_utilization share: `DeviceShare`); None on the CPU."""
        return self._share.budget()

    def _default_num_blocks(self, model, config: EngineConfig, max_model_len: int,
                            state_bytes: int = 0) -> int:
        """KV blocks within the budget left after the linear layers' `state_bytes`, each
        block in every attention layer (not the linear ones)."""
        cc, sc = config.cache_config, config.scheduler_config
        block_bytes = kv_block_bytes(model, cc.block_size, self.kv_dtype)
        budget = self._memory_budget(config)
        if budget is not None:
            fit = int((budget - state_bytes) // block_bytes)
            if fit < 1:
                gib = 1 << 30
                raise RuntimeError(
                    f"no device memory is left for the KV cache: gpu_memory_utilization="
                    f"{cc.gpu_memory_utilization:g} leaves {budget / gib:.2f} GiB after the model "
                    f"and a KV block takes "
                    f"{block_bytes / gib:.4f} GiB beside {state_bytes / gib:.2f} GiB of "
                    "linear-attention states; raise gpu_memory_utilization")
            # no more than every sequence at full length could use
            return min(fit, sc.max_num_seqs * -(-max_model_len // cc.block_size))
        return min(sc.max_num_seqs * -(-max_model_len // cc.block_size), 8192)

    def execute_model(self, so: SchedulerOutput) -> StepResult:
        return self.runner.execute_model(so)

    def warmup(self, processor=None,
               image_sizes: Sequence[tuple[int, int]] = DEFAULT_IMAGE_SIZES) -> float:
        """Compile every kernel variant a step can launch, before the first request, by a few
        steps of fake requests and replays of the attention launches (worker/warmup.py); the
        runner's state, the KV blocks it touched and the counters are left as they were.
        `processor`: the model's input processor (built here if not given); `image_sizes`:
        (width, height) of the warm-up's images. Returns the seconds spent. On the CPU the
        fake steps alone run (no Triton). With tensor parallelism every rank must call it
        (its steps run the same collectives on each)."""
        start = time.perf_counter()
        if processor is None:
            processor = model_processor(self.model_path, self.hf_config,
                                        self.config.model_config)
        sc = self.config.scheduler_config
        limits = Limits(
            max_num_seqs=sc.max_num_seqs, max_num_batched_tokens=sc.max_num_batched_tokens,
            max_model_len=self.max_model_len, max_encoder_rows=sc.max_num_encoder_tokens)
        self.runner.warmup(limits, processor, fused_ops=self.fused_ops,
                           vision_attention_fn=self.vision_attention_fn,
                           image_sizes=image_sizes)
        seconds = time.perf_counter() - start
        logger.info("warm-up: %.2f s", seconds)
        return seconds

    def shutdown(self) -> None:
        pass
