"""The tensor-parallel layout of a Qwen2 / Llama / Mistral / Gemma 3 / Qwen3.5 language model
(the model code knows nothing of TP): `ShardPlan` says which slice of each checkpoint tensor a
rank reads, and `shard_model` puts modules of that size in the model before any weight is
allocated (see models/loader.py). Attention heads and MLP columns are split (column-parallel
q/k/v and gate/up; with fewer KV heads than ranks, each rank holds the KV head its query heads
use; a gated q_proj, `TPLayout.gated_query`, by its per-head query and gate rows), o_proj and
down_proj are row-parallel with an all-reduce, a sparse layer's experts each keep their share
of the intermediate columns, or with `expert_parallel` each rank a share of the experts whole
(the router replicated, the weighted sum all-reduced; a shared expert's columns split, its
partial sum reduced with the experts' in the same all-reduce), Gated DeltaNet layers by key
and value heads (q | k | v rows of the fused projection and the convolution, z / b / a rows,
per-head decay parameters, out_proj row-parallel; each rank's state pools of its heads), and
the token embedding and lm_head are split by vocabulary rows (logits all-gathered).

The image encoder is replicated unless `mm_encoder_tp_mode="weights"`
(layers/vision_tensor_parallel.py)."""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from vlmserve.distributed.parallel_state import TensorParallel
from vlmserve.layers.fp8 import HoldsFp8
from vlmserve.layers.fused import EAGER_OPS
from vlmserve.layers.gated_deltanet import GatedDeltaNet
from vlmserve.layers.linear import Linear, MergedLinear
from vlmserve.layers.moe import ExpertWeights, SharedExpertMoE, SparseMoE, num_experts


class RowParallelLinear(HoldsFp8, nn.Module):
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
        y = self.tp.all_reduce(self.ops.linear(x, self.w))
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
_LAYER = re.compile(r"(?:^|\.)layers\.\d+\.(self_attn|mlp|mlp\.shared_expert)\."
                    r"(q|k|v|o|gate|up|down)_proj\.(weight|bias)$")
_LINEAR_ATTN = re.compile(r"(?:^|\.)layers\.\d+\.linear_attn\.(in_proj_qkv\.weight|conv1d\.weight"
                          r"|in_proj_z\.weight|in_proj_[ab]\.weight|dt_bias|A_log"
                          r"|out_proj\.weight)$")
_VOCAB = re.compile(r"(?:^|\.)(embed_tokens|lm_head)\.weight$")


@dataclass(frozen=True)
class TensorSlice:
    """Rows (`dim` 0) or columns (`dim` 1) [start, stop) of a checkpoint tensor, zero-padded
    to `size` along dim 0 when the last vocabulary shard is short. With `spans`, dim 0 is a
    fused tensor of parts (q | k | v) and the rows [a, b) of each span are read, concatenated
    (`start` / `stop`: the first span's start, the last one's stop)."""

    dim: int
    start: int
    stop: int
    size: int
    spans: tuple[tuple[int, int], ...] = ()

    @classmethod
    def of_spans(cls, spans: list[tuple[int, int]]) -> TensorSlice:
        """Rows of several parts of a fused tensor: `spans` [a, b) in its rows, in order."""
        return cls(0, spans[0][0], spans[-1][1], sum(b - a for a, b in spans), tuple(spans))


@dataclass(frozen=True)
class TPLayout:
    """What a model family's checkpoint names and config do not say about splitting it (a
    model class's `tp_layout`). `gated_query`: q_proj's rows are, per head, its query then
    its output gate (Qwen3.5), so a head split reads 2 * head_dim rows a head."""

    gated_query: bool = False


@dataclass(frozen=True)
class LinearHeads:
    """A rank's share of the Gated DeltaNet layers: key heads [k_start, k_start + k_heads) of
    `k_total` and value heads [v_start, v_start + v_heads). Value head i reads key head
    i // (value heads / key heads), so contiguous shares keep each with its key head."""

    k_heads: int
    k_start: int
    k_total: int
    k_dim: int
    v_heads: int
    v_start: int
    v_dim: int

    @classmethod
    def for_config(cls, text_config, rank: int, world: int) -> LinearHeads | None:
        k = getattr(text_config, "linear_num_key_heads", None)
        if not k:
            return None
        v = text_config.linear_num_value_heads
        return cls(k // world, rank * (k // world), k, text_config.linear_key_head_dim,
                   v // world, rank * (v // world), text_config.linear_value_head_dim)

    def slice_for(self, tensor: str) -> TensorSlice:
        """The rows (columns of out_proj) of a linear layer's tensor (its name in the layer)."""
        k0, k1 = self.k_start * self.k_dim, (self.k_start + self.k_heads) * self.k_dim
        v0, v1 = self.v_start * self.v_dim, (self.v_start + self.v_heads) * self.v_dim
        if tensor in ("in_proj_qkv.weight", "conv1d.weight"):  # rows q | k | v
            key = self.k_total * self.k_dim
            return TensorSlice.of_spans([(k0, k1), (key + k0, key + k1),
                                         (2 * key + v0, 2 * key + v1)])
        if tensor == "in_proj_z.weight":
            return TensorSlice(0, v0, v1, v1 - v0)
        if tensor == "out_proj.weight":
            return TensorSlice(1, v0, v1, v1 - v0)
        return TensorSlice(0, self.v_start, self.v_start + self.v_heads, self.v_heads)


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
    expert_parallel: bool = False  # sparse layers: whole experts here, not column shares
    layout: TPLayout = TPLayout()
    linear: LinearHeads | None = None  # Gated DeltaNet layers' heads here
    shared_inter: int = 0  # a shared expert's columns here, from `shared_inter_start`
    shared_inter_start: int = 0

    @classmethod
    def for_config(cls, text_config, rank: int, world: int, expert_parallel: bool = False,
                   layout: TPLayout = TPLayout()) -> ShardPlan:
        check_divisible(text_config, world, expert_parallel)
        heads, kv = text_config.num_attention_heads, text_config.num_key_value_heads
        head_dim = (getattr(text_config, "head_dim", None)
                    or text_config.hidden_size // heads)
        if kv >= world:
            kv_here, kv_start = kv // world, rank * (kv // world)
        else:  # fewer KV heads than ranks: each is replicated on world / kv ranks
            kv_here, kv_start = 1, rank // (world // kv)
        # Qwen3.5-MoE's config has no dense MLP size
        inter = (getattr(text_config, "intermediate_size", None) or 0) // world
        shared = (getattr(text_config, "shared_expert_intermediate_size", None) or 0) // world
        vocab = text_config.vocab_size
        rows = -(-vocab // world)
        return cls(rank, world, text_config.hidden_size, head_dim, heads // world,
                   rank * (heads // world), kv_here, kv_start, inter, rank * inter, vocab,
                   rows, min(rank * rows, vocab), expert_parallel, layout,
                   LinearHeads.for_config(text_config, rank, world), shared, rank * shared)

    def slice_for(self, name: str) -> TensorSlice | None:
        """The part of checkpoint tensor `name` (a language-model name) this rank reads;
        None: all of it."""
        if m := _LAYER.search(name):
            return self._layer_slice(*m.groups())
        if self.linear is not None and (m := _LINEAR_ATTN.search(name)):
            return self.linear.slice_for(m.group(1))
        if _VOCAB.search(name):
            stop = min(self.vocab_start + self.vocab_rows, self.vocab_size)
            return TensorSlice(0, self.vocab_start, stop, self.vocab_rows)
        return None

    def _layer_slice(self, module: str, proj: str, kind: str) -> TensorSlice | None:
        d = self.head_dim
        if proj == "q":
            q = 2 * d if self.layout.gated_query else d  # rows a head
            return TensorSlice(0, self.q_start * q, (self.q_start + self.heads) * q,
                               self.heads * q)
        if proj in ("k", "v"):
            return TensorSlice(0, self.kv_start * d, (self.kv_start + self.kv_heads) * d,
                               self.kv_heads * d)
        if kind == "bias" and proj in ("o", "down"):  # added whole, after the all-reduce
            return None
        if proj == "o":
            return TensorSlice(1, self.q_start * d, (self.q_start + self.heads) * d,
                               self.heads * d)
        start, n = ((self.shared_inter_start, self.shared_inter) if module.endswith("expert")
                    else (self.inter_start, self.inter))
        return TensorSlice(1 if proj == "down" else 0, start, start + n, n)


def check_divisible(text_config, world_size: int, expert_parallel: bool = False) -> None:
    """Raise a clear error before any process starts if the model cannot be split."""
    names = ["num_attention_heads", "intermediate_size", "shared_expert_intermediate_size",
             "linear_num_key_heads", "linear_num_value_heads"]
    if num_experts(text_config):
        names.append("num_experts" if expert_parallel else "moe_intermediate_size")
    for name in names:
        value = getattr(text_config, name, None)
        if value and value % world_size:
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
        if hasattr(layer, "self_attn"):
            _shard_attention(layer.self_attn, plan, tp)
        if hasattr(layer, "linear_attn"):
            layer.linear_attn = _sharded_linear_attention(layer.linear_attn, plan, tp)
        mlp = layer.mlp
        if isinstance(mlp, SharedExpertMoE):  # one all-reduce of the experts' and the shared sum
            _shard_experts(mlp.routed, plan)
            mlp.shared_expert.gate_up_proj = MergedLinear(
                plan.hidden, [plan.shared_inter, plan.shared_inter], bias=False)
            mlp.shared_expert.down_proj = Linear(plan.shared_inter, plan.hidden, bias=False)
            mlp.tp = tp
        elif isinstance(mlp, SparseMoE):  # a share of every expert, or of the experts
            _shard_experts(mlp, plan)
            mlp.tp = tp
        else:
            mlp.gate_up_proj = MergedLinear(plan.hidden, [plan.inter, plan.inter], bias=False)
            mlp.down_proj = RowParallelLinear(plan.inter, plan.hidden, False, tp)
    lm.embed_tokens = VocabParallelEmbedding(plan.vocab_rows, plan.hidden, plan.vocab_start,
                                             tp)
    weight = (lm.embed_tokens.weight if model.tie_word_embeddings
              else nn.Parameter(torch.empty(plan.vocab_rows, plan.hidden)))
    model.lm_head = ParallelLMHead(weight, plan.vocab_size, tp)


def _shard_attention(attn: nn.Module, plan: ShardPlan, tp: TensorParallel) -> None:
    d, q = attn.head_dim, 2 if plan.layout.gated_query else 1
    assert attn.qkv_proj.out_sizes[0] == q * plan.heads * plan.world * d, \
        "q_proj's rows do not match the model's TPLayout"
    attn.qkv_proj = MergedLinear(plan.hidden, [q * plan.heads * d, plan.kv_heads * d,
                                               plan.kv_heads * d],
                                 bias=attn.qkv_proj.bias is not None)
    attn.o_proj = RowParallelLinear(plan.heads * d, plan.hidden, attn.o_proj.bias is not None,
                                    tp)
    attn.heads, attn.kv_heads = plan.heads, plan.kv_heads


def _shard_experts(mlp: SparseMoE, plan: ShardPlan) -> None:
    """A sparse layer's experts: every expert's share of the columns, or (expert parallel) a
    share of the experts whole; the caller all-reduces the sum."""
    e, world, rank = mlp.experts, plan.world, plan.rank
    if plan.expert_parallel:
        local = mlp.num_experts // world
        mlp.experts = ExpertWeights(e.hidden, e.inter, local, expert_start=rank * local,
                                    num_total=mlp.num_experts)
    else:
        share = e.inter // world
        mlp.experts = ExpertWeights(e.hidden, share, mlp.num_experts, rank * share, e.inter)


def _sharded_linear_attention(layer: GatedDeltaNet, plan: ShardPlan,
                              tp: TensorParallel) -> GatedDeltaNet:
    """A Gated DeltaNet layer of this rank's key and value heads (its state pools follow
    from them: `state_shapes`), out_proj row-parallel."""
    heads = plan.linear
    assert (heads.k_heads * plan.world, heads.v_heads * plan.world) == (
        layer.k_heads, layer.v_heads)
    local = GatedDeltaNet(plan.hidden, heads.k_heads, heads.v_heads, layer.k_dim, layer.v_dim,
                          layer.kernel, layer.norm.eps)
    local.out_proj = RowParallelLinear(heads.v_heads * layer.v_dim, plan.hidden, False, tp)
    return local
