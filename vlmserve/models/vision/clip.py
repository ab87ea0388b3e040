"""CLIP ViT vision tower (LLaVA's): class token, learned position embeddings, pre-LayerNorm,
pre-norm blocks with biased attention and a QuickGELU (config `hidden_act`) MLP.

All images of a batch are one size (the config's ``image_size``), so attention runs as one
dense ``[B, heads, 1 + patches, head_dim]`` SDPA, no packing. Only the blocks up to the
deepest feature layer asked for are built; the others (and ``post_layernorm``, which only the
pooled output uses) are skipped at load.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from vlmserve.layers.fused import EAGER_OPS
from vlmserve.layers.norm import LayerNorm
from vlmserve.models.vision.common import get_activation


class CLIPAttention(nn.Module):
    def __init__(self, dim: int, num_heads: int) -> None:
        super().__init__()
        self.num_heads, self.head_dim = num_heads, dim // num_heads
        self.q_proj = nn.Linear(dim, dim)
        self.k_proj = nn.Linear(dim, dim)
        self.v_proj = nn.Linear(dim, dim)
        self.out_proj = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape  # [B, S, dim]

        def heads(t: torch.Tensor) -> torch.Tensor:
            return t.view(b, s, self.num_heads, self.head_dim).transpose(1, 2)  # [B, H, S, D]

        out = F.scaled_dot_product_attention(heads(self.q_proj(x)), heads(self.k_proj(x)),
                                             heads(self.v_proj(x)), scale=self.head_dim**-0.5)
        return self.out_proj(out.transpose(1, 2).reshape(b, s, -1))


class CLIPMLP(nn.Module):
    def __init__(self, dim: int, hidden: int, act: str) -> None:
        super().__init__()
        self.fc1 = nn.Linear(dim, hidden)
        self.fc2 = nn.Linear(hidden, dim)
        self.act_name, self.act = act, get_activation(act)
        self.ops = EAGER_OPS

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        act = self.ops.quick_gelu if self.act_name == "quick_gelu" else self.act
        return self.fc2(act(self.fc1(x)))


class CLIPEncoderLayer(nn.Module):
    """``x + attn(layer_norm1(x))``, then ``+ mlp(layer_norm2(.))``."""

    def __init__(self, cfg) -> None:
        super().__init__()
        dim = cfg.hidden_size
        self.layer_norm1 = LayerNorm(dim, eps=cfg.layer_norm_eps)
        self.self_attn = CLIPAttention(dim, cfg.num_attention_heads)
        self.layer_norm2 = LayerNorm(dim, eps=cfg.layer_norm_eps)
        self.mlp = CLIPMLP(dim, cfg.intermediate_size, cfg.hidden_act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h, x = self.layer_norm2(self.self_attn(self.layer_norm1(x)), x)  # the add folded in
        return x + self.mlp(h)


class CLIPEmbeddings(nn.Module):
    def __init__(self, cfg) -> None:
        super().__init__()
        dim, p = cfg.hidden_size, cfg.patch_size
        self.image_size, self.patch_size = cfg.image_size, p
        self.class_embedding = nn.Parameter(torch.empty(dim))
        self.patch_embedding = nn.Conv2d(cfg.num_channels, dim, kernel_size=p, stride=p,
                                         bias=False)
        self.position_embedding = nn.Embedding((cfg.image_size // p) ** 2 + 1, dim)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """``[B, C, H, W]`` -> ``[B, 1 + (H/p)*(W/p), dim]`` (class token first)."""
        b, _, h, w = pixel_values.shape
        if (h, w) != (self.image_size, self.image_size):
            raise ValueError(f"CLIP tower takes {self.image_size}x{self.image_size} images, "
                             f"got {w}x{h}")
        w_ = self.patch_embedding.weight
        patches = self.patch_embedding(pixel_values.to(w_.dtype)).flatten(2).transpose(1, 2)
        cls = self.class_embedding.expand(b, 1, -1)
        return torch.cat([cls, patches], dim=1) + self.position_embedding.weight


def feature_layers(vision_feature_layer: int | Sequence[int], num_layers: int) -> list[int]:
    """Indices into the tower's hidden states (0: the input of block 0 after
    ``pre_layrnorm``, i: the output of block i-1), negative ones counted from the end."""
    layers = ([vision_feature_layer] if isinstance(vision_feature_layer, int)
              else list(vision_feature_layer))
    out = [i if i >= 0 else num_layers + 1 + i for i in layers]
    if not all(0 <= i <= num_layers for i in out):
        raise ValueError(f"vision_feature_layer {vision_feature_layer} out of range for "
                         f"{num_layers} layers")
    return out


class FixedSizeTower(nn.Module):
    """A tower whose images are all one size (CLIP's, SigLIP's): a batch of them is one
    fixed-shape ``run``, eager or replayed from a CUDA graph of its batch-size bucket
    (`graphs`: a `worker/vision_graphs.BatchGraphs`)."""

    graphs = None

    @property
    def tokens_per_image(self) -> int:
        raise NotImplementedError

    def run(self, pixel_values: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        if self.graphs is not None:
            out = self.graphs.run(pixel_values)
            if out is not None:
                return out
        return self.run(pixel_values)


class CLIPVisionTower(FixedSizeTower):
    """Hidden states of the CLIP ViT at ``feature_layers`` (concatenated on the feature dim),
    the class token kept (``keep_cls``) or dropped. Parameter names are the checkpoint's,
    relative to ``vision_tower.`` (``embeddings.*``, ``pre_layrnorm.*``, ``encoder.layers.*``).
    """

    def __init__(self, cfg, vision_feature_layer: int | Sequence[int] = -1,
                 keep_cls: bool = False) -> None:
        super().__init__()
        self.layers_out = feature_layers(vision_feature_layer, cfg.num_hidden_layers)
        self.keep_cls = keep_cls
        self.patch_size, self.image_size = cfg.patch_size, cfg.image_size
        self.embeddings = CLIPEmbeddings(cfg)
        self.pre_layrnorm = LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)
        self.encoder = nn.Module()
        self.encoder.layers = nn.ModuleList(CLIPEncoderLayer(cfg)
                                            for _ in range(max(self.layers_out)))
        self.out_dim = cfg.hidden_size * len(self.layers_out)

    @property
    def tokens_per_image(self) -> int:
        return (self.image_size // self.patch_size) ** 2 + int(self.keep_cls)

    def run(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """``[B, C, H, W]`` -> ``[B, tokens_per_image, out_dim]``."""
        x = self.pre_layrnorm(self.embeddings(pixel_values))  # [B, S, dim]
        states = [x] if 0 in self.layers_out else []
        for i, layer in enumerate(self.encoder.layers, start=1):
            x = layer(x)
            if i in self.layers_out:
                states.append(x)
        feats = states[0] if len(states) == 1 else torch.cat(
            [states[sorted(self.layers_out).index(i)] for i in self.layers_out], dim=-1)
        return feats if self.keep_cls else feats[:, 1:]

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Names relative to the tower (a leading ``vision_model.`` is dropped); blocks past
        the deepest feature layer and ``post_layernorm`` are skipped."""
        def skip(name: str) -> bool:
            return name.startswith("post_layernorm.") or (
                name.startswith("encoder.layers.")
                and int(name.split(".")[2]) >= len(self.encoder.layers))

        return load_tower_weights(self, weights, skip)


@torch.no_grad()
def load_tower_weights(tower: nn.Module, weights: Iterable[tuple[str, torch.Tensor]],
                       skip) -> set[str]:
    """Checkpoint tensors into a ViT tower's parameters of the same names (a leading
    ``vision_model.`` dropped), but those `skip(name)` says the tower did not build."""
    params = dict(tower.named_parameters())
    loaded: set[str] = set()
    for name, tensor in weights:
        name = name.removeprefix("vision_model.")
        if skip(name):
            continue
        if name not in params:
            raise KeyError(f"unexpected vision weight {name!r}")
        if params[name].shape != tensor.shape:
            raise ValueError(f"{name}: shape {tuple(tensor.shape)} != expected "
                             f"{tuple(params[name].shape)}")
        params[name].copy_(tensor)
        loaded.add(name)
    return loaded
