"""What the engine and the front ends read about a model without building it: its text
config, end-of-sequence ids, default sampling parameters and input processor."""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path
from typing import Any

import torch
from transformers import GenerationConfig

from vlmserve.config import EngineConfig, ModelConfig
from vlmserve.models.builtin import resolve_model
from vlmserve.models.hub import check_remote_code
from vlmserve.models.loader import load_hf_config
from vlmserve.models.registry import resolve_model_class
from vlmserve.sampling_params import generation_defaults
from vlmserve.utils import resolve_dtype

logger = logging.getLogger(__name__)


def text_config(hf_config):
    return getattr(hf_config, "text_config", None) or hf_config


def max_model_len(mc: ModelConfig, hf_config) -> int:
    """The longest prompt + output: ``mc.max_model_len``, or the model's context length
    (its text config's max_position_embeddings); more than that is refused, as vLLM does."""
    context = text_config(hf_config).max_position_embeddings
    if mc.max_model_len is None:
        return context
    if mc.max_model_len > context:
        raise ValueError(f"max_model_len={mc.max_model_len} is more than the model's context "
                         f"length of {context} (max_position_embeddings in its config.json)")
    return mc.max_model_len


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


def local_model_config(mc: ModelConfig) -> ModelConfig:
    """``mc`` with its model and tokenizer (``--tokenizer``) named by their local folders:
    Hugging Face ids downloaded or found in the cache, built-in models created; refused in
    one line where loading would run the checkpoint's own code without
    ``trust_remote_code``. Called once where the options are parsed, so the folders are what
    every other process gets; folders come back as they are, without a Hub request."""
    model = resolve_model(mc.model, mc.revision, mc.download_dir, mc.trust_remote_code)
    check_remote_code(mc.model, model, mc.trust_remote_code)
    tokenizer = None
    if mc.tokenizer is not None:
        # the model's revision is no revision of another repository
        revision = mc.tokenizer_revision or (mc.revision if mc.tokenizer == mc.model else None)
        tokenizer = resolve_model(mc.tokenizer, revision, mc.download_dir, mc.trust_remote_code)
        check_remote_code(mc.tokenizer, tokenizer, mc.trust_remote_code)
    return dataclasses.replace(mc, model=str(model),
                               tokenizer=None if tokenizer is None else str(tokenizer))


def local_engine_config(config: EngineConfig) -> EngineConfig:
    """``config`` with `local_model_config` applied to its model options."""
    return dataclasses.replace(config, model_config=local_model_config(config.model_config))


def model_processor(path: str | Path, hf_config, mc: ModelConfig):
    """The model's input processor for the checkpoint at ``path`` with the engine's options:
    ``mm_processor_kwargs``, the tokenizer folder (``--tokenizer``), ``trust_remote_code``,
    the model's dtype on its device."""
    return resolve_model_class(hf_config).input_processor_cls(
        path, hf_config, mc.mm_processor_kwargs, tokenizer=mc.tokenizer,
        trust_remote_code=mc.trust_remote_code,
        dtype=model_dtype(mc))


def model_dtype(mc: ModelConfig) -> torch.dtype:
    """The dtype the model computes in, as its engine resolves it, known in any process (a
    front end that sees no GPU still knows the engine's ``--device cuda``)."""
    device = mc.device if mc.device != "auto" else (
        "cuda" if torch.cuda.is_available() else "cpu")
    return resolve_dtype(mc.dtype, torch.device(device))


def load_model_processor(mc: ModelConfig | str):
    """(checkpoint path, HF config, `model_processor`) for the model options ``mc`` (or a
    model with the default options), its model a folder (`local_model_config`) or else a
    built-in name or Hub id, resolved here."""
    if isinstance(mc, str):
        mc = ModelConfig(model=mc)
    path = resolve_model(mc.model, mc.revision, mc.download_dir, mc.trust_remote_code)
    hf_config = load_hf_config(path, mc.model_impl, trust_remote_code=mc.trust_remote_code)
    return path, hf_config, model_processor(path, hf_config, mc)
