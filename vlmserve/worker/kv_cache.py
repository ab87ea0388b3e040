"""The paged KV tensors (the worker's half of the KV cache groups, `core/kv_cache_groups.py`).

One tensor per attention layer, ``model.kv_cache_shape`` (or the layer's own,
`layer_cache_shape`) of its group's blocks plus one
(owned by nobody: padded rows of CUDA-graph batches write there, a window's passed places
point there), in the cache's dtype: the model's, or float8 e4m3 with
``kv_cache_dtype="fp8"`` (layers/kv_quant.py), whose per-layer scales the model's attention
layers hold (`set_kv_cache_scales`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from vlmserve.core.kv_cache_groups import CacheGroupSpec
from vlmserve.layers import kv_quant
from vlmserve.worker.linear_states import LINEAR, LinearStates, layer_kind_names


def kv_sources(model) -> dict[int, int]:
    """The model's attention layers that read another layer's cache (`kv_sources`: layer ->
    that layer, of the same group; Gemma 4's shared keys and values): they hold none."""
    return dict(getattr(model, "kv_sources", None) or {})


def layer_cache_shape(model, layer: int, num_blocks: int, block_size: int) -> tuple[int, ...]:
    """Attention layer ``layer``'s KV tensor shape: the model's shape of that layer
    (`layer_kv_cache_shape`, where its layers differ: Gemma 4's through the transformers
    backend), else its one `kv_cache_shape`."""
    per_layer = getattr(model, "layer_kv_cache_shape", None)
    if per_layer is not None:
        return per_layer(layer, num_blocks, block_size)
    return model.kv_cache_shape(num_blocks, block_size)


def layer_block_bytes(model, block_size: int, kv_dtype: torch.dtype) -> list[int]:
    """Device bytes of one KV block in each decoder layer: 0 for a linear layer and for a
    layer that reads another's cache."""
    sources = kv_sources(model)
    return [math.prod(layer_cache_shape(model, i, 1, block_size)) * kv_dtype.itemsize
            if kind != LINEAR and i not in sources else 0
            for i, kind in enumerate(layer_kind_names(model))]


def kv_block_bytes(model, block_size: int, kv_dtype: torch.dtype) -> int:
    """Device bytes of one KV block over every attention layer that holds a cache (linear
    layers and layers reading another's cache hold none): the unit the KV cache is sized in,
    half as large in FP8 as in 16 bits."""
    return sum(layer_block_bytes(model, block_size, kv_dtype))


def allocate_kv_caches(model, groups: Sequence[CacheGroupSpec], block_size: int,
                       kv_dtype: torch.dtype, device: torch.device,
                       linear: LinearStates | None = None) -> list[torch.Tensor]:
    """Each decoder layer's cache: its group's KV tensor (zeros; the same tensor as its
    source's for a layer that reads another's: `kv_sources`), a linear layer's state pools
    (`linear`), or an empty tensor."""
    blocks_of = {layer: g.num_blocks for g in groups for layer in g.layers}
    sources = kv_sources(model)
    caches = [
        torch.zeros(layer_cache_shape(model, i, blocks_of[i] + 1, block_size),
                    dtype=kv_dtype, device=device) if i in blocks_of and i not in sources
        else linear.pools[i] if linear is not None and i in linear.pools
        else torch.empty(0, device=device)
        for i in range(model.num_layers)]
    for layer, source in sources.items():
        assert blocks_of[layer] == blocks_of[source], (layer, source)
        caches[layer] = caches[source]
    return caches


def set_kv_scales(model, kv_caches: Sequence[torch.Tensor],
                  scales: dict[int, tuple[float, float]]) -> None:
    """Give the attention layers of an FP8 cache their [k_scale, v_scale] on the cache's
    device (`scales` by decoder layer; 1.0 where it has none), once, before any CUDA graph
    is captured; an unquantized cache takes none."""
    fp8 = [isinstance(kv, torch.Tensor) and kv_quant.is_fp8(kv) for kv in kv_caches]
    if any(fp8):
        model.set_kv_cache_scales([
            kv_quant.scales_tensor(*scales.get(i, (1.0, 1.0)), kv.device) if is_fp8 else None
            for i, (kv, is_fp8) in enumerate(zip(kv_caches, fp8))])
