"""The tensor-parallel layout of a Qwen2 / Llama / Mistral language model (the model code knows
nothing of TP): `ShardPlan` says which slice of each checkpoint tensor a rank reads, and
`shard_model` puts modules of that size in the model before any weight is allocated (see
models/loader.py). Attention heads and MLP columns are split (column-parallel q/k/v and
gate/up; with fewer KV heads than ranks, each rank holds the KV head its query heads use),
o_proj and down_proj are row-parallel with an all-reduce, and the token embedding and lm_head
are split by vocabulary rows (logits all-gathered). The vision tower stays replicated."""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from vlmserve.distributed.parallel_state import TensorParallel
from vlmserve.layers.fused import EAGER_OPS
from vlmserve.layers.linear import MergedLinear


class RowParallelLinear(nn.Module):
    """`y = all_reduce(x_shard @ W_shard.T) + b`: this rank's slice of the input features;
    the bias (whole, e.g. a Llama o_proj with `attention_bias`) added once, after the sum."""

    def __init__(self, in_features: int, out_features: int, bias: bool,
                 tp: TensorParallel) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_features))  # [out, in / N]
        self.bias = nn.Parameter(torch.empty(out_features)) if bias else None
        self.tp = tp
        self.ops = EAGER_OPS

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.tp.all_reduce(self.ops.linear(x, self.weight))
        return y if self.bias is None else y + self.bias


class VocabParallelEmbedding(nn.Module):
    """This rank's rows [start, start + rows) of the embedding table; ids elsewhere give zeros
    here and their row on the rank that has it, summed by an all-reduce (exact: one row plus
    zeros)."""

    def __init__(self, rows: int, hidden: int, start: int, tp: TensorParallel) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(rows, hidden))  # [rows, hidden]
        self.start, self.tp = start, tp

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        local = ids - self.start
        outside = (local < 0) | (local >= self.weight.shape[0])
        x = F.embedding(local.masked_fill(outside, 0), self.weight)  # [T, hidden]
        return self.tp.all_reduce(x.masked_fill_(outside.unsqueeze(-1), 0))


class ParallelLMHead(nn.Module):
    """Logits of this rank's vocabulary rows, all-gathered into every rank's `[N, vocab]`
    (rows past the vocabulary, padding of the last rank, dropped)."""

    def __init__(self, weight: nn.Parameter, vocab_size: int, tp: TensorParallel) -> None:
        super().__init__()
        self.weight = weight  # [rows, hidden]; the embedding's own when tied
        self.vocab_size, self.tp = vocab_size, tp

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        local = F.linear(x, self.weight).contiguous()  # [N, rows]
        parts = [torch.empty_like(local) for _ in range(self.tp.world_size)]
        self.tp.all_gather(parts, local)
        return torch.cat(parts, dim=-1)[..., :self.vocab_size]  # [N, vocab]


# checkpoint names of the language model's split tensors (hub and transformers 5.x layouts)
_LAYER = re.compile(r"(?:^|\.)layers\.\d+\.(self_attn|mlp)\.(q|k|v|o|gate|up|down)_proj\."
                    r"(weight|bias)$")
_VOCAB = re.compile(r"(?:^|\.)(embed_tokens|lm_head)\.weight$")


@dataclass(frozen=True)
class TensorSlice:
    """Rows (`dim` 0) or columns (`dim` 1) [start, stop) of a checkpoint tensor, zero-padded
    to `size` along dim 0 when the last vocabulary shard is short."""

    dim: int
    start: int
    stop: int
    size: int


@dataclass(frozen=True)
class ShardPlan:
    """What rank `rank` of `world` holds of a decoder with this text config."""

    rank: int
    world: int
    hidden: int
    head_dim: int
    heads: int  # query heads here, from head `q_start`
    q_start: int
    kv_heads: int  # KV heads here, from head `kv_start`
    kv_start: int
    inter: int  # MLP columns here, from `inter_start`
    inter_start: int
    vocab_size: int
    vocab_rows: int  # embedding / lm_head rows here (the last rank's padded), from `vocab_start`
    vocab_start: int

    @classmethod
    def for_config(cls, text_config, rank: int, world: int) -> ShardPlan:
        check_divisible(text_config, world)
        heads, kv = text_config.num_attention_heads, text_config.num_key_value_heads
        head_dim = (getattr(text_config, "head_dim", None)
                    or text_config.hidden_size // heads)
        if kv >= world:
            kv_here, kv_start = kv // world, rank * (kv // world)
        else:  # fewer KV heads than ranks: each is replicated on world / kv ranks
            kv_here, kv_start = 1, rank // (world // kv)
        inter = text_config.intermediate_size // world
        vocab = text_config.vocab_size
        rows = -(-vocab // world)
        return cls(rank, world, text_config.hidden_size, head_dim, heads // world,
                   rank * (heads // world), kv_here, kv_start, inter, rank * inter, vocab,
                   rows, min(rank * rows, vocab))

    def slice_for(self, name: str) -> TensorSlice | None:
        """The part of checkpoint tensor `name` (a language-model name) this rank reads;
        None: all of it."""
        if m := _LAYER.search(name):
            _, proj, kind = m.groups()
            d = self.head_dim
            if proj == "q":
                return TensorSlice(0, self.q_start * d, (self.q_start + self.heads) * d,
                                   self.heads * d)
            if proj in ("k", "v"):
                return TensorSlice(0, self.kv_start * d, (self.kv_start + self.kv_heads) * d,
                                   self.kv_heads * d)
            if proj in ("gate", "up"):
                return TensorSlice(0, self.inter_start, self.inter_start + self.inter,
                                   self.inter)
            if kind == "bias":  # o_proj's: added whole, after the all-reduce
                return None
            if proj == "o":
                return TensorSlice(1, self.q_start * d, (self.q_start + self.heads) * d,
                                   self.heads * d)
            return TensorSlice(1, self.inter_start, self.inter_start + self.inter, self.inter)
        if _VOCAB.search(name):
            stop = min(self.vocab_start + self.vocab_rows, self.vocab_size)
            return TensorSlice(0, self.vocab_start, stop, self.vocab_rows)
        return None


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


def shard_model(model: nn.Module, plan: ShardPlan, tp: TensorParallel) -> None:
    """Replace the language model's projections, embedding and lm_head of `model` (a
    `DecoderVLM`, just built, weights not yet allocated) by modules of this rank's size; new
    parameters are created as the surrounding build creates them (on the meta device in
    `build_model`)."""
    lm = model.language_model
    for layer in lm.layers:
        attn, mlp = layer.self_attn, layer.mlp
        d = attn.head_dim
        attn.qkv_proj = MergedLinear(plan.hidden, [plan.heads * d, plan.kv_heads * d,
                                                   plan.kv_heads * d],
                                     bias=attn.qkv_proj.bias is not None)
        attn.o_proj = RowParallelLinear(plan.heads * d, plan.hidden,
                                        attn.o_proj.bias is not None, tp)
        attn.heads, attn.kv_heads = plan.heads, plan.kv_heads
        mlp.gate_up_proj = MergedLinear(plan.hidden, [plan.inter, plan.inter], bias=False)
        mlp.down_proj = RowParallelLinear(plan.inter, plan.hidden, False, tp)
    lm.embed_tokens = VocabParallelEmbedding(plan.vocab_rows, plan.hidden, plan.vocab_start,
                                             tp)
    weight = (lm.embed_tokens.weight if model.tie_word_embeddings
              else nn.Parameter(torch.empty(plan.vocab_rows, plan.hidden)))
    model.lm_head = ParallelLMHead(weight, plan.vocab_size, tp)
