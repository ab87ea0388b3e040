"""Quantized checkpoints: which ones load, and their weights read back to full precision.

Block-wise FP8 (`"quant_method": "fp8"` with `weight_block_size`, the format of Qwen's own
`-FP8` releases and DeepSeek's): each quantized `X.weight` is float8 (e4m3) beside
`X.weight_scale_inv`, one float32 scale per block of `weight_block_size` rows by columns
(the last block of a dimension may be partial); the weight is the product. Loading reads
them back as `fp8 * scale` in float32, cast to the model's dtype as the parameter takes it
(what transformers does where it has no FP8 kernels), so such a model holds and computes in
its dtype, not in FP8. Any other quantization method is refused by name as the checkpoint's
config is read, before anything loads.

`quantize_fp8_checkpoint` writes a checkpoint folder in that format (tests, benchmarks).

FP8 KV cache scales (`kv_cache_scales`): per-tensor ``k_scale`` / ``v_scale`` of each decoder
layer's attention, under the names compressed-tensors and ModelOpt checkpoints give them
(``layers.N.self_attn.k_scale``, ``layers.N.self_attn.k_proj.k_scale``,
``layers.N.self_attn.qkv_proj.k_scale``; the older ``kv_scale``: both). They are no
weights: the loader leaves every attention scale (`is_attention_scale`, q and softmax
scales too) to this function.
"""

from __future__ import annotations

import json
import logging
import re
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from vlmserve.layers.fp8 import FP8_DTYPE, Fp8Weight, scale_grid

logger = logging.getLogger(__name__)
SCALE_SUFFIX = "_scale_inv"
SUPPORTED = "fp8 (block-wise: weight_block_size, as Qwen's -FP8 checkpoints)"


@dataclass(frozen=True)
class Fp8BlockQuant:
    """A block-wise FP8 checkpoint's layout: rows x columns a weight scale covers."""

    block: tuple[int, int]

    def dequantize(self, weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        """``weight`` (float8, [rows, cols]) times its block's scale, in float32."""
        if weight.dim() != 2 or scale.dim() != 2:
            raise ValueError(f"a block-wise FP8 weight and its scale are matrices, not "
                             f"{tuple(weight.shape)} and {tuple(scale.shape)}")
        (rows, cols), (br, bc) = weight.shape, self.block
        grid = scale_grid(weight.shape, self.block)
        if tuple(scale.shape) != grid:
            raise ValueError(f"a weight of {rows}x{cols} in blocks of {br}x{bc} has "
                             f"{grid[0]}x{grid[1]} scales, not {scale.shape[0]}x{scale.shape[1]}")
        return Fp8Weight(weight, self.scales(scale), self.block).dequantize(torch.float32)

    @staticmethod
    def scales(scale: torch.Tensor) -> torch.Tensor:
        """A checkpoint's scales as float32 (E8M0 bytes: 2 ** (byte - 127))."""
        if scale.dtype == torch.uint8:
            return (scale.float() - 127.0).exp2()
        return scale.float()


def checkpoint_quantization(hf_config) -> Fp8BlockQuant | None:
    """The checkpoint's quantization (None: none); an unsupported one raises `ValueError`
    naming it."""
    q = getattr(hf_config, "quantization_config", None)
    if q is None:
        return None
    q = q if isinstance(q, dict) else q.to_dict()
    method = q.get("quant_method")
    block = q.get("weight_block_size")
    if method == "fp8" and block is not None and len(block) == 2 and min(block) > 0:
        return Fp8BlockQuant((int(block[0]), int(block[1])))
    what = f"{method!r}" + (" without weight_block_size" if method == "fp8" else "")
    raise ValueError(f"the checkpoint is quantized with {what}, which vlmserve does not "
                     f"load; it loads {SUPPORTED} and unquantized checkpoints")


def quantize_fp8_block(weight: torch.Tensor, block: tuple[int, int]
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """``weight`` [rows, cols] as float8 e4m3 and its float32 block scales (each block's
    largest magnitude maps to e4m3's largest finite value, 448)."""
    rows, cols = weight.shape
    br, bc = block
    gr, gc = scale_grid(weight.shape, block)
    padded = torch.zeros(gr * br, gc * bc, dtype=torch.float32)
    padded[:rows, :cols] = weight.float()
    blocks = padded.view(gr, br, gc, bc)
    scale = blocks.abs().amax(dim=(1, 3)) / torch.finfo(FP8_DTYPE).max
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = (blocks / scale[:, None, :, None]).view(gr * br, gc * bc)[:rows, :cols]
    return q.to(FP8_DTYPE).contiguous(), scale.contiguous()


def _default_include(name: str, tensor: torch.Tensor) -> bool:
    """The language model's projections, as Qwen's FP8 releases quantize them (embeddings,
    lm_head, norms and the vision tower stay)."""
    return (tensor.dim() == 2 and name.endswith("proj.weight")
            and "visual" not in name and "vision" not in name)


def quantize_fp8_checkpoint(src: str | Path, dst: str | Path, block: tuple[int, int] = (128, 128),
                            include: Callable[[str, torch.Tensor], bool] = _default_include
                            ) -> Path:
    """A copy of checkpoint folder ``src`` at ``dst`` with the weights ``include`` picks
    stored block-wise FP8 and ``quantization_config`` in its config.json."""
    src, dst = Path(src), Path(dst)
    dst.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        if f.is_file() and f.suffix != ".safetensors" and f.name != "config.json":
            shutil.copy2(f, dst / f.name)
    quantized, kept = [], []
    for f in sorted(src.glob("*.safetensors")):
        out = {}
        for name, t in load_file(str(f)).items():
            if include(name, t):
                out[name], out[name + SCALE_SUFFIX] = quantize_fp8_block(t, block)
                quantized.append(name)
            else:
                out[name] = t.contiguous()
                if t.dim() == 2 and name.endswith(".weight"):
                    kept.append(name.removesuffix(".weight").split("model.", 1)[-1])
        save_file(out, str(dst / f.name), metadata={"format": "pt"})
    index = dst / "model.safetensors.index.json"
    if index.is_file():  # the scales live beside their weights
        meta = json.loads(index.read_text())
        meta["weight_map"].update({n + SCALE_SUFFIX: meta["weight_map"][n] for n in quantized})
        index.write_text(json.dumps(meta, indent=2))
    config = json.loads((src / "config.json").read_text())
    # the matrices left as they are, named so that transformers' loader (a suffix of its
    # module names) leaves them too
    config["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3",
                                     "activation_scheme": "dynamic",
                                     "weight_block_size": list(block),
                                     "modules_to_not_convert": sorted(kept)}
    (dst / "config.json").write_text(json.dumps(config, indent=2))
    if not quantized:
        raise ValueError(f"no weight of {src} was chosen for FP8")
    return dst


# an attention layer's activation scale: layers.N.self_attn[.{q,k,v,qkv}_proj].{q,k,v,kv,prob}_scale
_ATTENTION_SCALE = re.compile(
    r"(?:^|\.)layers\.(\d+)\.self_attn\.(?:(?:[qkv]|qkv)_proj\.)?(q|k|v|kv|prob)_scale$")


def is_attention_scale(name: str) -> bool:
    """Whether checkpoint tensor `name` is an attention layer's activation scale (no weight:
    the FP8 KV cache's scales are read by `kv_cache_scales`, the others unused)."""
    return _ATTENTION_SCALE.search(name) is not None


def kv_cache_scales(path: str | Path, num_layers: int, skip: tuple[str, ...] = ()
                    ) -> dict[int, tuple[float, float]]:
    """(k_scale, v_scale) of each decoder layer whose checkpoint gives them (a missing one
    1.0); `skip`: name prefixes that are no decoder (the image encoder's; the
    multi-token-prediction layers', ``mtp.``, always). A scale that is not one value (per
    head, per channel) is refused: the cache's scales are per tensor."""
    skip = (*skip, "mtp.", "model.mtp.")
    found: dict[int, dict[str, float]] = {}
    for f in sorted(Path(path).glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as fh:
            for name in fh.keys():
                m = _ATTENTION_SCALE.search(name)
                if m is None or name.startswith(skip) or m.group(2) not in ("k", "v", "kv"):
                    continue
                layer, t = int(m.group(1)), fh.get_tensor(name)
                if layer >= num_layers:
                    raise ValueError(f"{name}: the model has {num_layers} decoder layers")
                if t.numel() != 1:
                    raise ValueError(f"{name}: the FP8 KV cache takes one scale per layer's "
                                     f"keys and values, not a tensor of {list(t.shape)}")
                kinds = ("k", "v") if m.group(2) == "kv" else (m.group(2),)
                found.setdefault(layer, {}).update({k: float(t.float()) for k in kinds})
    return {layer: (s.get("k", 1.0), s.get("v", 1.0)) for layer, s in found.items()}
