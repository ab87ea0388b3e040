"""The decoder's elementwise pieces as pure functions, eager or compiled into fused kernels.

A decode step of a small model is dominated by launches of tiny elementwise kernels (norm,
rotary, SiLU-and-mul), about 40 per layer in eager PyTorch. `FusedOps(compile=True)` wraps
the same functions in `torch.compile` (dynamic shapes: compiled once, reused by every layer
and batch size) so each becomes one or two fused kernels; the CUDA graphs of decode capture
those. The eager versions compute exactly what transformers computes (float32 norm, cast,
then weight).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(x + residual), x + residual): the residual stream and the next input."""
    s = x + residual
    return rms_norm(s, weight, eps), s


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


class FusedOps:
    def __init__(self, compile: bool = False) -> None:
        self.compiled = compile

        def wrap(fn):
            return torch.compile(fn, dynamic=True, fullgraph=True) if compile else fn

        self.rms_norm = wrap(rms_norm)
        self.add_rms_norm = wrap(add_rms_norm)
        self.silu_mul = wrap(silu_mul)
        self.rotary_qk = wrap(rotary_qk)


EAGER_OPS = FusedOps(compile=False)
