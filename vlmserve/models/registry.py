"""Model classes by the `architectures` name of a checkpoint's config.json (imported lazily)."""

from __future__ import annotations

import importlib

from vlmserve.models.interfaces import check_model_class

_MODELS: dict[str, tuple[str, str]] = {
    "Qwen2VLForConditionalGeneration": ("vlmserve.models.qwen2_vl",
                                        "Qwen2VLForConditionalGeneration"),
    "Qwen2_5_VLForConditionalGeneration": ("vlmserve.models.qwen2_vl",
                                           "Qwen2_5_VLForConditionalGeneration"),
    "Qwen3VLForConditionalGeneration": ("vlmserve.models.qwen3_vl",
                                        "Qwen3VLForConditionalGeneration"),
    # Qwen3-VL-MoE: the same class (the decoder takes its sparse layers from the config)
    "Qwen3VLMoeForConditionalGeneration": ("vlmserve.models.qwen3_vl",
                                           "Qwen3VLForConditionalGeneration"),
    "Qwen3_5ForConditionalGeneration": ("vlmserve.models.qwen3_5",
                                        "Qwen3_5ForConditionalGeneration"),
    "Qwen3_5MoeForConditionalGeneration": ("vlmserve.models.qwen3_5",
                                           "Qwen3_5MoeForConditionalGeneration"),
    "LlavaForConditionalGeneration": ("vlmserve.models.llava", "LlavaForConditionalGeneration"),
    "Gemma3ForConditionalGeneration": ("vlmserve.models.gemma3",
                                       "Gemma3ForConditionalGeneration"),
    "LlavaNextForConditionalGeneration": ("vlmserve.models.llava_next",
                                          "LlavaNextForConditionalGeneration"),
}


def supported_architectures() -> list[str]:
    return sorted(_MODELS)


def image_row_width(hf_config) -> int:
    """Width of the model's image embedding rows (the language model's hidden size, or wider:
    `image_row_width` of its class)."""
    return resolve_model_class(hf_config).image_row_width(hf_config)


MODEL_IMPLS = ("auto", "native", "transformers")


def images_whole(hf_config) -> bool:
    """Whether the model reads each image's tokens both ways, so that an image's tokens are
    computed in one prefill chunk (its class's `reads_images_both_ways`)."""
    return bool(resolve_model_class(hf_config).reads_images_both_ways(hf_config))


def prompt_whole(hf_config) -> bool:
    """Whether the model reads its whole prompt both ways (PaliGemma's prefix): each prompt is
    then computed in one step and no prefix of it is cached (its class's
    `reads_prompt_both_ways`)."""
    return bool(resolve_model_class(hf_config).reads_prompt_both_ways(hf_config))


def resolve_model_class(hf_config) -> type:
    """The class that runs a checkpoint of config ``hf_config``, by its `model_impl` (set by
    `loader.load_hf_config`; default auto): the native class of its architecture, else (or
    with "transformers") the transformers backend, which refuses in one line a model it
    cannot serve."""
    impl = getattr(hf_config, "vlmserve_model_impl", "auto")
    archs = list(getattr(hf_config, "architectures", None) or [])
    if impl != "transformers":
        for arch in archs:
            if arch in _MODELS:
                module, name = _MODELS[arch]
                return check_model_class(getattr(importlib.import_module(module), name))
        if impl == "native":
            raise ValueError(f"no native implementation of {archs}; native ones: "
                             f"{', '.join(supported_architectures())} (model_impl auto or "
                             "transformers runs it through transformers)")
    from vlmserve.models.transformers_backend import TransformersVLM, check_supported

    check_supported(hf_config)
    return check_model_class(TransformersVLM)
