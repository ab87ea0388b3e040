"""`resolve_config`: every derived default for each role and device, pinned as a table (the
values the engine, its executor, the scheduler and the encoder used before they were settled in
one place). Pure Python: no model, no device."""

from __future__ import annotations

import pytest

from vlmserve.config import (
    EngineConfig,
    SchedulerConfig,
    auto_kernels,
    resolve_config,
    sized_scheduler_limits,
)

GIB = 2**30
# the devices: (type, total memory, Triton runs, weights dtype, bytes of an image row)
CPU = ("cpu", None, False, "float32", 6144)
H200 = ("cuda", 140 * GIB, True, "bfloat16", 3072)
H100 = ("cuda", 80 * GIB, True, "bfloat16", 3072)
L4 = ("cuda", 24 * GIB, True, "bfloat16", 3072)
CPU_BF16 = ("cpu", None, False, "bfloat16", 3072)
GPU_UNKNOWN = ("cuda", None, True, "bfloat16", 3072)  # memory not known: the smaller row
GPU_FP32_NO_TRITON = ("cuda", 80 * GIB, False, "float32", 6144)
MAX_IMAGE_TOKENS = 4096  # the model's largest image: more than the CPU's step budget

# the default encoder cache: 4 GiB of rows
CPU_ROWS, GPU_ROWS = 4 * GIB // 6144, 4 * GIB // 3072

# (max_num_seqs, max_num_batched_tokens, max_num_encoder_tokens,
#  max_num_encoder_tokens_while_decoding, mm_embedding_offload, kernel_warmup,
#  attention_backend, fused_ops, vision_attention_backend,
#  limits_sized, encoder_cache_rows, cuda_graphs)
CASES = [
    # options as the user left them
    ("offline", CPU, {},
     (64, 2048, 4096, None, False, False, "torch", "eager", "torch", True, CPU_ROWS, False)),
    ("serving", CPU, {},
     (64, 2048, 4096, 1024, False, False, "torch", "eager", "torch", True, CPU_ROWS, False)),
    ("encoder", CPU, {},
     (64, 2048, 2048, None, None, None, "torch", "eager", "torch", True, None, False)),
    ("offline", H200, {},
     (512, 16384, 16384, None, True, True, "triton", "triton", "torch", True, GPU_ROWS, True)),
    ("serving", H200, {},
     (512, 8192, 8192, 4096, True, True, "triton", "triton", "torch", True, GPU_ROWS, True)),
    ("encoder", H200, {},
     (512, 16384, 16384, None, None, None, "triton", "triton", "torch", True, None, False)),
    ("offline", H100, {},
     (512, 16384, 16384, None, True, True, "triton", "triton", "torch", True, GPU_ROWS, True)),
    ("serving", H100, {},
     (512, 8192, 8192, 4096, True, True, "triton", "triton", "torch", True, GPU_ROWS, True)),
    ("offline", L4, {},
     (256, 8192, 8192, None, True, True, "triton", "triton", "torch", True, GPU_ROWS, True)),
    ("serving", L4, {},
     (256, 4096, 4096, 2048, True, True, "triton", "triton", "torch", True, GPU_ROWS, True)),
    ("encoder", L4, {},
     (256, 8192, 8192, None, None, None, "triton", "triton", "torch", True, None, False)),
    ("serving", GPU_UNKNOWN, {},
     (256, 4096, 4096, 2048, True, True, "triton", "triton", "torch", True, GPU_ROWS, True)),
    ("offline", GPU_FP32_NO_TRITON, {},
     (512, 16384, 16384, None, True, True, "torch", "eager", "torch", True, CPU_ROWS, False)),
    # options the user set
    ("offline", CPU, {"max_num_seqs": 3},
     (3, 2048, 4096, None, False, False, "torch", "eager", "torch", True, CPU_ROWS, False)),
    ("serving", H200, {"max_num_seqs": 8, "max_num_batched_tokens": 64},
     (8, 64, 4096, 32, True, True, "triton", "triton", "torch", False, GPU_ROWS, True)),
    ("serving", H200, {"max_num_batched_tokens": 1, "max_num_encoder_tokens": 100},
     (512, 1, 100, 1, True, True, "triton", "triton", "torch", True, GPU_ROWS, True)),
    ("encoder", H200, {"max_num_encoder_tokens": 100, "max_num_batched_tokens": 512},
     (512, 512, 100, None, None, None, "triton", "triton", "torch", True, None, False)),
    ("encoder", CPU, {"max_num_batched_tokens": 512},
     (64, 512, 512, None, None, None, "torch", "eager", "torch", True, None, False)),
    ("serving", L4, {"max_num_encoder_tokens_while_decoding": 8, "mm_cache_gb": 1.0},
     (256, 4096, 4096, 8, True, True, "triton", "triton", "torch", True, GPU_ROWS // 4, True)),
    ("offline", H100, {"enable_chunked_prefill": False, "kernel_warmup": False,
                       "enforce_eager": True},
     (512, 16384, 16384, None, False, False, "triton", "triton", "torch", True, GPU_ROWS,
      False)),
    ("offline", H100, {"mm_embedding_offload": False, "attention_backend": "torch",
                       "fused_ops": "compile", "vision_attention_backend": "triton"},
     (512, 16384, 16384, None, False, True, "torch", "compile", "triton", True, GPU_ROWS,
      False)),
    ("encoder", H100, {"vision_attention_backend": "auto"},
     (512, 16384, 16384, None, None, None, "triton", "triton", "flash", True, None, False)),
    ("offline", GPU_FP32_NO_TRITON, {"vision_attention_backend": "auto"},
     (512, 16384, 16384, None, True, True, "torch", "eager", "torch", True, CPU_ROWS, False)),
    ("encoder", CPU_BF16, {"vision_attention_backend": "auto"},
     (64, 2048, 2048, None, None, None, "torch", "eager", "torch", True, None, False)),
    ("offline", CPU, {"mm_embedding_offload": True, "kernel_warmup": True},
     (64, 2048, 4096, None, True, True, "torch", "eager", "torch", True, CPU_ROWS, False)),
]


def _resolve(role: str, device: tuple, **options):
    kind, memory, triton, dtype, row_bytes = device
    config = EngineConfig.from_kwargs(model="m", **options)
    return resolve_config(config, role, kind, memory, triton=triton, dtype=dtype,
                          max_image_tokens=MAX_IMAGE_TOKENS, embedding_row_bytes=row_bytes)


@pytest.mark.parametrize("role, device, options, want", CASES)
def test_every_derived_value_for_each_role_and_device(role, device, options, want) -> None:
    config = _resolve(role, device, **options)
    sc, mc, r = config.scheduler_config, config.model_config, config.resolved
    got = (sc.max_num_seqs, sc.max_num_batched_tokens, sc.max_num_encoder_tokens,
           sc.max_num_encoder_tokens_while_decoding, config.cache_config.mm_embedding_offload,
           mc.kernel_warmup, mc.attention_backend, mc.fused_ops, mc.vision_attention_backend,
           r.limits_sized, r.encoder_cache_rows, r.cuda_graphs)
    assert got == want
    assert (r.role, r.device_type) == (role, device[0])


def test_the_sizing_table_and_the_help_that_shows_it() -> None:
    h200, l4 = 140 * GIB, 24 * GIB
    assert sized_scheduler_limits("cuda", h200, serving=False) == (512, 16384)
    assert sized_scheduler_limits("cuda", h200, serving=True) == (512, 8192)
    assert sized_scheduler_limits("cuda", 70 * GIB, serving=False) == (512, 16384)
    assert sized_scheduler_limits("cuda", 70 * GIB - 1, serving=False) == (256, 8192)
    assert sized_scheduler_limits("cuda", l4, serving=True) == (256, 4096)
    assert sized_scheduler_limits("cuda", None, serving=False) == (256, 8192)
    assert sized_scheduler_limits("cpu", None, serving=True) == (64, 2048)
    # the options' help is written from the same table
    fields = SchedulerConfig.__dataclass_fields__
    assert ("512 on a GPU of 70 GiB or more, 256 on a smaller GPU, 64 on the CPU"
            in fields["max_num_seqs"].metadata["help"])
    assert ("16,384 offline and 8,192 serving on a GPU of 70 GiB or more, 8,192 and 4,096 on a "
            "smaller GPU, 2,048 on the CPU" in fields["max_num_batched_tokens"].metadata["help"])


def test_tensor_parallel_is_on_with_more_than_one_rank() -> None:
    assert not EngineConfig.from_kwargs().tensor_parallel
    assert EngineConfig.from_kwargs(tensor_parallel_size=2).tensor_parallel
    resolved = _resolve("serving", H100, tensor_parallel_size=2)
    assert resolved.tensor_parallel and resolved.parallel_config.tensor_parallel_size == 2


def test_auto_kernels_is_what_the_layers_take_for_auto() -> None:
    import importlib.util

    fla = "fla" if importlib.util.find_spec("fla") is not None else "torch"
    assert auto_kernels("cuda", True, "float16") == {
        "attention_backend": "triton", "fused_ops": "triton", "vision_attention_backend": "flash",
        "linear_attention_backend": fla}
    assert auto_kernels("cuda", False, None) == {
        "attention_backend": "torch", "fused_ops": "eager", "vision_attention_backend": "torch",
        "linear_attention_backend": "torch"}


def test_a_config_is_resolved_once_for_a_known_role_with_the_model_it_needs() -> None:
    config = _resolve("offline", CPU)
    with pytest.raises(ValueError, match="resolved already"):
        resolve_config(config, "offline", "cpu", max_image_tokens=1, embedding_row_bytes=1)
    with pytest.raises(ValueError, match="role must be one of"):
        resolve_config(EngineConfig(), "rank", "cpu")
    with pytest.raises(ValueError, match="max_image_tokens"):
        resolve_config(EngineConfig(), "serving", "cpu")
    assert resolve_config(EngineConfig(), "encoder", "cpu").resolved.role == "encoder"


def test_the_encoder_budget_holds_the_largest_video_item_within_the_context() -> None:
    """vLLM's sizing: a video encoder item (a whole Qwen2-VL video) counts as an image does,
    at most the context length (no longer item can be served); a budget the user set stays,
    as does the encoder cache's byte budget (admission names either when an item exceeds
    it); the default cache holds far more than the largest item."""
    def resolve(video: int, context: int | None, **options):
        config = EngineConfig.from_kwargs(model="m", **options)
        r = resolve_config(config, "serving", "cpu", max_image_tokens=256,
                           embedding_row_bytes=256, max_video_item_tokens=video,
                           max_model_len=context)
        return r.scheduler_config.max_num_encoder_tokens, r.resolved.encoder_cache_rows

    rows = 4 * GIB // 256
    assert resolve(98304, 32768) == (32768, rows)
    assert resolve(98304, None) == (98304, rows)
    assert resolve(4096, 32768, max_num_batched_tokens=256) == (4096, rows)
    assert resolve(0, 32768) == (2048, rows)  # no videos: the step budget
    assert resolve(4096, 1024) == (2048, rows)  # the step budget already holds 1,024
    assert resolve(4096, 8192, max_num_encoder_tokens=1024) == (1024, rows)
    assert resolve(4096, 8192, mm_cache_gb=0.0001) == (4096, int(0.0001 * GIB) // 256)
