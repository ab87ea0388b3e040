"""Gemma 3 (`Gemma3ForConditionalGeneration`): SigLIP tower -> average pool -> RMSNorm ->
projection, then the Gemma 3 decoder over the engine's cache groups.

The decoder interleaves sliding-window layers (`layer_types`: ``sliding_attention``, window
`sliding_window`, rotary base of the sliding layers) with full-attention ones (their rotary,
with linear scaling where the config has it); each layer kind is a cache group
(`core/kv_cache_groups.py`), so a sliding layer's KV holds only its window. Gemma's
specifics: embeddings scaled by sqrt(hidden), RMSNorm of weight ``1 + w`` computed in float32,
four norms a layer (before and after attention and MLP), per-head q and k norms, attention
scale `query_pre_attn_scalar` ** -0.5, GELU (tanh) MLP, optional soft-capping of scores and
logits. Each image's tokens attend to each other both ways (so an image is computed whole in
one prefill chunk); on sliding layers a query also reads its window. Prompts go through the
checkpoint's own processor (`TransformersInputProcessor`): its chat template, the image's
``<start_of_image>`` expanded to the soft tokens, pixels as its image processor makes them.

Checkpoint names load as they are (transformers 5.x and hub layouts, LLaVA's loader); the
language model's projections keep the names the tensor-parallel plan splits
(`layers/tensor_parallel.py`).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from vlmserve.core.kv_cache_groups import FULL, LayerKind, layer_groups
from vlmserve.layers.attention import AttentionMetadata, Window, paged_attention_reference
from vlmserve.layers.fused import EAGER_OPS
from vlmserve.layers.linear import Linear, MergedLinear
from vlmserve.layers.positions import TokenPositions
from vlmserve.layers.rotary import MRotaryEmbedding
from vlmserve.models.llava import LlavaForConditionalGeneration
from vlmserve.models.qwen2 import Qwen2Model
from vlmserve.models.transformers_packing import unpack_meta, unpack_tensors
from vlmserve.models.transformers_processing import TransformersInputProcessor
from vlmserve.models.vision.common import get_activation
from vlmserve.models.vision.siglip import SiglipVisionTower


class GemmaRMSNorm(nn.Module):
    """``x / rms(x) * (1 + w)`` in float32, cast back (Gemma's; weights start at zero)."""

    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (xf * (1.0 + self.weight.float())).type_as(x)


def layer_kinds(tcfg) -> list[LayerKind]:
    """Each decoder layer's kind from `layer_types`."""
    kinds = []
    for kind in tcfg.layer_types:
        if kind == "sliding_attention":
            kinds.append(LayerKind("sliding", int(tcfg.sliding_window)))
        elif kind == "full_attention":
            kinds.append(FULL)
        else:
            raise ValueError(f"Gemma 3 layer kind {kind!r} is not supported")
    return kinds


def rotary_for(tcfg, layer_type: str, head_dim: int) -> MRotaryEmbedding:
    """The rotary of one layer kind (transformers 5's `rope_parameters` by layer type; a
    flat one with `rope_local_base_freq` for the sliding layers otherwise)."""
    params = getattr(tcfg, "rope_parameters", None) or {}
    params = params.get(layer_type, params) if isinstance(params, dict) else {}
    if layer_type == "sliding_attention" and "rope_theta" not in params:
        params = {"rope_theta": getattr(tcfg, "rope_local_base_freq", 10000.0)}
    kind = params.get("rope_type", "default")
    if kind not in ("default", "linear"):
        raise ValueError(f"Gemma 3 rotary scaling {kind!r} is not supported")
    rotary = MRotaryEmbedding(head_dim, float(params.get("rope_theta", 10000.0)), None)
    if kind == "linear":  # positions divided by the factor: the frequencies, equally
        rotary.inv_freq /= float(params["factor"])
    return rotary


class Gemma3Attention(nn.Module):
    def __init__(self, cfg, window: Window | None, group: int) -> None:
        super().__init__()
        heads, kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
        d = self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
        self.heads, self.kv_heads = heads, kv_heads
        bias = bool(getattr(cfg, "attention_bias", False))
        self.qkv_proj = MergedLinear(cfg.hidden_size, [heads * d, kv_heads * d, kv_heads * d],
                                     bias=bias)
        self.o_proj = Linear(heads * d, cfg.hidden_size, bias=bias)
        self.q_norm = GemmaRMSNorm(d, cfg.rms_norm_eps)
        self.k_norm = GemmaRMSNorm(d, cfg.rms_norm_eps)
        self.scale = cfg.query_pre_attn_scalar ** -0.5
        self.softcap = getattr(cfg, "attn_logit_softcapping", None)
        self.window = window
        self.group = group  # its KV group: which of the step's block tables it reads
        self.attn_fn = paged_attention_reference
        self.ops = EAGER_OPS
        self.kv_scales = None  # an FP8 cache's [k_scale, v_scale]

    def forward(self, x, cos, sin, kv_cache, meta: AttentionMetadata) -> torch.Tensor:
        T, d = x.shape[0], self.head_dim
        meta = meta.for_group(self.group)
        q, k, v = self.qkv_proj(x).split(
            [self.heads * d, self.kv_heads * d, self.kv_heads * d], dim=-1)
        q = self.q_norm(q.reshape(T, self.heads, d))
        k = self.k_norm(k.reshape(T, self.kv_heads, d))
        q = self.ops.rotary_qk_cache(q, k, v.reshape(T, self.kv_heads, d), cos, sin, kv_cache,
                                     meta.slot_mapping, self.kv_scales)
        if self.window is None and self.softcap is None:
            o = self.attn_fn(q, kv_cache, meta, self.scale, kv_scales=self.kv_scales)
        else:
            o = self.attn_fn(q, kv_cache, meta, self.scale, self.window, self.softcap,
                             kv_scales=self.kv_scales)
        return self.o_proj(o.reshape(T, -1))  # [T, hidden]


class Gemma3MLP(nn.Module):
    def __init__(self, cfg) -> None:
        super().__init__()
        self.gate_up_proj = MergedLinear(cfg.hidden_size, [cfg.intermediate_size] * 2,
                                         bias=False)
        self.down_proj = Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)
        self.act = get_activation(cfg.hidden_activation)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(self.act(gate) * up)


class Gemma3DecoderLayer(nn.Module):
    def __init__(self, cfg, kind: LayerKind, group: int) -> None:
        super().__init__()
        window = Window(kind.kind, kind.size) if kind.windowed else None
        self.self_attn = Gemma3Attention(cfg, window, group)
        self.mlp = Gemma3MLP(cfg)
        h, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.input_layernorm = GemmaRMSNorm(h, eps)
        self.post_attention_layernorm = GemmaRMSNorm(h, eps)
        self.pre_feedforward_layernorm = GemmaRMSNorm(h, eps)
        self.post_feedforward_layernorm = GemmaRMSNorm(h, eps)

    def forward(self, x, cos, sin, kv_cache, meta) -> torch.Tensor:
        h = self.self_attn(self.input_layernorm(x), cos, sin, kv_cache, meta)
        x = x + self.post_attention_layernorm(h)
        h = self.mlp(self.pre_feedforward_layernorm(x))
        return x + self.post_feedforward_layernorm(h)


class Gemma3TextModel(nn.Module):
    """Token embedding (unscaled here: the VLM's `embed_tokens` scales), decoder layers, final
    norm; loading, attention backend and KV shape as Qwen2Model's (the same names)."""

    _STACKED = Qwen2Model._STACKED
    load_weights = Qwen2Model.load_weights
    set_attention_backend = Qwen2Model.set_attention_backend
    set_kv_cache_scales = Qwen2Model.set_kv_cache_scales
    kv_cache_shape = Qwen2Model.kv_cache_shape

    def __init__(self, cfg) -> None:
        super().__init__()
        self.config = cfg
        self.kinds = layer_kinds(cfg)
        kv = [kind for kind, _ in layer_groups(self.kinds) if kind.kind != "linear"]
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(Gemma3DecoderLayer(cfg, kind, kv.index(kind))
                                    for kind in self.kinds)
        self.norm = GemmaRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        d = self.layers[0].self_attn.head_dim
        self.rotary_local = rotary_for(cfg, "sliding_attention", d)
        self.rotary_global = rotary_for(cfg, "full_attention", d)

    def forward(self, inputs_embeds: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[torch.Tensor], meta: AttentionMetadata) -> torch.Tensor:
        """[T, hidden] -> final hidden states [T, hidden]."""
        dtype = inputs_embeds.dtype
        local = self.rotary_local.cos_sin(positions, dtype)
        full = self.rotary_global.cos_sin(positions, dtype)
        x = inputs_embeds
        for layer, cache, kind in zip(self.layers, kv_caches, self.kinds, strict=True):
            cos, sin = local if kind.windowed else full
            x = layer(x, cos, sin, cache, meta)
        return self.norm(x)


class Gemma3Projector(nn.Module):
    """The tower's patches averaged in `kernel` x `kernel` squares to `mm_tokens_per_image`,
    Gemma's RMSNorm, then one projection to the LM's width."""

    def __init__(self, hf_config) -> None:
        super().__init__()
        vcfg, tcfg = hf_config.vision_config, hf_config.text_config
        self.mm_input_projection_weight = nn.Parameter(
            torch.zeros(vcfg.hidden_size, tcfg.hidden_size))
        self.mm_soft_emb_norm = GemmaRMSNorm(vcfg.hidden_size, vcfg.layer_norm_eps)
        self.patches = vcfg.image_size // vcfg.patch_size
        self.kernel = self.patches // int(hf_config.mm_tokens_per_image ** 0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """[B, patches, vision dim] -> [B, tokens, hidden]."""
        b, _, dim = x.shape
        grid = x.transpose(1, 2).reshape(b, dim, self.patches, self.patches)
        pooled = F.avg_pool2d(grid, self.kernel, self.kernel).flatten(2).transpose(1, 2)
        return (self.mm_soft_emb_norm(pooled) @ self.mm_input_projection_weight).type_as(x)


class Gemma3ForConditionalGeneration(LlavaForConditionalGeneration):
    position_scheme = TokenPositions()
    input_processor_cls = TransformersInputProcessor
    # the image's tokens read each other both ways (the runner's spans, the whole-image rule)
    bidirectional_images = True

    @classmethod
    def reads_images_both_ways(cls, hf_config) -> bool:
        return True

    def _init_vision(self, hf_config) -> None:
        self.vision_tower = SiglipVisionTower(hf_config.vision_config)
        self.multi_modal_projector = Gemma3Projector(hf_config)

    def _init_language_model(self, tcfg) -> None:
        self.language_model = Gemma3TextModel(tcfg)
        self.layer_kinds = self.language_model.kinds
        self.tie_word_embeddings = bool(getattr(self.config, "tie_word_embeddings", False)
                                        or getattr(tcfg, "tie_word_embeddings", False))
        self.lm_head = nn.Linear(tcfg.hidden_size, tcfg.vocab_size, bias=False)
        if self.tie_word_embeddings:
            self.lm_head.weight = self.language_model.embed_tokens.weight
        self.final_softcap = getattr(tcfg, "final_logit_softcapping", None)

    def embed_tokens(self, token_ids: torch.Tensor) -> torch.Tensor:
        """Scaled by sqrt(hidden) in the weights' dtype; an image token id past the
        vocabulary (its row is the image's) embeds as token 0."""
        emb, tcfg = self.language_model.embed_tokens, self.config.text_config
        ids = torch.where(token_ids < tcfg.vocab_size, token_ids, 0)
        scale = torch.tensor(tcfg.hidden_size ** 0.5, dtype=emb.weight.dtype)
        return emb(ids) * scale.to(emb.weight.device)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.lm_head(hidden)
        if self.final_softcap is not None:
            logits = torch.tanh(logits / self.final_softcap) * self.final_softcap
        return logits.float()

    def forward(self, inputs_embeds, positions, kv_caches, meta, **extra) -> torch.Tensor:
        return self.language_model(inputs_embeds, positions, kv_caches, meta)

    def encode_images(self, pixel_values: torch.Tensor,
                      encoder_meta: Sequence[tuple[int, ...]]) -> torch.Tensor:
        """The images' packed tensors (their processor's, as bytes: `TransformersInputProcessor`)
        -> ``[images * mm_tokens_per_image, hidden]``."""
        pixels, at = [], 0
        for meta in encoder_meta:
            layout = unpack_meta(meta)
            assert not layout.text_tokens, "a Gemma 3 image's span is its soft tokens"
            pixels.append(unpack_tensors(pixel_values[at:at + layout.nbytes],
                                         layout)["pixel_values"])
            at += layout.nbytes
        dtype = self.multi_modal_projector.mm_input_projection_weight.dtype
        feats = self.vision_tower(torch.cat(pixels).to(dtype))  # [B, patches, vision dim]
        return self.multi_modal_projector(feats).flatten(0, 1)  # [B * tokens, hidden]

    def set_vision_attention_backend(self, fn) -> None:
        """Unused: every SigLIP batch is images of one size, one dense SDPA call."""
