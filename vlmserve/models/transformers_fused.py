"""The engine's fused ops inside a transformers model (the transformers backend).

A model's RMSNorm modules whose ``forward`` is transformers' canonical one, the very code of
``LlamaRMSNorm.forward`` (statistics in float32, the cast back, then the weight: Qwen2/3,
Qwen3-VL, Mistral, Idefics3, GLM-4V, InternViT and the many others copied from it), run the
engine's ``rms_norm`` (`layers/fused.FusedOps`: one Triton kernel on CUDA where transformers
launches seven or eight; the same arithmetic on the CPU). A norm written otherwise (Gemma's
``1 + weight``, Qwen3.5's, Llama 4's) runs as transformers wrote it: the code, not the name,
decides.
"""

from __future__ import annotations

import functools

import torch
from torch import nn


def _code(fn) -> tuple | None:
    """What a function does: its bytecode, names and non-string constants (not its docstring,
    file or line)."""
    code = getattr(fn, "__code__", None)
    if code is None:
        return None
    return (code.co_code, code.co_names, code.co_varnames,
            tuple(c for c in code.co_consts if not isinstance(c, str)))


@functools.cache
def _canonical() -> tuple | None:
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    return _code(LlamaRMSNorm.forward)


def _rms_norm(module: nn.Module, ops, hidden_states: torch.Tensor) -> torch.Tensor:
    if hidden_states.dtype != module.weight.dtype:  # transformers' result would be promoted
        return type(module).forward(module, hidden_states)
    return ops.rms_norm(hidden_states, module.weight, module.variance_epsilon)


def fuse_rms_norms(model: nn.Module, ops) -> int:
    """Route ``model``'s canonical RMSNorms through ``ops.rms_norm``; returns how many."""
    count = 0
    for module in model.modules():
        if _code(type(module).forward) == _canonical():
            module.forward = functools.partial(_rms_norm, module, ops)
            count += 1
    return count
