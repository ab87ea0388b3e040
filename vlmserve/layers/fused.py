"""The elementwise pieces of the decoder and the vision towers as pure functions, eager or
fused into single kernels.

A decode step of a small model is dominated by launches of tiny elementwise kernels (norm,
rotary, SiLU-and-mul), about 40 per layer in eager PyTorch. `FusedOps("triton")` swaps in
one hand-written Triton kernel per piece (`layers/triton_ops.py`, the default on CUDA);
`FusedOps("compile")` wraps these same functions in `torch.compile` instead. The CUDA graphs
of decode capture either. The eager versions compute exactly what transformers computes
(float32 norm, cast, then weight). `linear` is here too: on CUDA a one-token projection runs
a Triton GEMV, which streams the weight faster than the library GEMM at that shape; and
`rms_norm_linear`, the decoder's norm -> projection (-> SiLU-and-mul), which for one token
and a narrow input is that GEMV with the norm and SiLU folded in, and `rms_norm_qkv_rope`,
the same for the QKV projection with rotary and the paged-KV write folded in too (four
launches fewer per layer).
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from vlmserve.config import auto_kernels
from vlmserve.layers.attention import triton_available, write_kv
from vlmserve.layers.fp8 import linear as fp8_linear


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(x + residual), x + residual): the residual stream and the next input."""
    s = x + residual
    return rms_norm(s, weight, eps), s


def layer_norm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float
               ) -> torch.Tensor:
    return F.layer_norm(x, weight.shape, weight, bias, eps)


def add_layer_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                   bias: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(layer_norm(x + residual), x + residual)."""
    s = x + residual
    return layer_norm(s, weight, bias, eps), s


def gated_rms_norm(x: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, eps: float
                   ) -> torch.Tensor:
    """``rms_norm(x) * weight * silu(z)`` per head (a linear-attention layer's output norm):
    ``x [T, H, D]`` (rounded to z's dtype first), ``z [T, H * D]``, ``weight [D]`` ->
    ``[T, H * D]`` in z's dtype, float32 inside as transformers computes it."""
    T, dim = x.shape[0], weight.shape[0]
    xf = x.to(z.dtype).reshape(-1, dim).float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    y = weight * xf.to(z.dtype)
    return (y * F.silu(z.reshape(-1, dim).float())).to(z.dtype).reshape(T, -1)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


def rotary_qk(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """q: [T, H, D], k: [T, Hkv, D], cos/sin: [T, D] -> rotated q, k."""
    cos, sin = cos[:, None, :], sin[:, None, :]
    return _rotate(q, cos, sin), _rotate(k, cos, sin)


def compose_rms_norm_linear(ops, x: torch.Tensor, residual: torch.Tensor | None,
                            norm_weight: torch.Tensor, eps: float, weight: torch.Tensor,
                            bias: torch.Tensor | None = None, gated_silu: bool = False
                            ) -> tuple[torch.Tensor, torch.Tensor]:
    """`rms_norm_linear` from the separate ops of `ops` (a `FusedOps` or a module of them)."""
    if residual is None:
        h, s = ops.rms_norm(x, norm_weight, eps), x
    else:
        h, s = ops.add_rms_norm(x, residual, norm_weight, eps)
    y = ops.linear(h, weight, bias)
    return (ops.silu_mul(y) if gated_silu else y), s


def compose_rms_norm_qkv_rope(ops, x: torch.Tensor, residual: torch.Tensor | None,
                              norm_weight: torch.Tensor, eps: float, weight: torch.Tensor,
                              bias: torch.Tensor | None, heads: int, kv_heads: int,
                              cos: torch.Tensor, sin: torch.Tensor, kv_cache: torch.Tensor,
                              slots: torch.Tensor, kv_scales: torch.Tensor | None = None
                              ) -> tuple[torch.Tensor, torch.Tensor]:
    """`rms_norm_qkv_rope` from `ops.rms_norm_linear` and `ops.rotary_qk_cache`."""
    T = x.shape[0]
    qkv, s = ops.rms_norm_linear(x, residual, norm_weight, eps, weight, bias)
    d = weight.shape[0] // (heads + 2 * kv_heads)
    q, k, v = qkv.split([heads * d, kv_heads * d, kv_heads * d], dim=-1)
    q = ops.rotary_qk_cache(q.view(T, heads, d), k.view(T, kv_heads, d),
                            v.view(T, kv_heads, d), cos, sin, kv_cache, slots, kv_scales)
    return q, s


FUSED_OPS_KINDS = ("auto", "eager", "triton", "compile")


def rotary_qk_float32(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotary computed in float32 and cast back once (the vision towers' convention)."""
    def rot(x):
        xf = x.float()
        x1, x2 = xf.chunk(2, dim=-1)
        return (xf * cos[:, None] + torch.cat([-x2, x1], dim=-1) * sin[:, None]).to(x.dtype)

    return rot(q), rot(k)


def quick_gelu(x: torch.Tensor) -> torch.Tensor:
    """``x * sigmoid(1.702 x)`` (CLIP's approximation of GELU)."""
    return x * torch.sigmoid(1.702 * x)


def rotary_qk_cache(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor,
                    sin: torch.Tensor, kv_cache: torch.Tensor, slots: torch.Tensor,
                    kv_scales: torch.Tensor | None = None) -> torch.Tensor:
    """Rotate q and k, write k and v to the paged cache at `slots` (`write_kv`: an FP8
    cache's quantized by `kv_scales`); returns the rotated q."""
    q, k = rotary_qk(q, k, cos, sin)
    write_kv(kv_cache, k, v, slots, kv_scales)
    return q


class FusedOps:
    """The set of elementwise ops a model uses: `eager`, `triton` (CUDA), or `compile`."""

    def __init__(self, kind: str = "eager") -> None:
        if kind not in FUSED_OPS_KINDS[1:]:
            raise ValueError(
                f"unknown fused ops {kind!r}; choose from {', '.join(FUSED_OPS_KINDS)}")
        self.kind = kind
        if kind == "triton":
            from vlmserve.layers import triton_ops as impl
        else:
            impl = None
        fns = {"rms_norm": rms_norm, "add_rms_norm": add_rms_norm, "layer_norm": layer_norm,
               "add_layer_norm": add_layer_norm, "silu_mul": silu_mul,
               "gated_rms_norm": gated_rms_norm,
               "rotary_qk_cache": rotary_qk_cache,
               "rotary_qk_float32": rotary_qk_float32, "quick_gelu": quick_gelu,
               "linear": fp8_linear}  # F.linear, an FP8 weight read back first
        for name, fn in fns.items():
            if impl is not None:
                fn = getattr(impl, name)
            elif kind == "compile" and name != "linear":
                fn = torch.compile(fn, dynamic=True, fullgraph=True)
            setattr(self, name, fn)
        if kind == "compile":  # each engine (and its start-up warm-up) adds a few guards'
            # variants per op: several engines in one process outgrow dynamo's default of 8
            torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
        # the decoder's norm -> projection (-> SiLU-and-mul) pattern, with the residual add:
        # (linear(rms_norm(x + residual)), x + residual); one GEMV launch with the Triton ops
        # for a single token
        self.rms_norm_linear = (impl.rms_norm_linear if impl is not None
                                else functools.partial(compose_rms_norm_linear, self))
        # and the attention's front: norm -> QKV projection -> rotary on q and k, k and v to
        # the paged cache; returns (rotated q [T, heads, D], the residual sum)
        self.rms_norm_qkv_rope = (impl.rms_norm_qkv_rope if impl is not None
                                  else functools.partial(compose_rms_norm_qkv_rope, self))

    @classmethod
    def for_device(cls, kind: str, device: torch.device) -> FusedOps:
        """`auto` (`config.auto_kernels`): Triton kernels on CUDA when triton imports, eager
        elsewhere (an engine's config comes resolved)."""
        if kind == "auto":
            kind = auto_kernels(device.type, triton_available(device), None)["fused_ops"]
        if kind == "triton" and device.type != "cuda":
            raise ValueError("the triton fused ops need a CUDA device")
        return cls(kind)


EAGER_OPS = FusedOps("eager")
