"""The transformers backend: a vision-language model with no native class, run through its
transformers implementation with the engine's paged attention.

The HF model is built from the checkpoint as transformers builds it (`from_pretrained`: its
own weight names, tied weights, dtype). Its language model's attention goes through
transformers' attention interface: the function registered here as ``"vlmserve"`` writes
each layer's keys and values into the engine's paged KV cache and runs the engine's paged
attention over the step's flat tokens (every request of a continuous batch, prefill chunks
and decodes together), so continuous batching, chunked prefill, prefix caching and
preemption work as for a native model. Its vision part runs through the model's own
``get_image_features``, with the tensors its processor made for each image
(`models/transformers_processing.py`); a tower whose transformers code has a varlen path
for its attention (the Qwen towers, GLM-4V's, ...) runs it through the engine's vision
attention backend (`models/transformers_fused.py`, which also puts the canonical RMSNorms on
the engine's fused kernel); positions come from the model's own rules: token
indices, or its ``get_rope_index`` for multi-axis rotary positions. A model whose text model
adds DeepStack features of its images to the hidden states of its first layers (Qwen3-VL)
gets them as its native class does: each image row carries them beside its embedding.

Gemma 4 runs so too. Its layers of a kind may differ in shape (full-attention layers with a
wider head and, with ``attention_k_eq_v``, fewer KV heads): each layer's cache has its own
KV heads and head size (`layer_kv_cache_shape`; the cache is sized by what a block costs in
each layer). Its last ``num_kv_shared_layers`` layers reuse the keys and
values of an earlier layer of their kind (`kv_sources`): transformers hands the attention
function those, and such a layer reads its source's cache (the same tensor; it holds none).
Its per-layer inputs are computed from the step's token ids (`embed_tokens` keeps them for
`forward`), image, video and audio tokens read as padding as transformers reads them.
With ``use_bidirectional_attention="vision"`` an image's tokens attend to each other both ways
on its sliding layers alone, within the window; its full layers stay causal. Its audio tower
is not served: the engine sends images and text.

LFM2's short-convolution layers (``layer_types`` "conv": ``out_proj(C * conv(B * x))``, a
causal depthwise convolution over the last ``kernel`` inputs) keep their state in the engine's
state pools as a native model's linear-attention layers do (`layer_kinds`: kind "linear", a
conv state and no recurrent state, `worker/linear_states.py`): each conv module's forward is
replaced by `short_conv`, which runs the step's sequences (prefill chunks with or without a
state, decodes) over their slots with `layers/gated_deltanet.depthwise_conv`, so chunked
prefill and prefix caching (state snapshots at block boundaries) work for them too.

What the backend knows of a family from its config (windows, layer kinds, spans read both
ways, KV shapes, refusals) is in `models/transformers_families.py`.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Sequence
from pathlib import Path

import torch
from torch import nn

from vlmserve.core.kv_cache_groups import layer_groups
from vlmserve.distributed.parallel_state import TensorParallel
from vlmserve.layers.attention import AttentionMetadata
from vlmserve.layers.positions import MRopePositions, TokenPositions
from vlmserve.models.transformers_attention import Step, paged_attention, short_conv
from vlmserve.models.transformers_families import (
    check_supported,
    deepstack_layers,
    hf_model_class,
    images_both_ways,
    kv_sources,
    layer_kinds,
    layer_kv_shapes,
    layer_windows,
    layers_both_ways,
    prompt_both_ways,
    suppresses_image_codes,
    text_config,
)
from vlmserve.models.transformers_fused import (
    VISION_ATTENTION_NAME,
    rotary_ops,
    set_vision_attention,
    use_engine_ops,
    use_varlen_vision_attention,
    vision_attention,
)
from vlmserve.models.transformers_grids import HostGrids
from vlmserve.models.transformers_packing import unpack_meta, unpack_tensors
from vlmserve.models.transformers_parallel import (
    VocabShare,
    check_tensor_parallel,
    local_kv_heads,
    shard_text_model,
    split_vocabulary,
)
from vlmserve.models.transformers_processing import TransformersInputProcessor
from vlmserve.utils import to_device

ATTENTION_NAME = "vlmserve"


def _register() -> None:
    from transformers import AttentionInterface

    AttentionInterface.register(ATTENTION_NAME, paged_attention)
    AttentionInterface.register(VISION_ATTENTION_NAME, vision_attention)


def _rows(out: torch.Tensor | Sequence[torch.Tensor], width: int) -> torch.Tensor:
    """Feature rows [N, width] of a tensor or of a tensor per image."""
    if isinstance(out, (list, tuple)):
        return torch.cat([o.reshape(-1, width) for o in out])
    return out.reshape(-1, width)


def _projector_after_features(hf_model: nn.Module) -> nn.Module | None:
    """The multimodal projector where the model's forward runs it on what
    ``get_image_features`` gives (Llama 4 in transformers 5.17; 5.2x projects inside), else
    None."""
    inner = getattr(hf_model, "model", hf_model)
    owner = next((m for m in (hf_model, inner) if "multi_modal_projector" in vars(m).get(
        "_modules", {})), None)
    if owner is None:
        return None
    try:
        features = inspect.getsource(type(owner).get_image_features)
        forward = inspect.getsource(type(owner).forward)
    except (AttributeError, OSError, TypeError):
        return None
    call = "self.multi_modal_projector("
    return owner.multi_modal_projector if call in forward and call not in features else None


class TransformersVLM(nn.Module):
    """A transformers image-text-to-text model behind the engine's model interface."""

    input_processor_cls = TransformersInputProcessor
    encoder_prefixes: tuple[str, ...] = ()  # an encoder service needs a native class
    implementation = "transformers"

    @classmethod
    def reads_images_both_ways(cls, hf_config) -> bool:
        return images_both_ways(hf_config)

    @classmethod
    def reads_prompt_both_ways(cls, hf_config) -> bool:
        return prompt_both_ways(hf_config)

    @classmethod
    def check_tensor_parallel(cls, hf_config, world: int, parallel_config) -> None:
        """Refuse, in one line and before any rank starts, a split this backend cannot make
        (`transformers_parallel.check_tensor_parallel`; experts are not split by owner)."""
        if parallel_config.enable_expert_parallel:
            raise ValueError(f"{hf_config.model_type}: expert parallelism needs a native model")
        check_tensor_parallel(hf_config, world, parallel_config.mm_encoder_tp_mode == "weights")

    def __init__(self, hf_model: nn.Module, tp: TensorParallel | None = None) -> None:
        """``hf_model`` on the host with ``tp``: its text model split to this rank's share
        here (`transformers_parallel.shard_text_model`), before it moves to the device."""
        super().__init__()
        self.hf = hf_model
        self.config = hf_model.config
        tc = text_config(self.config)
        self.text_config = tc
        self.step = Step()
        self.step.windows = layer_windows(self.config)
        self.step.both_ways = layers_both_ways(self.config)
        self.bidirectional_images = self.reads_images_both_ways(self.config)
        self.bidirectional_prompt = self.reads_prompt_both_ways(self.config)
        self.fused_ops = None  # the engine's ops inside the model (`set_fused_ops`)
        self.cuda_graphs_safe = True
        inner = getattr(hf_model, "model", hf_model)
        text = getattr(inner, "language_model", None) or hf_model.get_decoder()
        if hasattr(text, "lm_head") and hasattr(text, "get_decoder"):  # a causal LM (BLIP-2's)
            decoder = text.get_decoder()
            text = decoder if decoder is not text else text.model  # Llama 4's says itself
        self.text_model = text
        if tp is not None:
            shard_text_model(text, tc, tp)
            split_vocabulary(hf_model, tp)
        # each layer's cache kind (the engine's groups); a conv layer's: its state slots
        self.layer_kinds = layer_kinds(self.config)
        kv_kinds = [k for k, _ in layer_groups(self.layer_kinds) if k.kind != "linear"]
        self.step.groups = [kv_kinds.index(k) if k.kind != "linear" else -1
                            for k in self.layer_kinds]
        # layers that reuse an earlier layer's keys and values read its cache (Gemma 4's)
        self.kv_sources = self.step.sources = kv_sources(self.config)
        if any(self.layer_kinds[i] != self.layer_kinds[j] for i, j in self.kv_sources.items()):
            raise ValueError(f"{self.config.model_type}: a layer reuses the keys and values of "
                             "a layer of another kind")
        convs = {i for i, k in enumerate(self.layer_kinds) if k.kind == "linear"}
        layers, patched, self._conv_shape = 0, set(), None
        for module in self.text_model.modules():
            if not hasattr(module, "layer_idx"):
                continue
            if module.layer_idx in convs and isinstance(getattr(module, "conv", None),
                                                        nn.Conv1d):
                module.vlmserve_step = self.step
                module.forward = functools.partial(short_conv, module)
                patched.add(module.layer_idx)
                self._conv_shape = (module.conv.kernel_size[0] - 1, module.conv.in_channels)
            elif hasattr(module, "scaling") or type(module).__name__.endswith("Attention"):
                module.vlmserve_step = self.step
                layers = max(layers, module.layer_idx + 1)
        self._num_layers = tc.num_hidden_layers
        if patched != convs:
            raise ValueError(f"{self.config.model_type}: found no short convolution in text "
                             f"layers {sorted(convs - patched)}")
        if max([layers, *(i + 1 for i in convs)]) != self._num_layers:
            raise ValueError(f"{self.config.model_type}: found attention in {layers} of "
                             f"{self._num_layers} text layers")
        self.embedding = hf_model.get_input_embeddings()
        self.lm_head = hf_model.get_output_embeddings()
        # each layer's cache of its own KV heads and head size (`layer_kv_cache_shape`)
        shapes = layer_kv_shapes(self.config)
        if tp is not None:  # this rank's KV heads of each layer
            shapes = [(local_kv_heads(h, tp.world_size), d) for h, d in shapes]
        self.kv_shapes = shapes
        self.kv_heads = max(h for h, _ in shapes)
        self.head_dim = max(d for _, d in shapes)
        # per-layer inputs (Gemma 4's): from the step's token ids, kept by `embed_tokens`;
        # its image, video and audio tokens read as padding, as transformers reads them
        self.per_layer_inputs = bool(getattr(tc, "hidden_size_per_layer_input", None)) and \
            hasattr(self.text_model, "get_per_layer_inputs")
        self._media_ids = torch.tensor(
            [i for i in (getattr(self.config, f"{m}_token_id", None)
                         for m in ("image", "video", "audio")) if i is not None],
            dtype=torch.int64)
        self._step_ids: torch.Tensor | None = None
        if self.per_layer_inputs:  # a decode graph would not see the kept ids change
            self.cuda_graphs_safe = False
        rope = getattr(tc, "rope_parameters", None) or getattr(tc, "rope_scaling", None) or {}
        section = rope.get("mrope_section") if isinstance(rope, dict) else None
        # multi-axis positions: a row per section (time, height, width; some models more)
        self.position_scheme = MRopePositions(len(section)) if section else TokenPositions()
        self.final_softcap = getattr(tc, "final_logit_softcapping", None)
        # tokens the model never emits as text (Chameleon's image codes): their logits at the
        # dtype's minimum, as its forward sets them
        vocab_map = getattr(inner, "vocabulary_mapping", None)
        self.suppressed = (torch.tensor(sorted(vocab_map.image_tokens), dtype=torch.int64)
                           if suppresses_image_codes(self.config) else None)
        self.logit_scale = getattr(tc, "logit_scale", None)
        self._features = getattr(hf_model, "get_image_features", None) or \
            inner.get_image_features
        params = inspect.signature(self._features).parameters
        self._feature_args = set(params)
        # a feature option some transformers releases require as an argument (Llama 4's
        # vision_feature_select_strategy in 5.17): the config's (or its vision config's)
        vision = getattr(self.config, "vision_config", None)
        self._feature_options = {
            name: getattr(self.config, name, getattr(vision, name, None))
            for name, p in params.items()
            if p.default is p.empty and name.startswith("vision_feature_")}
        self._projector = _projector_after_features(hf_model)
        self.grids = HostGrids(hf_model)  # its tower's grids on the host where it allows

    # ---- building ------------------------------------------------------------------------

    @classmethod
    def from_checkpoint(cls, path: str | Path, hf_config, dtype: torch.dtype,
                        device: torch.device, tp: TensorParallel | None = None
                        ) -> TransformersVLM:
        """The HF model from its checkpoint folder, its text attention the engine's; with
        ``tp``, read whole on the host and this rank's share of its text model kept."""
        check_supported(hf_config)
        _register()
        hf_cls = hf_model_class(hf_config)
        # the text model's attention is ours; every other part keeps transformers' choice
        attn = {"text_config": ATTENTION_NAME, "": ATTENTION_NAME}
        model = hf_cls.from_pretrained(str(path), config=hf_config, dtype=dtype,
                                       attn_implementation=attn, local_files_only=True)
        use_varlen_vision_attention(model, hf_config)
        return cls(model.eval(), tp).to(device)

    @classmethod
    def image_row_width(cls, hf_config) -> int:
        """An image row: its embedding, then one row of each of its DeepStack features."""
        return text_config(hf_config).hidden_size * (1 + deepstack_layers(hf_config))

    # ---- the engine's model interface ----------------------------------------------------

    @property
    def hidden_size(self) -> int:
        return self.text_config.hidden_size

    @property
    def row_width(self) -> int:
        return self.image_row_width(self.config)

    @property
    def num_layers(self) -> int:
        return self._num_layers

    def kv_cache_shape(self, num_blocks: int, block_size: int) -> tuple[int, ...]:
        """The widest layer's (each layer's own: `layer_kv_cache_shape`)."""
        return (2, num_blocks, block_size, self.kv_heads, self.head_dim)

    def layer_kv_cache_shape(self, layer: int, num_blocks: int, block_size: int
                             ) -> tuple[int, ...]:
        """Layer ``layer``'s cache: its own KV heads and head size (Gemma 4's full layers
        differ from its sliding ones)."""
        return (2, num_blocks, block_size, *self.kv_shapes[layer])

    def linear_state_shapes(self) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """Per state slot of a short-convolution layer: its conv state (the last kernel - 1
        inputs) and no recurrent state."""
        return self._conv_shape, (0,)

    def set_attention_backend(self, fn) -> None:
        self.step.attn_fn = fn

    def set_kv_cache_scales(self, scales: list[torch.Tensor | None]) -> None:
        """Each layer's FP8 KV scales ([k_scale, v_scale]; `layers/kv_quant.py`), which its
        KV writes and paged attention take."""
        self.step.kv_scales = list(scales)

    def set_linear_attention_backend(self, fn) -> None:
        """Unused: a short convolution has no recurrence."""

    def set_vision_attention_backend(self, fn) -> None:
        """A vision tower on the engine's varlen attention runs ``fn`` (flash, triton), or
        the grouped SDPA for None (`transformers_fused.set_vision_attention`)."""
        set_vision_attention(self.hf, fn)

    def set_fused_ops(self, ops) -> None:
        """The model's canonical RMSNorms run ``ops.rms_norm``, its canonical rotaries (text
        and vision) ``ops.rotary_qk_float32``, its sibling projections one GEMM, its
        canonical SiLU MLPs ``ops.silu_mul`` and its QuickGELUs ``ops.quick_gelu``
        (`transformers_fused`); everything else as transformers wrote it."""
        use_engine_ops(self.hf, ops)
        self.fused_ops = ops

    def embed_tokens(self, token_ids: torch.Tensor) -> torch.Tensor:
        """The model's own token embedding (scaled where the model scales it); an image
        token id past the vocabulary (its row is replaced by the image's) embeds as 0. A model
        with per-layer inputs keeps the ids for the step's `forward`."""
        if self.per_layer_inputs:
            self._step_ids = token_ids
        return self._embed(token_ids)

    def _embed(self, token_ids: torch.Tensor) -> torch.Tensor:
        n = self.embedding.num_embeddings
        return self.embedding(torch.where(token_ids < n, token_ids, 0))

    def merge_image_rows(self, embeds: torch.Tensor, dest: torch.Tensor,
                         rows: torch.Tensor) -> dict:
        hidden = self.hidden_size
        embeds.index_copy_(0, dest, rows[:, :hidden].to(embeds.dtype))
        if rows.shape[1] == hidden:
            return {}
        deep = rows[:, hidden:].to(embeds.dtype).reshape(rows.shape[0], -1, hidden)
        return {"deepstack": (dest, deep)}

    def forward(self, inputs_embeds: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[torch.Tensor], meta: AttentionMetadata,
                deepstack: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """[T, hidden] -> the text model's final hidden states [T, hidden], its attention
        over the paged KV cache. ``deepstack``: the image rows' token indices [R] and their
        DeepStack rows [R, layers, hidden], added after each of the first layers."""
        self.step.begin(kv_caches, meta)
        position_ids = positions[:, None, :] if positions.dim() == 2 else positions[None]
        extra = {}
        if self.per_layer_inputs:
            extra["per_layer_inputs"] = self._per_layer_inputs(inputs_embeds.shape[0])
        if deepstack is not None:
            dest, deep = deepstack
            mask = torch.zeros(inputs_embeds.shape[0], dtype=torch.bool,
                               device=inputs_embeds.device)
            mask[dest] = True
            # the text model adds them in token order
            extra = {"visual_pos_masks": mask[None],
                     "deepstack_visual_embeds": list(deep[torch.argsort(dest)].unbind(1))}
        with rotary_ops(self.fused_ops):
            out = self.text_model(inputs_embeds=inputs_embeds[None], position_ids=position_ids,
                                  use_cache=False, return_dict=True, **extra)
        return out.last_hidden_state[0]

    def _per_layer_inputs(self, num_tokens: int) -> torch.Tensor:
        """The text model's per-layer inputs [1, T, layers, width] of the step's token ids
        (kept by `embed_tokens`), each image, video or audio token's as the padding token's."""
        ids = self._step_ids
        if ids is None or ids.shape[0] != num_tokens:
            raise RuntimeError(f"{self.config.model_type}: per-layer inputs need the step's "
                               "token ids, given to embed_tokens before forward")
        if self._media_ids.device != ids.device:
            self._media_ids = self._media_ids.to(ids.device)
        pad = self.text_config.pad_token_id or 0
        ids = torch.where(torch.isin(ids, self._media_ids), pad, ids)
        return self.text_model.get_per_layer_inputs(ids[None], None)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.lm_head(hidden)
        if self.logit_scale is not None:
            logits = logits * self.logit_scale
        if self.final_softcap is not None:
            logits = torch.tanh(logits / self.final_softcap) * self.final_softcap
        if self.suppressed is not None:
            if self.suppressed.device != logits.device:
                self.suppressed = self.suppressed.to(logits.device)
            logits[:, self.suppressed] = torch.finfo(logits.dtype).min
        return logits.float()

    # ---- images --------------------------------------------------------------------------

    def encode_images(self, pixel_values: torch.Tensor,
                      encoder_meta: Sequence[tuple[int, ...]]) -> torch.Tensor:
        """The images' packed tensors (their bytes, in order: `pack_image`) -> each image's
        span as rows [sum of spans, hidden]: the model's image features at its image tokens,
        the text embedding of its other tokens. Images whose tensors agree in every shape
        but the first run through ``get_image_features`` together."""
        layouts = [unpack_meta(m) for m in encoder_meta]
        tensors, at = [], 0
        for layout in layouts:
            tensors.append(unpack_tensors(pixel_values[at:at + layout.nbytes], layout))
            at += layout.nbytes
        features: list[torch.Tensor | None] = [None] * len(layouts)
        groups: dict[tuple, list[int]] = {}
        for i, t in enumerate(tensors):
            key = tuple((k, v.dtype, tuple(v.shape[1:])) for k, v in t.items())
            if "batch_num_images" in t:  # alone in its prompt, or among several
                key += (int(t["batch_num_images"][0]) > 1,)
            groups.setdefault(key, []).append(i)
        for members in groups.values():
            rows = self._features_of([tensors[i] for i in members],
                                     [layouts[i].num_image_tokens for i in members],
                                     pixel_values.device)
            for i, r in zip(members, rows, strict=True):
                features[i] = r
        return torch.cat([self._span_rows(layout, f)
                          for layout, f in zip(layouts, features, strict=True)])

    def _features_of(self, tensors: list[dict[str, torch.Tensor]], counts: list[int],
                     pixel_device: torch.device) -> list[torch.Tensor]:
        """``get_image_features`` of images whose tensors concatenate on their first axis
        -> each image's feature rows (``counts`` of them)."""
        dtype = self.embedding.weight.dtype
        kwargs, hosted = dict(self._feature_options), set()
        for key in tensors[0]:
            if key not in self._feature_args:
                continue
            value = torch.cat([t[key] for t in tensors])
            kwargs[key] = value.to(dtype) if value.is_floating_point() else value
            if value.device != pixel_device:
                hosted.add(key)
        if "batch_num_images" in kwargs:  # images all alone in their prompts, or all not
            n, several = len(tensors), bool(kwargs["batch_num_images"][0] > 1)
            kwargs["batch_num_images"] = torch.tensor([max(n, 2)] if several else [1] * n)
            hosted.discard("batch_num_images")  # read on the host, as transformers makes it
        with rotary_ops(self.fused_ops):
            out = self.grids.call(self._features, kwargs, hosted, pixel_device)
        deep = getattr(out, "deepstack_features", None)
        if hasattr(out, "pooler_output"):  # transformers 5.x: a model output
            out = out.pooler_output if out.pooler_output is not None else out.last_hidden_state
        if self._projector is not None:
            out = self._projector(out)
        width = self.hidden_size
        flat = _rows(out, width)
        if deep and self.row_width > width:  # beside each row, its DeepStack rows
            flat = torch.cat([flat, *(_rows(d, width) for d in deep)], dim=1)
        if flat.shape[0] != sum(counts):
            raise RuntimeError(f"{self.config.model_type}: get_image_features gave "
                               f"{flat.shape[0]} rows for images of {counts} image tokens")
        return list(flat.split(counts))

    def _span_rows(self, layout, features: torch.Tensor) -> torch.Tensor:
        """An image's span: its feature rows at its image tokens, the embeddings of its
        text tokens (markers between an image's tiles) at theirs."""
        if not layout.text_tokens:
            return features.to(self.embedding.weight.dtype)
        length = layout.num_image_tokens + len(layout.text_tokens)
        device = features.device
        at, ids = zip(*layout.text_tokens, strict=True)
        pos = to_device(torch.tensor(at, dtype=torch.int64), device)
        # (a text token's DeepStack columns, if any, are zeros: nothing is added there)
        rows = features.new_zeros(length, features.shape[1], dtype=self.embedding.weight.dtype)
        is_image = torch.ones(length, dtype=torch.bool, device=device)
        is_image[pos] = False
        rows[is_image] = features.to(rows.dtype)
        # (an encoder step may run on one rank alone: a split vocabulary's rows from the host)
        rows[pos, :self.hidden_size] = self.embedding.rows_alone(list(ids), device) \
            if isinstance(self.embedding, VocabShare) else \
            self._embed(to_device(torch.tensor(ids, dtype=torch.int64), device))
        return rows
