"""What the engine and the front ends read about a model without building it: its text
config, end-of-sequence ids, default sampling parameters and input processor."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from transformers import GenerationConfig

from vlmserve.config import EngineConfig, ModelConfig
from vlmserve.models.builtin import resolve_model
from vlmserve.models.loader import load_hf_config
from vlmserve.models.registry import resolve_model_class
from vlmserve.sampling_params import generation_defaults

logger = logging.getLogger(__name__)


def text_config(hf_config):
    return getattr(hf_config, "text_config", None) or hf_config


def eos_token_ids(path, tokenizer) -> tuple[int, ...]:
    ids: list[int] = []
    try:
        gen = GenerationConfig.from_pretrained(str(path), local_files_only=True)
        eos = gen.eos_token_id
        ids.extend(eos if isinstance(eos, list) else [eos] if eos is not None else [])
    except OSError:
        pass
    if tokenizer.eos_token_id is not None and tokenizer.eos_token_id not in ids:
        ids.append(tokenizer.eos_token_id)
    return tuple(ids)


def sampling_defaults(config: EngineConfig, model_path: str | Path) -> dict[str, Any]:
    """The default sampling parameters of requests that leave them unset
    (``--generation-config``: by default the model's generation_config.json), logged when
    there are any."""
    defaults = generation_defaults(config.model_config.generation_config, model_path)
    if defaults:
        logger.info("default sampling parameters from the model's generation config "
                    "(--generation-config vllm for none): %s", defaults)
    return defaults


def load_model_processor(mc: ModelConfig):
    """(checkpoint path, HF config, the model's input processor with the engine's
    `mm_processor_kwargs`) for a model config (its model name or folder, `model_impl`)."""
    path = resolve_model(mc.model)
    hf_config = load_hf_config(path, mc.model_impl)
    model_cls = resolve_model_class(hf_config)
    return path, hf_config, model_cls.input_processor_cls(path, hf_config,
                                                          mc.mm_processor_kwargs)
