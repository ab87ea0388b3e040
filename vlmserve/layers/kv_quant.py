"""The FP8 KV cache (`kv_cache_dtype="fp8"`, vLLM's flag; also "fp8_e4m3").

Keys and values are stored as float8 e4m3 (torch's ``float8_e4m3fn``: largest finite value
448, no infinities), each layer with one scale for its keys and one for its values (per
tensor: vLLM's ``k_scale`` / ``v_scale``, from the checkpoint where it has them, else 1.0).
A layer's scales travel as one float32 tensor ``kv_scales = [k_scale, v_scale]`` on the
cache's device (CUDA graphs capture it; no value is read on the host). Writing divides by the
scale, clamps to ±448 and rounds to e4m3 (`quantize`); reading multiplies back
(`dequantize`). The Triton kernels do the same in registers: the fused rotary + KV write
kernels quantize, the paged attention kernel converts each tile to the query's dtype and
folds ``k_scale`` into the score scale and ``v_scale`` into the output.
"""

from __future__ import annotations

import torch

FP8_KV_DTYPE: torch.dtype | None = getattr(torch, "float8_e4m3fn", None)
FP8_MAX = 448.0  # e4m3's largest finite value


def kv_cache_dtype(name: str, dtype: torch.dtype) -> torch.dtype:
    """The KV tensors' dtype for `CacheConfig.kv_cache_dtype` `name` (auto: the model's
    `dtype`; fp8, fp8_e4m3: e4m3) with the model in `dtype`."""
    if name == "auto":
        return dtype
    if FP8_KV_DTYPE is None:
        raise ValueError(f"kv_cache_dtype={name!r} needs torch.float8_e4m3fn, which this "
                         f"torch ({torch.__version__}) lacks")
    return FP8_KV_DTYPE


def check_fp8_support(model_cls: type, device: torch.device, triton_kernels: bool) -> None:
    """Refuse, in one line, what cannot hold an FP8 cache: a model whose attention layers do
    not take its scales (`set_kv_cache_scales`), a GPU whose Triton kernels cannot convert
    e4m3 (compute capability below 8.9: before Ada and Hopper); the CPU's eager ops and
    reference attention always can."""
    if not hasattr(model_cls, "set_kv_cache_scales"):
        raise ValueError(f"kv_cache_dtype fp8: {model_cls.__name__}'s attention takes no "
                         "KV scales; use kv_cache_dtype=auto")
    if device.type == "cuda" and triton_kernels:
        major, minor = torch.cuda.get_device_capability(device)
        if (major, minor) < (8, 9):
            raise ValueError(
                f"kv_cache_dtype fp8 with the triton kernels needs a GPU of compute "
                f"capability 8.9 or newer (Ada, Hopper), not {major}.{minor}; use "
                "attention_backend=torch and fused_ops=eager, or kv_cache_dtype=auto")


def is_fp8(kv_cache: torch.Tensor) -> bool:
    return kv_cache.dtype == FP8_KV_DTYPE


def quantize(x: torch.Tensor, scale: torch.Tensor | float) -> torch.Tensor:
    """``x / scale`` clamped to e4m3's range, rounded to e4m3 (to nearest, ties to even)."""
    return (x.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_KV_DTYPE)


def dequantize(x: torch.Tensor, scale: torch.Tensor | float, dtype: torch.dtype
               ) -> torch.Tensor:
    """e4m3 values times ``scale``, in `dtype` (the product in float32)."""
    return (x.float() * scale).to(dtype)


def scales_tensor(k_scale: float, v_scale: float, device: torch.device) -> torch.Tensor:
    """A layer's ``kv_scales``: [2] float32 on `device`."""
    return torch.tensor([k_scale, v_scale], dtype=torch.float32, device=device)


_ONES: dict[torch.device, torch.Tensor] = {}


def unit_scales(device: torch.device) -> torch.Tensor:
    """Scales of 1.0 (an FP8 cache written without scales), one tensor per device."""
    if device not in _ONES:
        _ONES[device] = scales_tensor(1.0, 1.0, device)
    return _ONES[device]
