"""What the transformers backend (`models/transformers_backend.py`) knows of a model family from
its config: each text layer's window, cache kind, KV shape and whether it reads the step's
both-ways spans; the families whose images or whole prompt attend both ways, whose positions
count from 1, whose text adds DeepStack features, whose image codes are suppressed.

What the backend cannot serve is refused at load in one line (`check_supported`): a model
whose text layers are not all attention or short convolutions (linear attention, state-space
layers), whose whole text attends both ways, whose layers' KV heads do not divide the most any
layer has, one of `_REFUSED` (image features inside the decoder or depending on the prompt,
visual-vocabulary markers), or one with no image-text-to-text class in transformers.
"""

from __future__ import annotations

from vlmserve.core.kv_cache_groups import FULL, LayerKind
from vlmserve.layers.attention import Window


def text_config(hf_config):
    return getattr(hf_config, "text_config", None) or hf_config


def hf_model_class(hf_config) -> type:
    """transformers' image-text-to-text class of a config; `ValueError` if it has none."""
    import transformers
    from transformers.models.auto.modeling_auto import MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES

    name = MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES.get(hf_config.model_type)
    archs = list(getattr(hf_config, "architectures", None) or [])
    for arch in archs:
        if hasattr(transformers, arch) and arch.endswith("ForConditionalGeneration"):
            name = arch
    if name is None or not hasattr(transformers, name):
        named = ", ".join(archs) or "no architectures"
        raise ValueError(f"model type {hf_config.model_type!r} ({named}) is not an "
                         f"image-text-to-text model of transformers {transformers.__version__}")
    return getattr(transformers, name)


_ATTENTION_LAYERS = {"full_attention": None, "sliding_attention": "sliding",
                     "chunked_attention": "chunked"}
# layer kinds that keep a state per sequence in the engine's state pools (no window, no KV)
_CONV_LAYERS = frozenset({"conv"})  # LFM2's gated short convolutions (`short_conv`)
# models whose images' tokens attend to each other both ways (in prefill; on every layer)
_IMAGES_BOTH_WAYS = frozenset({"gemma3", "shieldgemma2"})
# models whose images' tokens attend to each other both ways on their sliding layers alone,
# within the window, where their text config's `use_bidirectional_attention` is "vision"
_IMAGES_BOTH_WAYS_SLIDING = frozenset({"gemma4"})
# models whose text model adds DeepStack features of the images after its first layers
# (`deepstack_visual_embeds` at `visual_pos_masks`)
_DEEPSTACK = frozenset({"qwen3_vl", "qwen3_vl_moe"})
# models whose forward sets the logits of their image codes to the minimum (Emu3's does not)
_SUPPRESS_IMAGE_CODES = frozenset({"chameleon"})
# models the backend cannot serve exactly, and why (each a one-line refusal at load)
_REFUSED = {
    **dict.fromkeys(("granite4_vision", "granite_docling"),
                    "its image features are added inside the decoder's layers, which the "
                    "transformers backend does not carry"),
    # InstructBLIP's Q-Former reads the prompt: an image's rows would not be its own alone
    "instructblip": "its image features depend on the prompt's text, which the engine's "
                    "caches of image rows do not allow for",
    "ovis2": "the tokens around its images embed from its visual vocabulary, which the "
             "transformers backend does not carry",
}
# models whose whole prompt (image and text) attends both ways in prefill (PaliGemma's prefix):
# a prompt is computed in one step, and no prefix of it is cached (its keys depend on what
# follows)
_PROMPT_BOTH_WAYS = frozenset({"paligemma"})
# models whose positions count from 1 (PaliGemma's, as its generate sets them)
_POSITIONS_FROM_ONE = frozenset({"paligemma"})


def layer_windows(hf_config) -> list[Window | None]:
    """Each text layer's window (None: full causal attention) from its config: its
    `layer_types` (sliding: `sliding_window`; chunked: `attention_chunk_size`), or one
    `sliding_window` for every layer where the config turns it on; None too for a
    short-convolution layer (it attends to nothing). `ValueError` naming a layer kind that
    is neither attention nor a short convolution (linear attention, state-space layers)."""
    tc = text_config(hf_config)
    kinds = getattr(tc, "layer_types", None)
    if kinds is None:
        window = getattr(tc, "sliding_window", None)
        on = window and getattr(tc, "use_sliding_window", True)
        return [Window("sliding", int(window)) if on else None] * tc.num_hidden_layers
    unknown = sorted(set(kinds) - set(_ATTENTION_LAYERS) - _CONV_LAYERS)
    if unknown:
        raise ValueError(f"{hf_config.model_type}: layers of kind {unknown} are not served by "
                         "the transformers backend (it serves attention layers: full, "
                         "sliding-window, chunked; and short convolutions)")
    out = []
    clips = hf_config.model_type in _IMAGES_BOTH_WAYS_SLIDING
    for kind in kinds:
        if kind in _CONV_LAYERS:
            out.append(None)
        elif _ATTENTION_LAYERS[kind] == "sliding":
            out.append(Window("sliding", int(tc.sliding_window), clips_spans=clips))
        elif _ATTENTION_LAYERS[kind] == "chunked":
            out.append(Window("chunked", int(tc.attention_chunk_size)))
        else:
            out.append(None)
    return out


def layer_kinds(hf_config) -> list[LayerKind]:
    """Each text layer's cache kind: a short convolution's state slots ("linear"), a
    sliding or chunked layer's window (its cache group frees the blocks the window has left),
    else full attention."""
    types = getattr(text_config(hf_config), "layer_types", None)
    out = []
    for i, window in enumerate(layer_windows(hf_config)):
        if types is not None and types[i] in _CONV_LAYERS:
            out.append(LayerKind("linear"))
        else:
            out.append(FULL if window is None else LayerKind(window.kind, window.size))
    return out


def images_both_ways_sliding(hf_config) -> bool:
    """Gemma 4 with `use_bidirectional_attention="vision"`: images both ways on its sliding
    layers alone."""
    return hf_config.model_type in _IMAGES_BOTH_WAYS_SLIDING and getattr(
        text_config(hf_config), "use_bidirectional_attention", None) == "vision"


def layers_both_ways(hf_config) -> list[bool]:
    """Each text layer: whether it reads the step's both-ways spans (images', or a prompt's,
    where the model has them): every layer, but Gemma 4's sliding layers alone."""
    tc = text_config(hf_config)
    if hf_config.model_type in _IMAGES_BOTH_WAYS_SLIDING:
        sliding = images_both_ways_sliding(hf_config)
        return [sliding and kind == "sliding_attention" for kind in tc.layer_types]
    return [True] * tc.num_hidden_layers


def layer_kv_shapes(hf_config) -> list[tuple[int, int]]:
    """Each text layer's (KV heads, head dim): the config's, or its `per_layer_config`'s where
    layers differ (Gemma 4's full-attention layers)."""
    return [_kv_shape(c) for c in layer_configs(hf_config)]


def layer_configs(hf_config) -> list:
    """Each text layer's config: the text config, or its `per_layer_config`'s view of the
    layer where layers differ (Gemma 4's; its global values are not to be read)."""
    tc = text_config(hf_config)
    per_layer = getattr(tc, "per_layer_config", None)
    return [tc if per_layer is None else per_layer[i] for i in range(tc.num_hidden_layers)]


def kv_sources(hf_config) -> dict[int, int]:
    """Each text layer that reuses an earlier layer's keys and values (Gemma 4's last
    `num_kv_shared_layers`: `kv_sharing_modes` "reuse") -> that layer (the one of its kind
    that stores them); {} for a model without (or a transformers that does not say)."""
    tc = text_config(hf_config)
    modes = getattr(tc, "kv_sharing_modes", None) if hasattr(tc, "num_kv_shared_layers") \
        else None
    if not modes or "reuse" not in modes:
        return {}
    types = tc.layer_types
    store = {types[i]: i for i, mode in enumerate(modes) if mode == "store"}
    missing = sorted({types[i] for i, m in enumerate(modes) if m == "reuse"} - set(store))
    if missing:
        raise ValueError(f"{hf_config.model_type}: layers of kind {missing} reuse keys and "
                         "values no layer of their kind stores")
    return {i: store[types[i]] for i, mode in enumerate(modes) if mode == "reuse"}


def _kv_shape(c) -> tuple[int, int]:
    """(KV heads, head dim) of a text config, or of one layer's."""
    return (getattr(c, "num_key_value_heads", None) or c.num_attention_heads,
            getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads)


def deepstack_layers(hf_config) -> int:
    """How many DeepStack features of its images the model's text model adds (Qwen3-VL's
    `deepstack_visual_indexes`); 0 for a model that has none."""
    if hf_config.model_type not in _DEEPSTACK:
        return 0
    return len(hf_config.vision_config.deepstack_visual_indexes)


def check_supported(hf_config) -> None:
    """Refuse, in one line, a model the backend cannot serve exactly (`ValueError`)."""
    kind = hf_config.model_type
    layer_windows(hf_config)
    layer_kv_shapes(hf_config)
    if kind in _REFUSED:
        raise ValueError(f"{kind}: {_REFUSED[kind]}")
    if getattr(text_config(hf_config), "use_bidirectional_attention", None) == "all":
        raise ValueError(f"{kind}: its text attends both ways over the whole sequence "
                         "(use_bidirectional_attention='all'), an encoder's attention, not a "
                         "generator's")
    hf_model_class(hf_config)




def images_both_ways(hf_config) -> bool:
    """Whether the family's images attend to each other both ways (on some layers at least),
    so that an image stays whole inside one prefill chunk."""
    return hf_config.model_type in _IMAGES_BOTH_WAYS or images_both_ways_sliding(hf_config)


def prompt_both_ways(hf_config) -> bool:
    """Whether the family's whole prompt attends both ways in prefill (PaliGemma's prefix)."""
    return hf_config.model_type in _PROMPT_BOTH_WAYS


def positions_from_one(hf_config) -> bool:
    """Whether the family's positions count from 1 (PaliGemma's)."""
    return hf_config.model_type in _POSITIONS_FROM_ONE


def suppresses_image_codes(hf_config) -> bool:
    """Whether the family's forward sets the logits of its image codes to the minimum."""
    return hf_config.model_type in _SUPPRESS_IMAGE_CODES
