"""Build a model from a Hugging Face checkpoint folder (config.json + *.safetensors)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import safe_open
from transformers import AutoConfig

from vlmserve.models.registry import resolve_model_class


def load_hf_config(path: str | Path):
    if not (Path(path) / "config.json").is_file():
        raise ValueError(f"{str(path)!r} is not a Hugging Face checkpoint folder: it has no "
                         "config.json")
    return AutoConfig.from_pretrained(str(path), local_files_only=True)


def iter_safetensors(path: str | Path, prefixes: tuple[str, ...] = ()
                     ) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) of the checkpoint's weights; with `prefixes`, only the names starting
    with one of them (no other tensor is read from disk)."""
    files = sorted(Path(path).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors files in {path}")
    for f in files:
        with safe_open(str(f), framework="pt") as fh:
            for name in fh.keys():
                if not prefixes or name.startswith(prefixes):
                    yield name, fh.get_tensor(name)


def build_model(hf_config, dtype: torch.dtype, device: torch.device) -> torch.nn.Module:
    """The model with uninitialised weights on `device`."""
    cls = resolve_model_class(hf_config)
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = cls(hf_config)
    finally:
        torch.set_default_dtype(old)
    return model.eval()


def load_model(path: str | Path, hf_config, dtype: torch.dtype, device: torch.device
               ) -> torch.nn.Module:
    model = build_model(hf_config, dtype, device)
    loaded = model.load_weights(iter_safetensors(path))
    missing = {n for n, _ in model.named_parameters()} - loaded
    if missing:
        raise ValueError(f"checkpoint {path} lacks weights: {sorted(missing)[:8]}")
    return model
