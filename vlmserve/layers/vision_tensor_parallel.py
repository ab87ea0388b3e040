"""The image encoder (vision tower and projector / merger) under tensor parallelism with
`mm_encoder_tp_mode="weights"` (it is replicated otherwise): `VisionShardPlan` and
`shard_vision_encoder` split it as layers/tensor_parallel.py splits the language model, by the
names of its layers (`_VISION_LAYERS`: Qwen2-VL / Qwen2.5-VL / Qwen3-VL (and Qwen3.5's, the
same) towers and mergers, the CLIP tower, LLaVA's projector): attention heads (a fused qkv
split by heads in each of its thirds), the first MLP layer column-parallel, the output
projection and second MLP layer row-parallel, all-reduced on the language model's group."""

from __future__ import annotations

import re
from dataclasses import dataclass

from torch import nn

from vlmserve.distributed.parallel_state import TensorParallel
from vlmserve.layers.tensor_parallel import RowParallelLinear, TensorSlice

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


def check_vision_divisible(vision_config, world_size: int) -> None:
    """`mm_encoder_tp_mode="weights"`: the same check for the vision tower's heads, before
    any process starts (`VisionShardPlan.for_model` checks every split layer as it loads)."""
    heads = getattr(vision_config, "num_heads", None) or vision_config.num_attention_heads
    if heads % world_size:
        raise ValueError(f"tensor_parallel_size={world_size} must divide the vision tower's "
                         f"attention heads ({heads}) with {_WEIGHTS_MODE}; use "
                         f"mm_encoder_tp_mode='data'")


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
        if kind == "qkv":  # this rank's heads of each third
            third = features_out // 3
            n = third // self.world
            return TensorSlice.of_spans([(b * third + self.rank * n,
                                          b * third + (self.rank + 1) * n) for b in range(3)])
        n = features_out // self.world
        return TensorSlice(0, self.rank * n, (self.rank + 1) * n, n)


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
