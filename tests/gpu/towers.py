"""A full-size vision tower of a built-in preset on CUDA, random bf16 weights."""

from __future__ import annotations

import torch


def full_size_tower(preset: str) -> torch.nn.Module:
    from vlmserve.models.builtin import build_config
    from vlmserve.models.registry import resolve_model_class

    cfg = build_config(preset)
    cls = resolve_model_class(cfg).vision_cls
    torch.manual_seed(0)
    with torch.device("cuda"):
        tower = cls(cfg.vision_config).to(torch.bfloat16).eval()
    for p in tower.parameters():
        torch.nn.init.normal_(p, std=0.02)
    return tower
