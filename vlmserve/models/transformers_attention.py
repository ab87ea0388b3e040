"""What the transformers backend puts inside a transformers model's text layers
(`models/transformers_backend.py`): the attention function registered with transformers'
attention interface (`paged_attention`: each layer's keys and values into the engine's paged
KV cache, its KV group's metadata, window, both-ways spans, soft-capping and FP8 scales), the
forward of LFM2's short-convolution modules over the engine's state pools (`short_conv`),
and `Step`: what both read while a step's forward runs."""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from torch import nn

from vlmserve.layers.attention import (
    AttentionMetadata,
    Window,
    paged_attention_reference,
    write_kv,
)
from vlmserve.layers.gated_deltanet import depthwise_conv


class Step:
    """What the registered attention function reads while a step's forward runs: the KV
    caches, the step's attention metadata and the paged attention function."""

    def __init__(self) -> None:
        self.kv_caches: list[torch.Tensor] = []
        self.meta: AttentionMetadata | None = None
        self.attn_fn = paged_attention_reference
        self.windows: list[Window | None] = []  # each layer's, beside the causal rule
        self.both_ways: list[bool] = []  # each layer's: reads the step's spans both ways
        self.groups: list[int] = []  # each attention layer's KV cache group
        self.sources: dict[int, int] = {}  # layers reading another's cache (its keys there)
        self.kv_scales: list[torch.Tensor | None] = []  # an FP8 cache's, by layer
        self._metas: dict[tuple[int, bool], AttentionMetadata] = {}  # the step's, by layer

    def begin(self, kv_caches: list[torch.Tensor], meta: AttentionMetadata) -> None:
        self.kv_caches, self.meta, self._metas = kv_caches, meta, {}

    def layer_meta(self, layer: int) -> AttentionMetadata:
        """Layer ``layer``'s metadata: its KV group's block tables and slots, and the step's
        both-ways spans where the layer reads them (else none)."""
        key = (self.groups[layer], self.both_ways[layer])
        meta = self._metas.get(key)
        if meta is None:
            meta = self.meta.for_group(key[0])
            if meta.bidirectional and not key[1]:
                meta = dataclasses.replace(meta, bidirectional=None, _groups={}, _spans=None)
            self._metas[key] = meta
        return meta


def paged_attention(module: nn.Module, query: torch.Tensor, key: torch.Tensor,
                    value: torch.Tensor, attention_mask: Any, scaling: float | None = None,
                    dropout: float = 0.0, **kwargs: Any) -> tuple[torch.Tensor, None]:
    """transformers' attention interface over the engine's paged KV cache: ``query``
    ``[1, heads, T, dim]`` (the step's flat tokens), ``key``/``value`` ``[1, kv_heads, T,
    dim]`` after the rotary -> ``[1, T, heads, dim]``. The mask is the engine's (each token
    attends causally to its own request); transformers builds none for this interface."""
    step: Step = module.vlmserve_step
    layer = module.layer_idx
    cache = step.kv_caches[layer]  # (of this layer's KV heads and head size)
    q, k, v = query[0].transpose(0, 1), key[0].transpose(0, 1), value[0].transpose(0, 1)
    dim = q.shape[-1]
    if q.stride(-1) != 1:  # the kernels read any token and head strides
        q = q.contiguous()
    meta = step.layer_meta(layer)
    # an FP8 cache's scales: those of the layer that writes it (a sharing layer's source)
    kv_scales = step.kv_scales[step.sources.get(layer, layer)] if step.kv_scales else None
    if layer not in step.sources:  # (a sharing layer's cache is its source's, written)
        write_kv(cache, k, v, meta.slot_mapping, kv_scales)
    scale = scaling if scaling is not None else dim ** -0.5
    window = step.windows[layer]
    softcap = kwargs.get("softcap")
    if window is None and softcap is None:
        out = step.attn_fn(q, cache, meta, scale, kv_scales=kv_scales)
    elif window is not None and window.clips_spans and meta.bidirectional:
        # (Gemma 4's images read both ways inside a window: the reference kernel's)
        out = paged_attention_reference(q, cache, meta, scale, window, softcap, kv_scales)
    else:
        out = step.attn_fn(q, cache, meta, scale, window, softcap, kv_scales=kv_scales)
    return out[None], None


def short_conv(module: nn.Module, hidden_states: torch.Tensor, *args: Any, **kwargs: Any
               ) -> torch.Tensor:
    """An LFM2 short-convolution module's forward over the engine's state pools:
    ``hidden_states [1, T, hidden]`` (the step's flat tokens) -> ``out_proj(C * conv(B *
    x))``, each sequence's convolution continuing the conv state at its slot (zeros without
    one) and leaving its new state there (`meta.linear`). transformers' padding mask and
    cache are not read: the engine's steps have no padding, the pools are the cache."""
    step: Step = module.vlmserve_step
    conv_state = step.kv_caches[module.layer_idx][0]
    b, c, x = module.in_proj(hidden_states[0]).chunk(3, dim=-1)
    conv = module.conv
    y = depthwise_conv(b * x, conv.weight[:, 0], conv_state, step.meta.linear, conv.bias)
    return module.out_proj(c * y.to(x.dtype))[None]
