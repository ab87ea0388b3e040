"""Shard a built, loaded Qwen2 language model across a tensor-parallel group (the model code
knows nothing of TP): attention heads and MLP columns are split, o_proj and down_proj become
row-parallel with an all-reduce. Embeddings, lm_head and the vision tower stay replicated, so
every rank computes the same logits and samples the same tokens."""

from __future__ import annotations

import torch
from torch import nn

from vlmserve.distributed.parallel_state import TensorParallel
from vlmserve.layers.fused import EAGER_OPS
from vlmserve.layers.linear import MergedLinear


class RowParallelLinear(nn.Module):
    """`y = all_reduce(x_shard @ W_shard.T) + b`: this rank's slice of the input features;
    the bias (whole, e.g. a Llama o_proj with `attention_bias`) added once, after the sum."""

    def __init__(self, weight: torch.Tensor, tp: TensorParallel,
                 bias: torch.Tensor | None = None) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)
        self.tp = tp
        self.ops = EAGER_OPS

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.tp.all_reduce(self.ops.linear(x, self.weight))
        return y if self.bias is None else y + self.bias


def _rows(t: torch.Tensor, start: int, size: int) -> torch.Tensor:
    return t[start:start + size].clone()


def _shard_merged(lin: MergedLinear, parts: list[tuple[int, int]]) -> MergedLinear:
    """Keep rows [start, start + size) of each projection stacked in `lin`."""
    offsets = [sum(lin.out_sizes[:i]) for i in range(len(lin.out_sizes))]
    sizes = [size for _, size in parts]
    out = MergedLinear(lin.in_features, sizes, bias=lin.bias is not None).to(
        lin.weight.device, lin.weight.dtype)
    with torch.no_grad():
        out.weight.copy_(torch.cat([_rows(lin.weight, off + s, n)
                                    for off, (s, n) in zip(offsets, parts)]))
        if lin.bias is not None:
            out.bias.copy_(torch.cat([_rows(lin.bias, off + s, n)
                                      for off, (s, n) in zip(offsets, parts)]))
    return out


def check_divisible(text_config, world_size: int) -> None:
    """Raise a clear error before any process starts if the model cannot be split."""
    for name in ("num_attention_heads", "intermediate_size"):
        value = getattr(text_config, name)
        if value % world_size:
            raise ValueError(f"tensor_parallel_size={world_size} must divide {name} ({value})")
    kv = text_config.num_key_value_heads
    if kv % world_size and world_size % kv:
        raise ValueError(f"tensor_parallel_size={world_size} must divide, or be a multiple of, "
                         f"num_key_value_heads ({kv})")


def shard_language_model(lm, tp: TensorParallel) -> None:
    """In place, on a `Qwen2Model` whose full weights are loaded (`check_divisible` first)."""
    r, w = tp.rank, tp.world_size
    for layer in lm.layers:
        attn = layer.self_attn
        h, d = attn.heads // w, attn.head_dim
        if attn.kv_heads >= w:
            kv, kv_start = attn.kv_heads // w, r * (attn.kv_heads // w)
        else:  # fewer KV heads than ranks: each is replicated on w / kv_heads ranks
            kv, kv_start = 1, r // (w // attn.kv_heads)
        attn.qkv_proj = _shard_merged(attn.qkv_proj, [(r * h * d, h * d),
                                                      (kv_start * d, kv * d),
                                                      (kv_start * d, kv * d)])
        bias = attn.o_proj.bias
        attn.o_proj = RowParallelLinear(attn.o_proj.weight[:, r * h * d:(r + 1) * h * d]
                                        .detach().clone(), tp,
                                        None if bias is None else bias.detach().clone())
        attn.heads, attn.kv_heads = h, kv
        mlp = layer.mlp
        inter = mlp.gate_up_proj.out_sizes[0]
        if inter % w:
            raise ValueError(f"tensor_parallel_size={w} must divide intermediate_size {inter}")
        n = inter // w
        mlp.gate_up_proj = _shard_merged(mlp.gate_up_proj, [(r * n, n), (r * n, n)])
        mlp.down_proj = RowParallelLinear(mlp.down_proj.weight[:, r * n:(r + 1) * n]
                                          .detach().clone(), tp)
