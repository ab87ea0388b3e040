"""The tensor-parallel layout of a Qwen2 / Llama / Mistral language model (the model code knows
nothing of TP): `ShardPlan` says which slice of each checkpoint tensor a rank reads, and
`shard_model` puts modules of that size in the model before any weight is allocated (see
models/loader.py). Attention heads and MLP columns are split (column-parallel q/k/v and
gate/up; with fewer KV heads than ranks, each rank holds the KV head its query heads use),
o_proj and down_proj are row-parallel with an all-reduce, a sparse layer's experts each keep
their share of the intermediate columns, or with `expert_parallel` each rank a share of the
experts whole (the router replicated, the weighted sum all-reduced),
and the token embedding and lm_head are split by vocabulary rows (logits all-gathered).

The image encoder (vision tower and projector / merger) is replicated unless
`mm_encoder_tp_mode="weights"`: then `VisionShardPlan` and `shard_vision_encoder` split it
the same way, by the names of its layers (`_VISION_LAYERS`: Qwen2-VL / Qwen2.5-VL / Qwen3-VL
towers and mergers, the CLIP tower, LLaVA's projector): attention heads (a fused qkv split by
heads in each of its thirds), the first MLP layer column-parallel, the output projection and
second MLP layer row-parallel, all-reduced on the language model's group."""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from vlmserve.distributed.parallel_state import TensorParallel
from vlmserve.layers.fp8 import HoldsFp8
from vlmserve.layers.fused import EAGER_OPS
from vlmserve.layers.linear import MergedLinear
from vlmserve.layers.moe import ExpertWeights, SparseMoE, num_experts


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
_LAYER = re.compile(r"(?:^|\.)layers\.\d+\.(self_attn|mlp)\.(q|k|v|o|gate|up|down)_proj\."
                    r"(weight|bias)$")
_VOCAB = re.compile(r"(?:^|\.)(embed_tokens|lm_head)\.weight$")


@dataclass(frozen=True)
class TensorSlice:
    """Rows (`dim` 0) or columns (`dim` 1) [start, stop) of a checkpoint tensor, zero-padded
    to `size` along dim 0 when the last vocabulary shard is short. With `blocks` > 1, dim 0
    is that many equal parts (a fused q/k/v) and the rows [start, stop) of each are read,
    concatenated."""

    dim: int
    start: int
    stop: int
    size: int
    blocks: int = 1


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

    @classmethod
    def for_config(cls, text_config, rank: int, world: int, expert_parallel: bool = False
                   ) -> ShardPlan:
        check_divisible(text_config, world, expert_parallel)
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
                   rows, min(rank * rows, vocab), expert_parallel)

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


def check_divisible(text_config, world_size: int, expert_parallel: bool = False) -> None:
    """Raise a clear error before any process starts if the model cannot be split."""
    names = ["num_attention_heads", "intermediate_size"]
    if num_experts(text_config):
        names.append("num_experts" if expert_parallel else "moe_intermediate_size")
    for name in names:
        value = getattr(text_config, name)
        if value % world_size:
            raise ValueError(f"tensor_parallel_size={world_size} must divide {name} ({value})")
    kv = text_config.num_key_value_heads
    if kv % world_size and world_size % kv:
        raise ValueError(f"tensor_parallel_size={world_size} must divide, or be a multiple of, "
                         f"num_key_value_heads ({kv})")


def check_vision_divisible(vision_config, world_size: int) -> None:
    """`mm_encoder_tp_mode="weights"`: the same check for the vision tower's heads, before
    any process starts (`VisionShardPlan.for_model` checks every split layer as it loads)."""
    heads = getattr(vision_config, "num_heads", None) or vision_config.num_attention_heads
    if heads % world_size:
        raise ValueError(f"tensor_parallel_size={world_size} must divide the vision tower's "
                         f"attention heads ({heads}) with {_WEIGHTS_MODE}; use "
                         f"mm_encoder_tp_mode='data'")


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
        if isinstance(mlp, SparseMoE):  # a share of every expert, or of the experts; sum reduced
            e, world, rank = mlp.experts, plan.world, plan.rank
            if plan.expert_parallel:
                local = mlp.num_experts // world
                mlp.experts = ExpertWeights(e.hidden, e.inter, local, expert_start=rank * local,
                                            num_total=mlp.num_experts)
            else:
                share = e.inter // world
                mlp.experts = ExpertWeights(e.hidden, share, mlp.num_experts, rank * share,
                                            e.inter)
            mlp.tp = tp
            continue
        mlp.gate_up_proj = MergedLinear(plan.hidden, [plan.inter, plan.inter], bias=False)
        mlp.down_proj = RowParallelLinear(plan.inter, plan.hidden, False, tp)
    lm.embed_tokens = VocabParallelEmbedding(plan.vocab_rows, plan.hidden, plan.vocab_start,
                                             tp)
    weight = (lm.embed_tokens.weight if model.tie_word_embeddings
              else nn.Parameter(torch.empty(plan.vocab_rows, plan.hidden)))
    model.lm_head = ParallelLMHead(weight, plan.vocab_size, tp)


# the image encoders' split layers by name (a module's name in the model, or a checkpoint
# tensor's without `.weight` / `.bias`, ends with the match): Qwen2-VL / Qwen2.5-VL towers and
# patch merger, the CLIP tower, LLaVA's projector. `qkv`: fused q/k/v, each third split by
# heads; `column`: output features split; `row`: input features split, all-reduced.
_VISION_LAYERS = (
    (r"blocks\.\d+\.attn\.qkv", "qkv"),
    (r"blocks\.\d+\.attn\.proj", "row"),
    (r"blocks\.\d+\.mlp\.(?:fc1|gate_proj|up_proj|linear_fc1)", "column"),
    (r"blocks\.\d+\.mlp\.(?:fc2|down_proj|linear_fc2)", "row"),
    (r"merger\.mlp\.0", "column"),
    (r"merger\.mlp\.2", "row"),
    (r"(?:merger|deepstack_merger_list\.\d+)\.linear_fc1", "column"),  # Qwen3-VL's mergers
    (r"(?:merger|deepstack_merger_list\.\d+)\.linear_fc2", "row"),
    (r"encoder\.layers\.\d+\.self_attn\.[qkv]_proj", "column"),
    (r"encoder\.layers\.\d+\.self_attn\.out_proj", "row"),
    (r"encoder\.layers\.\d+\.mlp\.fc1", "column"),
    (r"encoder\.layers\.\d+\.mlp\.fc2", "row"),
    (r"multi_modal_projector\.linear_1", "column"),
    (r"multi_modal_projector\.linear_2", "row"),
)
_VISION_LAYER = [(re.compile(rf"(?:^|\.)({pattern})$"), kind) for pattern, kind in _VISION_LAYERS]
# attention modules of those towers (`num_heads` heads, split)
_VISION_ATTENTION = re.compile(r"(?:^|\.)(?:blocks\.\d+\.attn|encoder\.layers\.\d+\.self_attn)$")
_WEIGHTS_MODE = "mm_encoder_tp_mode='weights'"


def _vision_layer(name: str) -> tuple[str, str] | None:
    """(the layer's name as the table matches it, its kind) for a module or tensor name."""
    for pattern, kind in _VISION_LAYER:
        if m := pattern.search(name):
            return m.group(1), kind
    return None


@dataclass(frozen=True)
class VisionShardPlan:
    """What rank `rank` of `world` holds of a model's image encoder in weights mode: each
    split layer (by its name in `_VISION_LAYERS`) with its kind and whole size (in, out)."""

    rank: int
    world: int
    layers: dict[str, tuple[str, int, int]]

    @classmethod
    def for_model(cls, model: nn.Module, rank: int, world: int) -> VisionShardPlan:
        """From `model` as built (whole layers); a clear error if `world` does not divide its
        vision heads or a split layer's features."""
        layers: dict[str, tuple[str, int, int]] = {}
        for name, module in model.named_modules():
            if _VISION_ATTENTION.search(name) and module.num_heads % world:
                raise ValueError(f"tensor_parallel_size={world} must divide the vision "
                                 f"tower's attention heads ({module.num_heads}) with "
                                 f"{_WEIGHTS_MODE}; use mm_encoder_tp_mode='data'")
            if (hit := _vision_layer(name)) is not None:
                key, kind = hit
                layers[key] = (kind, module.in_features, module.out_features)
                split = module.in_features if kind == "row" else module.out_features
                parts = world * (3 if kind == "qkv" else 1)
                if split % parts:
                    raise ValueError(f"tensor_parallel_size={world} must divide the "
                                     f"features of the vision layer {key} ({split}) with "
                                     f"{_WEIGHTS_MODE}; use mm_encoder_tp_mode='data'")
        return cls(rank, world, layers)

    def slice_for(self, name: str) -> TensorSlice | None:
        """The part of checkpoint tensor `name` (an image-encoder name) this rank reads;
        None: all of it."""
        base, _, param = name.rpartition(".")
        hit = _vision_layer(base)
        if hit is None or hit[0] not in self.layers:
            return None
        kind, features_in, features_out = self.layers[hit[0]]
        if kind == "row":  # the bias is added whole, after the all-reduce
            if param == "bias":
                return None
            n = features_in // self.world
            return TensorSlice(1, self.rank * n, (self.rank + 1) * n, n)
        blocks = 3 if kind == "qkv" else 1
        n = features_out // blocks // self.world
        return TensorSlice(0, self.rank * n, (self.rank + 1) * n, n * blocks, blocks)


def shard_vision_encoder(model: nn.Module, plan: VisionShardPlan,
                         tp: TensorParallel) -> None:
    """Replace the image encoder's split layers of `model` (just built, weights not yet
    allocated) by layers of this rank's size, and give its attention modules their share of
    the heads; row-parallel layers all-reduce on `tp`, the language model's group."""
    for name, module in list(model.named_modules()):
        if _VISION_ATTENTION.search(name):
            module.num_heads //= plan.world
        hit = _vision_layer(name)
        if hit is None:
            continue
        kind, features_in, features_out = plan.layers[hit[0]]
        bias = module.bias is not None
        if kind == "row":
            layer = RowParallelLinear(features_in // plan.world, features_out, bias, tp)
        else:
            layer = nn.Linear(features_in, features_out // plan.world, bias=bias)
        parent, _, attr = name.rpartition(".")
        setattr(model.get_submodule(parent), attr, layer)
