"""The decoder of Qwen2, Qwen3, Llama and Mistral (the language models of Qwen2-VL, Qwen2.5-VL,
Qwen3-VL and LLaVA) over a paged KV cache: one block layout, the differences (biases, Qwen3's
per-head q/k norms, rotary sections, interleaved or not, Qwen3-VL-MoE's sparse layers of
experts: layers/moe.py) read from the config."""

from __future__ import annotations

import torch
from torch import nn

from vlmserve.layers.attention import AttentionMetadata, paged_attention_reference
from vlmserve.layers.fused import EAGER_OPS
from vlmserve.layers.linear import Linear, MergedLinear
from vlmserve.layers.moe import is_sparse_layer, sparse_moe_for
from vlmserve.layers.norm import RMSNorm
from vlmserve.layers.rotary import MRotaryEmbedding


class Qwen2Attention(nn.Module):
    def __init__(self, hidden: int, heads: int, kv_heads: int, head_dim: int,
                 qkv_bias: bool = True, o_bias: bool = False, qk_norm_eps: float | None = None
                 ) -> None:
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, head_dim
        self.qkv_proj = MergedLinear(
            hidden, [heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], bias=qkv_bias)
        self.o_proj = Linear(heads * head_dim, hidden, bias=o_bias)
        # Qwen3: RMSNorm of each head's q and k before the rotary
        self.q_norm = self.k_norm = None
        if qk_norm_eps is not None:
            self.q_norm, self.k_norm = RMSNorm(head_dim, qk_norm_eps), RMSNorm(head_dim,
                                                                               qk_norm_eps)
        self.scale = head_dim**-0.5
        self.attn_fn = paged_attention_reference
        self.ops = EAGER_OPS
        self.kv_scales = None  # an FP8 cache's [k_scale, v_scale] (`set_kv_cache_scales`)

    def forward(self, x, residual, norm: RMSNorm, cos, sin, kv_cache, meta: AttentionMetadata
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """(attention output, residual stream): `norm` (with the residual add), the QKV
        projection, rotary and the KV-cache write are one op (with q/k norms, the norms sit
        between the projection and the rotary)."""
        T = x.shape[0]
        if self.q_norm is None:
            q, residual = self.ops.rms_norm_qkv_rope(
                x, residual, norm.weight, norm.eps, self.qkv_proj.w, self.qkv_proj.bias,
                self.heads, self.kv_heads, cos, sin, kv_cache, meta.slot_mapping, self.kv_scales)
        else:
            q, residual = self._qk_norm_rope(x, residual, norm, cos, sin, kv_cache, meta)
        o = self.attn_fn(q, kv_cache, meta, self.scale, kv_scales=self.kv_scales)
        return self.o_proj(o.reshape(T, -1)), residual

    def _qk_norm_rope(self, x, residual, norm: RMSNorm, cos, sin, kv_cache,
                      meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        T, d = x.shape[0], self.head_dim
        qkv, residual = self.ops.rms_norm_linear(x, residual, norm.weight, norm.eps,
                                                 self.qkv_proj.w, self.qkv_proj.bias)
        q, k, v = qkv.split([self.heads * d, self.kv_heads * d, self.kv_heads * d], dim=-1)
        q = self.ops.rms_norm(q.reshape(-1, d), self.q_norm.weight, self.q_norm.eps)
        k = self.ops.rms_norm(k.reshape(-1, d), self.k_norm.weight, self.k_norm.eps)
        q = self.ops.rotary_qk_cache(q.view(T, self.heads, d), k.view(T, self.kv_heads, d),
                                     v.reshape(T, self.kv_heads, d), cos, sin, kv_cache,
                                     meta.slot_mapping, self.kv_scales)
        return q, residual


class Qwen2MLP(nn.Module):
    def __init__(self, hidden: int, intermediate: int) -> None:
        super().__init__()
        self.gate_up_proj = MergedLinear(hidden, [intermediate, intermediate], bias=False)
        self.down_proj = Linear(intermediate, hidden, bias=False)
        self.ops = EAGER_OPS

    def forward(self, x, residual, norm: RMSNorm) -> tuple[torch.Tensor, torch.Tensor]:
        """(MLP output, residual stream): `norm` (with the residual add), the gate/up
        projection and SiLU-and-mul are one op."""
        act, residual = self.ops.rms_norm_linear(x, residual, norm.weight, norm.eps,
                                                 self.gate_up_proj.w, gated_silu=True)
        return self.down_proj(act), residual


class Qwen2DecoderLayer(nn.Module):
    def __init__(self, cfg, index: int = 0) -> None:
        super().__init__()
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        qkv_bias, o_bias = attention_biases(cfg)
        qk_norm = str(getattr(cfg, "model_type", "")).startswith("qwen3")
        self.self_attn = Qwen2Attention(cfg.hidden_size, cfg.num_attention_heads,
                                        cfg.num_key_value_heads, head_dim, qkv_bias, o_bias,
                                        cfg.rms_norm_eps if qk_norm else None)
        self.mlp = (sparse_moe_for(cfg) if is_sparse_layer(cfg, index)
                    else Qwen2MLP(cfg.hidden_size, cfg.intermediate_size))
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x, residual, cos, sin, kv_cache, meta):
        """Residual stream: returns (this layer's output, the sum before it); the next norm
        adds them (None: x is the first layer's input)."""
        x, residual = self.self_attn(x, residual, self.input_layernorm, cos, sin, kv_cache, meta)
        return self.mlp(x, residual, self.post_attention_layernorm)


def attention_biases(cfg) -> tuple[bool, bool]:
    """(q/k/v bias, o_proj bias) of a text config: Llama says so (`attention_bias`, both);
    Qwen2's configs do not, it always has q/k/v biases; Mistral has none."""
    if getattr(cfg, "mlp_bias", False):
        raise ValueError("decoders with MLP biases (mlp_bias) are not supported")
    if hasattr(cfg, "attention_bias"):
        return bool(cfg.attention_bias), bool(cfg.attention_bias)
    return str(getattr(cfg, "model_type", "")).startswith("qwen2"), False


# text configs whose mRoPE sections interleave without saying so
_INTERLEAVED_MROPE = ("qwen3_vl_text", "qwen3_vl_moe_text")
# rotary variants this decoder computes: plain RoPE, and mRoPE (`mrope_section`)
_ROPE_TYPES = (None, "default", "mrope")


def rope_settings(cfg) -> tuple[float, list[int] | None, bool]:
    """rope_theta, mrope_section and whether the sections interleave (Qwen3-VL's t h w t h w
    ..., `mrope_interleaved`) from a text config (transformers 4.x or 5.x layout)."""
    params = getattr(cfg, "rope_parameters", None) or {}
    scaling = getattr(cfg, "rope_scaling", None) or {}
    kind = params.get("rope_type") or scaling.get("rope_type") or scaling.get("type")
    if kind not in _ROPE_TYPES:
        raise ValueError(f"rotary scaling {kind!r} is not supported (only plain RoPE and mRoPE)")
    theta = params.get("rope_theta", getattr(cfg, "rope_theta", 10000.0))
    section = params.get("mrope_section") or scaling.get("mrope_section")
    interleaved = bool(params.get("mrope_interleaved") or scaling.get("mrope_interleaved")
                       or getattr(cfg, "model_type", "") in _INTERLEAVED_MROPE)
    return float(theta), section, interleaved


class Qwen2Model(nn.Module):
    """Token embedding, decoder layers, final norm. `forward` takes embeddings so the caller
    can merge image rows in first."""

    def __init__(self, cfg) -> None:
        super().__init__()
        self.config = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(Qwen2DecoderLayer(cfg, i)
                                    for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        attn = self.layers[0].self_attn
        theta, section, interleaved = rope_settings(cfg)
        self.rotary = MRotaryEmbedding(attn.head_dim, theta, section, interleaved)

    def set_attention_backend(self, fn) -> None:
        for layer in self.layers:
            layer.self_attn.attn_fn = fn

    def kv_cache_shape(self, num_blocks: int, block_size: int) -> tuple[int, ...]:
        attn = self.layers[0].self_attn
        return (2, num_blocks, block_size, attn.kv_heads, attn.head_dim)

    def set_kv_cache_scales(self, scales: list[torch.Tensor | None]) -> None:
        """Each layer's FP8 KV scales (`layers/kv_quant.py`; None for a layer without
        paged KV, or an unquantized cache) to its attention."""
        for layer, s in zip(self.layers, scales, strict=True):
            if hasattr(layer, "self_attn"):
                layer.self_attn.kv_scales = s

    def forward(
        self,
        inputs_embeds: torch.Tensor,  # [T, hidden]
        positions: torch.Tensor,  # [3, T] or [T]
        kv_caches: list[torch.Tensor],
        meta: AttentionMetadata,
        deepstack: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """``deepstack`` (Qwen3-VL): (the image rows' token indices [R], their DeepStack rows
        [R, L, hidden]), the l-th added to the output of layer l."""
        cos, sin = self.rotary.cos_sin(positions, inputs_embeds.dtype)
        x, residual = inputs_embeds, None
        for i, (layer, cache) in enumerate(zip(self.layers, kv_caches)):
            x, residual = layer(x, residual, cos, sin, cache, meta)
            if deepstack is not None and i < deepstack[1].shape[1]:
                x = x.index_add(0, deepstack[0], deepstack[1][:, i])
        return self.norm(x, residual)[0]  # [T, hidden]

    _STACKED = {  # checkpoint projection -> (merged module attribute, shard index)
        "q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
        "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1),
    }

    @torch.no_grad()
    def load_weights(self, weights) -> set[str]:
        """Names relative to the language model (`layers.0.self_attn.q_proj.weight`, ...)."""
        params = dict(self.named_parameters())
        modules = dict(self.named_modules())
        loaded = set()
        pieces: dict[str, set] = {}  # a sparse layer's experts given one by one, so far
        for name, tensor in weights:
            parts = name.split(".")
            if "experts" in parts[:-1]:  # a sparse layer's experts: stacked, or one by one
                at = parts.index("experts")
                prefix = ".".join(parts[:at + 1])
                done = modules[prefix].load(".".join(parts[at + 1:]), tensor,
                                            pieces.setdefault(prefix, set()))
                loaded.update(f"{prefix}.{param}" for param in done)
                continue
            if len(parts) >= 2 and parts[-2] in self._STACKED:
                target, shard = self._STACKED[parts[-2]]
                module_name = ".".join(parts[:-2] + [target])
                modules[module_name].load_shard(shard, tensor, parts[-1])
                loaded.add(f"{module_name}.{parts[-1]}")
                continue
            if name not in params:
                raise KeyError(f"unexpected language-model weight {name!r}")
            assert params[name].shape == tensor.shape, (name, params[name].shape, tensor.shape)
            params[name].copy_(tensor)
            loaded.add(name)
        return loaded


class DecoderVLM(nn.Module):
    """What a vision-language model's language half shares across families: the decoder
    (`Qwen2Model`, any of Qwen2 / Llama / Mistral by config), the (optionally tied) lm_head,
    and the runner's hooks onto them. Subclasses add the vision half and `load_weights`."""

    language_model_cls: type[nn.Module] = Qwen2Model

    def _init_language_model(self, tcfg) -> None:
        self.language_model = self.language_model_cls(tcfg)
        self.tie_word_embeddings = bool(getattr(self.config, "tie_word_embeddings", False)
                                        or getattr(tcfg, "tie_word_embeddings", False))
        self.lm_head = nn.Linear(tcfg.hidden_size, tcfg.vocab_size, bias=False)
        if self.tie_word_embeddings:
            self.lm_head.weight = self.language_model.embed_tokens.weight

    def embed_tokens(self, token_ids: torch.Tensor) -> torch.Tensor:
        return self.language_model.embed_tokens(token_ids)

    def forward(self, inputs_embeds, positions, kv_caches, meta, **extra) -> torch.Tensor:
        return self.language_model(inputs_embeds, positions, kv_caches, meta, **extra)

    @classmethod
    def reads_images_both_ways(cls, hf_config) -> bool:
        """The native families read images causally, like their text."""
        return False

    @classmethod
    def reads_prompt_both_ways(cls, hf_config) -> bool:
        return False

    @classmethod
    def image_row_width(cls, hf_config) -> int:
        """Width of an image's embedding rows (what the encoder gives, the store holds and
        encoder services send): the language model's hidden size."""
        return (getattr(hf_config, "text_config", None) or hf_config).hidden_size

    def merge_image_rows(self, embeds: torch.Tensor, dest: torch.Tensor,
                         rows: torch.Tensor) -> dict:
        """Image rows into the token embeddings at ``dest``; returns what `forward` takes
        besides (nothing here)."""
        embeds.index_copy_(0, dest, rows.to(embeds.dtype))
        return {}

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden).float()  # [N, vocab]

    def kv_cache_shape(self, num_blocks: int, block_size: int) -> tuple[int, ...]:
        return self.language_model.kv_cache_shape(num_blocks, block_size)

    def set_attention_backend(self, fn) -> None:
        self.language_model.set_attention_backend(fn)

    def set_kv_cache_scales(self, scales: list[torch.Tensor | None]) -> None:
        """Each decoder layer's FP8 KV scales; a model without this takes no FP8 cache."""
        self.language_model.set_kv_cache_scales(scales)

    def set_fused_ops(self, ops) -> None:
        """Both towers: every module with an `ops` attribute takes these."""
        for module in self.modules():
            if hasattr(module, "ops"):
                module.ops = ops

    @property
    def hidden_size(self) -> int:
        return self.language_model.config.hidden_size

    @property
    def row_width(self) -> int:
        """`image_row_width` of this model."""
        return self.image_row_width(self.config)

    @property
    def num_layers(self) -> int:
        return len(self.language_model.layers)
