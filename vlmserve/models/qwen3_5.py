"""Qwen3.5 and Qwen3.5-MoE: the Qwen3-VL vision tower (without DeepStack), and a decoder
whose layers are of two kinds (`layer_types`): Gated DeltaNet linear attention
(layers/gated_deltanet.py) over per-sequence state pools, and full attention over the paged
KV cache with an output gate (q_proj gives each head's query and gate), per-head q/k norms
and rotary on the first quarter of each head (`partial_rotary_factor`), interleaved mRoPE.
Qwen3.5-MoE's MLPs are sparse (layers/moe.py) with a gated shared expert.

Qwen3.5's RMSNorms scale by ``1 + weight``: the checkpoint's weights are loaded plus one
(`_ZERO_CENTERED`), so the usual norm ops serve (the gated norm of the linear layers scales
by its weight as is). The multi-token-prediction weights (``mtp.*``) are loaded and kept
(`MTPWeights`), unused for now.
"""

from __future__ import annotations

import torch
from torch import nn

from vlmserve.core.kv_cache_groups import FULL as FULL_LAYER
from vlmserve.core.kv_cache_groups import LayerKind
from vlmserve.layers.attention import AttentionMetadata, paged_attention_reference, write_kv
from vlmserve.layers.fused import EAGER_OPS, rotary_qk
from vlmserve.layers.gated_deltanet import GatedDeltaNet
from vlmserve.layers.linear import Linear, MergedLinear
from vlmserve.layers.moe import SharedExpertMoE, is_sparse_layer, sparse_moe_for
from vlmserve.layers.norm import RMSNorm
from vlmserve.layers.rotary import MRotaryEmbedding
from vlmserve.layers.tensor_parallel import TPLayout
from vlmserve.models.qwen2 import Qwen2MLP, Qwen2Model, rope_settings
from vlmserve.models.qwen2_vl import text_config
from vlmserve.models.qwen3_vl import Qwen3VLForConditionalGeneration

LINEAR, FULL = "linear_attention", "full_attention"


class GatedAttention(nn.Module):
    """Full attention with an output gate: ``o_proj(attention(q, k, v) * sigmoid(gate))``;
    q and k RMS-normed per head, rotary on their first `rotary_dim` channels."""

    def __init__(self, hidden: int, heads: int, kv_heads: int, head_dim: int, eps: float,
                 bias: bool) -> None:
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, head_dim
        # q_proj's rows: per head, its query's head_dim then its gate's
        self.qkv_proj = MergedLinear(
            hidden, [heads * head_dim * 2, kv_heads * head_dim, kv_heads * head_dim], bias=bias)
        self.o_proj = Linear(heads * head_dim, hidden, bias=bias)
        self.q_norm, self.k_norm = RMSNorm(head_dim, eps), RMSNorm(head_dim, eps)
        self.scale = head_dim**-0.5
        self.attn_fn = paged_attention_reference
        self.ops = EAGER_OPS
        self.kv_scales = None  # an FP8 cache's [k_scale, v_scale]

    def forward(self, x, residual, norm: RMSNorm, cos, sin, kv_cache, meta: AttentionMetadata
                ) -> tuple[torch.Tensor, torch.Tensor]:
        T, d = x.shape[0], self.head_dim
        qkv, residual = self.ops.rms_norm_linear(x, residual, norm.weight, norm.eps,
                                                 self.qkv_proj.w, self.qkv_proj.bias)
        qg, k, v = qkv.split([2 * self.heads * d, self.kv_heads * d, self.kv_heads * d], -1)
        q, gate = qg.view(T, self.heads, 2 * d).split(d, dim=-1)
        q = self.ops.rms_norm(q.reshape(-1, d), self.q_norm.weight, self.q_norm.eps)
        k = self.ops.rms_norm(k.reshape(-1, d), self.k_norm.weight, self.k_norm.eps)
        q, k = q.view(T, self.heads, d), k.view(T, self.kv_heads, d)
        r = cos.shape[-1]  # rotary channels
        q_rot, k_rot = rotary_qk(q[..., :r], k[..., :r], cos, sin)
        q, k = torch.cat([q_rot, q[..., r:]], -1), torch.cat([k_rot, k[..., r:]], -1)
        write_kv(kv_cache, k, v.reshape(T, self.kv_heads, d), meta.slot_mapping, self.kv_scales)
        o = self.attn_fn(q, kv_cache, meta, self.scale, kv_scales=self.kv_scales)  # [T, H, d]
        o = o.reshape(T, -1) * torch.sigmoid(gate.reshape(T, -1))
        return self.o_proj(o), residual


class Qwen3_5DecoderLayer(nn.Module):
    def __init__(self, cfg, index: int) -> None:
        super().__init__()
        self.kind = cfg.layer_types[index]
        eps = cfg.rms_norm_eps
        if self.kind == LINEAR:
            self.linear_attn = GatedDeltaNet(
                cfg.hidden_size, cfg.linear_num_key_heads, cfg.linear_num_value_heads,
                cfg.linear_key_head_dim, cfg.linear_value_head_dim,
                cfg.linear_conv_kernel_dim, eps)
        elif self.kind == FULL:
            self.self_attn = GatedAttention(
                cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads,
                getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads,
                eps, bool(getattr(cfg, "attention_bias", False)))
        else:
            raise ValueError(f"layer {index}: unknown layer type {self.kind!r}")
        if is_sparse_layer(cfg, index):
            shared = Qwen2MLP(cfg.hidden_size, cfg.shared_expert_intermediate_size)
            self.mlp = SharedExpertMoE(sparse_moe_for(cfg), shared, cfg.hidden_size)
        else:
            self.mlp = Qwen2MLP(cfg.hidden_size, cfg.intermediate_size)
        self.input_layernorm = RMSNorm(cfg.hidden_size, eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, eps)

    def forward(self, x, residual, cos, sin, cache, meta: AttentionMetadata):
        """``cache``: the paged KV tensor (full attention) or the (conv, recurrent) state
        pools (linear attention)."""
        if self.kind == LINEAR:  # the norm and the input projection: one GEMV for a token
            attn, norm = self.linear_attn, self.input_layernorm
            proj, residual = attn.ops.rms_norm_linear(x, residual, norm.weight, norm.eps,
                                                      attn.in_proj.w)
            x = attn.out_proj(attn.mix(proj, cache[0], cache[1], meta.linear))
        else:
            x, residual = self.self_attn(x, residual, self.input_layernorm, cos, sin, cache,
                                         meta)
        return self.mlp(x, residual, self.post_attention_layernorm)


def rotary_dim(cfg) -> int:
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    params = getattr(cfg, "rope_parameters", None) or {}
    factor = params.get("partial_rotary_factor", getattr(cfg, "partial_rotary_factor", 1.0))
    return int(head_dim * factor)


class Qwen3_5TextModel(Qwen2Model):
    """Token embedding, layers of both kinds, final norm. `layer_types` says which layer is
    which; a full-attention layer's cache is a paged KV tensor (`kv_cache_shape`), a linear
    layer's the pair of state pools (`linear_state_shapes`, per slot)."""

    def __init__(self, cfg) -> None:
        nn.Module.__init__(self)
        self.config = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(Qwen3_5DecoderLayer(cfg, i)
                                    for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        theta, section, _ = rope_settings(cfg)
        # Qwen3.5's sections always interleave (t h w t h w ...)
        self.rotary = MRotaryEmbedding(rotary_dim(cfg), theta, section, interleaved=True)
        self.layer_types = [layer.kind for layer in self.layers]

    def _attention_layer(self) -> GatedAttention:
        return next(layer.self_attn for layer in self.layers if layer.kind == FULL)

    def set_attention_backend(self, fn) -> None:
        for layer in self.layers:
            if layer.kind == FULL:
                layer.self_attn.attn_fn = fn

    def set_linear_attention_backend(self, fn) -> None:
        for layer in self.layers:
            if layer.kind == LINEAR:
                layer.linear_attn.rule_fn = fn

    def kv_cache_shape(self, num_blocks: int, block_size: int) -> tuple[int, ...]:
        attn = self._attention_layer()
        return (2, num_blocks, block_size, attn.kv_heads, attn.head_dim)

    def linear_state_shapes(self) -> tuple[tuple[int, ...], tuple[int, ...]]:
        return next(layer.linear_attn.state_shapes() for layer in self.layers
                    if layer.kind == LINEAR)

    def forward(self, inputs_embeds, positions, kv_caches, meta: AttentionMetadata
                ) -> torch.Tensor:
        cos, sin = self.rotary.cos_sin(positions, inputs_embeds.dtype)
        x, residual = inputs_embeds, None
        for layer, cache in zip(self.layers, kv_caches):
            x, residual = layer(x, residual, cos, sin, cache, meta)
        return self.norm(x, residual)[0]  # [T, hidden]

    _ZERO_CENTERED = ("input_layernorm.weight", "post_attention_layernorm.weight",
                      "q_norm.weight", "k_norm.weight")

    @torch.no_grad()
    def load_weights(self, weights) -> set[str]:
        """Names relative to the language model; zero-centred norm weights loaded plus one,
        a linear layer's weights through its `load_weights`, the routed experts under
        ``mlp.routed``."""
        rest, linear, loaded = [], {}, set()
        for name, tensor in weights:
            if name.endswith(self._ZERO_CENTERED) or name == "norm.weight":
                tensor = tensor.float().add(1.0).to(tensor.dtype)
            if ".linear_attn." in name:
                prefix, _, local = name.partition(".linear_attn.")
                linear.setdefault(prefix, []).append((local, tensor))
                continue
            if ".mlp." in name and ".shared_expert" not in name:
                name = name.replace(".mlp.", ".mlp.routed.", 1) if isinstance(
                    self.layers[int(name.split(".")[1])].mlp, SharedExpertMoE) else name
            rest.append((name, tensor))
        for prefix, items in linear.items():
            layer = self.get_submodule(prefix).linear_attn
            loaded |= {f"{prefix}.linear_attn.{n}" for n in layer.load_weights(items)}
        return loaded | super().load_weights(rest)


class MTPWeights(nn.Module):
    """The checkpoint's multi-token-prediction weights (``mtp.*``), kept as buffers by name
    (`tensors`) for speculative decoding later; the forward never reads them. Under tensor
    parallelism those the shard plan matches (its decoder layer's projections) are this
    rank's slices, as a sharded MTP layer would hold them."""

    def __init__(self) -> None:
        super().__init__()
        self.names: dict[str, str] = {}  # checkpoint name -> buffer name

    def add(self, name: str, tensor: torch.Tensor) -> None:
        key = name.replace(".", "__")
        self.names[name] = key
        self.register_buffer(key, tensor, persistent=False)

    def tensors(self) -> dict[str, torch.Tensor]:
        return {name: getattr(self, key) for name, key in self.names.items()}


class Qwen3_5ForConditionalGeneration(Qwen3VLForConditionalGeneration):
    language_model_cls = Qwen3_5TextModel
    # q_proj's rows: per head, its query then its output gate
    tp_layout = TPLayout(gated_query=True)

    def __init__(self, hf_config) -> None:
        super().__init__(hf_config)
        self.mtp = MTPWeights()
        # each decoder layer's cache kind: linear attention (state slots) or full
        self.layer_kinds: list[LayerKind] = [
            LayerKind("linear") if kind == LINEAR else FULL_LAYER
            for kind in text_config(hf_config).layer_types]

    @classmethod
    def image_row_width(cls, hf_config) -> int:
        return hf_config.vision_config.out_hidden_size

    def merge_image_rows(self, embeds: torch.Tensor, dest: torch.Tensor,
                         rows: torch.Tensor) -> dict:
        embeds.index_copy_(0, dest, rows.to(embeds.dtype))
        return {}


    def linear_state_shapes(self) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """Per state slot: the conv state's and the recurrent state's shapes (the same in
        every linear layer)."""
        return self.language_model.linear_state_shapes()

    def set_linear_attention_backend(self, fn) -> None:
        self.language_model.set_linear_attention_backend(fn)

    def load_weights(self, weights) -> set[str]:
        device = self.lm_head.weight.device

        def model_weights():
            for name, tensor in weights:
                if name.startswith("mtp."):
                    self.mtp.add(name[len("mtp."):], tensor.to(device))
                else:
                    yield name, tensor

        return super().load_weights(model_weights())


class Qwen3_5MoeForConditionalGeneration(Qwen3_5ForConditionalGeneration):
    """The same class: the decoder takes its sparse MLPs from the config."""
