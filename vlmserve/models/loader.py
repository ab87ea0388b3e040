"""Build a model from a Hugging Face checkpoint folder (config.json + *.safetensors).

The model is built with its parameters on the meta device (its buffers computed on the
device), so that a tensor-parallel rank can swap in modules of its shard size before any
weight exists; then every parameter is allocated once, at its final size, and filled from the
checkpoint, a tensor-parallel rank reading only its slices of the split tensors (the image
encoder's too with `shard_vision`: `mm_encoder_tp_mode="weights"`). A block-wise FP8
checkpoint's projections are made FP8 holders before that allocation (`_hold_fp8`), and its
other FP8 weights are read back as they load (models/quantization.py)."""

from __future__ import annotations

import collections
import contextlib
import logging
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn
from transformers import AutoConfig

from vlmserve.distributed.parallel_state import TensorParallel
from vlmserve.layers.fp8 import HoldsFp8, hold_fp8
from vlmserve.layers.linear import MergedLinear
from vlmserve.layers.tensor_parallel import ShardPlan, TensorSlice, TPLayout, shard_model
from vlmserve.layers.vision_tensor_parallel import VisionShardPlan, shard_vision_encoder
from vlmserve.models.quantization import (
    SCALE_SUFFIX,
    Fp8BlockQuant,
    checkpoint_quantization,
    is_attention_scale,
    quantize_fp8_block,
)
from vlmserve.models.registry import MODEL_IMPLS, resolve_model_class

logger = logging.getLogger(__name__)


def load_hf_config(path: str | Path, model_impl: str = "auto", trust_remote_code: bool = False):
    """The checkpoint's transformers config (its own config class only with
    ``trust_remote_code``); a quantization it cannot load raises `ValueError` naming it
    (models/quantization.py), before anything loads. ``model_impl`` (`ModelConfig.model_impl`)
    goes with it: the model class is chosen by it (`registry.resolve_model_class`)."""
    if not (Path(path) / "config.json").is_file():
        raise ValueError(f"{str(path)!r} is not a Hugging Face checkpoint folder: it has no "
                         "config.json")
    config = AutoConfig.from_pretrained(str(path), local_files_only=True,
                                        trust_remote_code=trust_remote_code)
    checkpoint_quantization(config)
    if model_impl not in MODEL_IMPLS:
        raise ValueError(f"model_impl {model_impl!r}: one of {', '.join(MODEL_IMPLS)}")
    config.vlmserve_model_impl = model_impl
    return config


def iter_safetensors(path: str | Path, prefixes: tuple[str, ...] = (),
                     slice_for: Callable[[str], TensorSlice | None] | None = None,
                     quant: Fp8BlockQuant | None = None, raw: frozenset[str] = frozenset()
                     ) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) of the checkpoint's weights; with `prefixes`, only the names starting
    with one of them (no other tensor is read from disk). `slice_for(name)`: the part of that
    tensor to read instead of all of it, or None. With `quant`, FP8 weights come back
    dequantized (float32) under their own names and their scales are not given, except
    those named in `raw`: they and their scales come as they are (for a model that holds
    them as FP8). Attention layers' activation scales (an FP8 KV cache's) are no weights:
    left out (`quantization.kv_cache_scales` reads them)."""
    files = sorted(Path(path).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors files in {path}")
    scales = {}  # a quantized weight's scale may sit in another file
    if quant is not None:
        for f in files:
            with safe_open(str(f), framework="pt") as fh:
                scales.update({n: f for n in fh.keys() if n.endswith(SCALE_SUFFIX)})
    for f in files:
        with safe_open(str(f), framework="pt") as fh:
            for name in fh.keys():
                if is_attention_scale(name):
                    continue
                if prefixes and not name.startswith(prefixes) or name in scales and (
                        name[:-len(SCALE_SUFFIX)] not in raw):
                    continue
                if name in raw or name in scales:  # held as FP8: weight, then scale
                    yield name, _raw_part(fh, name, slice_for, quant)
                    continue
                part = slice_for(name) if slice_for is not None else None
                whole = fh.get_slice(name)
                if name + SCALE_SUFFIX in scales:  # the whole weight, read back, then its part
                    with safe_open(str(scales[name + SCALE_SUFFIX]), framework="pt") as sh:
                        whole = quant.dequantize(whole[:], sh.get_tensor(name + SCALE_SUFFIX))
                elif part is None:
                    yield name, fh.get_tensor(name)
                    continue
                yield name, whole if part is None else _part(whole, part)


def _raw_part(fh, name: str, slice_for, quant: Fp8BlockQuant) -> torch.Tensor:
    """An FP8 weight, or its scale (as float32), as this rank holds it: the weight's part,
    and the scale's blocks of that part (`_fp8_part`)."""
    is_scale = name.endswith(SCALE_SUFFIX)
    part = slice_for(name.removesuffix(SCALE_SUFFIX)) if slice_for is not None else None
    if part is None:
        t = fh.get_tensor(name)
    else:
        t = _part(fh.get_slice(name), _fp8_part(part, quant.block) if is_scale else part)
    return quant.scales(t) if is_scale else t


def _fp8_part(part: TensorSlice, block: tuple[int, int]) -> TensorSlice:
    """The scale blocks of a weight's part (which starts on a block: `_hold_fp8`)."""
    b = block[part.dim]
    return TensorSlice(part.dim, part.start // b, -(-part.stop // b),
                       -(-(part.stop - part.start) // b))


def _part(whole, part: TensorSlice) -> torch.Tensor:
    """`part` of a tensor, or of a safetensors slice (only that part read from disk)."""
    if part.spans:  # a fused q/k/v: the rows of each part
        t = torch.cat([whole[a:b] for a, b in part.spans])
    elif part.dim == 0:
        t = whole[part.start:part.stop]
    else:
        t = whole[:, part.start:part.stop]
    if part.dim == 0 and t.shape[0] < part.size:  # the last vocabulary shard
        pad = torch.zeros((part.size - t.shape[0], *t.shape[1:]), dtype=t.dtype)
        t = torch.cat([t, pad])
    return t


_META_LOCK = threading.Lock()
# threads building a model now, with how deep (see `_parameters_on_meta`)
_META_THREADS: collections.Counter[int] = collections.Counter()
_ORIGINALS: dict[str, Callable] = {}  # what the patches stand in for while they are installed


@contextlib.contextmanager
def _parameters_on_meta() -> Iterator[None]:
    """In this thread, every parameter registered meanwhile is moved to the meta device as it
    is created, and `torch.nn.init`'s in-place initialisers do nothing (the checkpoint sets
    every weight; on meta tensors they would pull in torch's Python decompositions, ~70 MB per
    process); buffers stay where they are made. The patches are installed while any thread
    is inside and act only for those threads: other threads' modules are built as usual."""
    me = threading.get_ident()
    with _META_LOCK:
        if not _META_THREADS:
            _install_meta_patches()
        _META_THREADS[me] += 1
    try:
        yield
    finally:
        with _META_LOCK:
            _META_THREADS[me] -= 1
            if not _META_THREADS[me]:
                del _META_THREADS[me]
            if not _META_THREADS:
                nn.Module.register_parameter = _ORIGINALS.pop("register_parameter")
                for name, fn in list(_ORIGINALS.items()):
                    setattr(nn.init, name, fn)
                _ORIGINALS.clear()


def _install_meta_patches() -> None:
    register = _ORIGINALS["register_parameter"] = nn.Module.register_parameter

    def on_meta(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
        if (param is not None and param.device.type != "meta"
                and threading.get_ident() in _META_THREADS):
            param = nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)
        register(module, name, param)

    def skipping(fn: Callable) -> Callable:
        def init(tensor, *args, **kwargs):
            if threading.get_ident() in _META_THREADS:
                return tensor
            return fn(tensor, *args, **kwargs)
        return init

    nn.Module.register_parameter = on_meta
    for name, fn in list(vars(nn.init).items()):
        if name.endswith("_") and not name.startswith("__") and callable(fn):
            _ORIGINALS[name] = fn
            setattr(nn.init, name, skipping(fn))


def _materialize(model: nn.Module, device: torch.device) -> None:
    """Each meta parameter allocated (uninitialised) on `device`, tied ones once."""
    made: dict[int, tuple[nn.Parameter, nn.Parameter]] = {}
    for module in model.modules():
        for name, p in module._parameters.items():
            if p is None or p.device.type != "meta":
                continue
            if id(p) not in made:
                made[id(p)] = (p, nn.Parameter(torch.empty(p.shape, dtype=p.dtype,
                                                            device=device),
                                               requires_grad=p.requires_grad))
            module._parameters[name] = made[id(p)][1]


def build_model(hf_config, dtype: torch.dtype, device: torch.device,
                tp: TensorParallel | None = None, shard_vision: bool = False
                ) -> torch.nn.Module:
    """The model with uninitialised weights on `device`; with `tp` (a `TensorParallel` of
    more than one rank), the language model's split modules at this rank's size, and with
    `shard_vision` the image encoder's."""
    return _build(hf_config, dtype, device, tp, shard_vision)[0]


def _build(hf_config, dtype: torch.dtype, device: torch.device, tp: TensorParallel | None,
           vision: bool, before_alloc: Callable[[nn.Module, VisionShardPlan | None], None]
           | None = None, expert_parallel: bool = False
           ) -> tuple[torch.nn.Module, VisionShardPlan | None]:
    """`build_model`, and the image encoder's plan when it is split; `before_alloc(model,
    that plan)` runs while the parameters are still on the meta device."""
    cls = resolve_model_class(hf_config)
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    vision_plan = None
    try:
        with torch.device(device), _parameters_on_meta():
            model = cls(hf_config)
            if tp is not None:
                shard_model(model, _shard_plan(hf_config, tp, expert_parallel), tp)
                if vision:
                    vision_plan = VisionShardPlan.for_model(model, tp.rank, tp.world_size)
                    shard_vision_encoder(model, vision_plan, tp)
    finally:
        torch.set_default_dtype(old)
    if before_alloc is not None:
        before_alloc(model, vision_plan)
    _materialize(model, device)
    return model.eval(), vision_plan


def _shard_plan(hf_config, tp: TensorParallel, expert_parallel: bool = False) -> ShardPlan:
    """This rank's plan, from the text config and the model class's `tp_layout`."""
    text = getattr(hf_config, "text_config", None) or hf_config
    layout = getattr(resolve_model_class(hf_config), "tp_layout", TPLayout())
    return ShardPlan.for_config(text, tp.rank, tp.world_size, expert_parallel, layout)


def load_model(path: str | Path, hf_config, dtype: torch.dtype, device: torch.device,
               tp: TensorParallel | None = None, shard_vision: bool = False,
               quantization: str = "auto", expert_parallel: bool = False) -> torch.nn.Module:
    """The model with the checkpoint's weights; with `tp` (more than one rank), only this
    rank's share of the language model is read and held, and with `shard_vision`
    (`mm_encoder_tp_mode="weights"`) only its share of the image encoder. `quantization`:
    "auto" holds a block-wise FP8 checkpoint's weights as FP8 in the language model's
    projections that can take them (`_hold_fp8`), "none" reads
    them all back to `dtype`, "fp8" quantizes an unquantized checkpoint's projections to
    block-wise FP8 as they load. `expert_parallel`: a rank holds its share of the experts
    whole (see `ShardPlan`)."""
    tp = tp if tp is not None and tp.world_size > 1 else None
    cls = resolve_model_class(hf_config)
    if hasattr(cls, "from_checkpoint"):  # the transformers backend: transformers loads it
        if quantization == "fp8":
            raise ValueError("the transformers backend runs unquantized (fp8 needs a native "
                             "model)")
        return cls.from_checkpoint(path, hf_config, dtype, device, tp)
    quant = checkpoint_quantization(hf_config)
    online = quantization == "fp8" and quant is None
    if online:
        quant = Fp8BlockQuant(FP8_BLOCK)
    raw: frozenset[str] = frozenset()
    slice_for = None

    def before_alloc(model: nn.Module, vision_plan: VisionShardPlan | None) -> None:
        nonlocal raw, slice_for
        if tp is not None:
            plan, vision = _shard_plan(hf_config, tp), tuple(model.encoder_prefixes)

            def slice_for(name: str) -> TensorSlice | None:
                if not name.startswith(vision):
                    return plan.slice_for(name)
                return None if vision_plan is None else vision_plan.slice_for(name)

        if quant is not None and quantization != "none":
            raw = _hold_fp8(model, path, quant, online, slice_for)

    model, _ = _build(hf_config, dtype, device, tp, shard_vision, before_alloc, expert_parallel)

    weights = iter_safetensors(path, slice_for=slice_for, quant=None if online else quant,
                               raw=raw)
    if online:
        weights = _quantized(weights, raw, quant.block)
    if quant is not None and quantization != "none":
        logger.info("%s: %d weights held as FP8%s, the rest in %s", path, len(raw),
                    " (quantized as they load)" if online else "", dtype)
    loaded = model.load_weights(weights)
    missing = {n for n, _ in model.named_parameters()} - loaded
    if missing:
        raise ValueError(f"checkpoint {path} lacks weights: {sorted(missing)[:8]}")
    return model


FP8_BLOCK = (128, 128)  # the blocks of weights quantized as they load (quantization="fp8")


def _hold_fp8(model: nn.Module, path: str | Path, quant: Fp8BlockQuant, online: bool,
              slice_for: Callable[[str], TensorSlice | None] | None = None
              ) -> frozenset[str]:
    """Turn the language model's projections whose weights come from FP8 checkpoint tensors
    alone (`online`: from any 2-D weight) into FP8 holders (`fp8.hold_fp8`); the checkpoint
    names to read as they are. Which parameter a checkpoint tensor fills is asked of the
    model's own `load_weights`, on meta tensors (of this rank's part of each: `slice_for`),
    before any memory exists. Under tensor parallelism a rank's part must start on a block
    (and end on one, or at the tensor's end), else that weight is read back."""
    shapes: dict[str, list[int]] = {}
    aligned: set[str] = set()
    for f in sorted(Path(path).glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as fh:
            for n in fh.keys():
                if is_attention_scale(n):
                    continue
                shape = list(fh.get_slice(n).get_shape())
                part = slice_for(n) if slice_for is not None else None
                if part is None or _on_blocks(part, shape, quant.block):
                    aligned.add(n)
                if part is not None:
                    shape[part.dim] = part.size
                shapes[n] = shape
    if online:
        sources = {n for n, shape in shapes.items() if n.endswith(".weight") and len(shape) == 2}
    else:
        sources = {n[:-len(SCALE_SUFFIX)] for n in shapes if n.endswith(SCALE_SUFFIX)}

    def filled(names) -> set[str]:
        return model.load_weights((n, torch.empty(shapes[n], device="meta")) for n in names)

    always = filled([])  # what it reports whatever it is given (a tied lm_head)
    owner = {n: filled([n]) - always for n in sources}
    others = filled(n for n in shapes if n not in sources and not n.endswith(SCALE_SUFFIX))
    modules = dict(model.named_modules())
    held = set()
    misaligned = set().union(*(owner[n] for n in sources - aligned))
    for param in set().union(*owner.values()) - others - misaligned:
        name = param.removesuffix(".weight")
        module = modules.get(name)
        if (param.endswith(".weight") and name.startswith("language_model.")
                and isinstance(module, HoldsFp8)
                and (not isinstance(module, MergedLinear) or module.fp8_rows_ok(quant.block[0]))):
            hold_fp8(module, quant.block)
            held.add(param)
    return frozenset(n for n, params in owner.items() if params and params <= held)


def _on_blocks(part: TensorSlice, shape: list[int], block: tuple[int, int]) -> bool:
    """Whether a rank's part of a weight starts on a block and ends on one (or at the end)."""
    b = block[part.dim]
    return (not part.spans and part.start % b == 0
            and (part.stop % b == 0 or part.stop == shape[part.dim]))


def _quantized(weights: Iterator[tuple[str, torch.Tensor]], names: frozenset[str],
               block: tuple[int, int]) -> Iterator[tuple[str, torch.Tensor]]:
    """``weights`` with those in ``names`` quantized to block-wise FP8 (and their scales)."""
    for name, tensor in weights:
        if name in names:
            q, scale = quantize_fp8_block(tensor, block)
            yield name, q
            yield name + SCALE_SUFFIX, scale
        else:
            yield name, tensor


@dataclass(frozen=True)
class LoadStats:
    """What loading the model cost this process: bytes of its parameters and buffers, and
    how far its anonymous resident memory (RssAnon: not the checkpoint's mapped file pages)
    rose above its size before the load, at the peak."""

    weight_bytes: int
    peak_rss_delta: int
    # host memory the rank then reserved for offloaded image embeddings (held once per host
    # under tensor parallelism: by the host's leader)
    host_cache_bytes: int = 0


def weight_bytes(model: nn.Module) -> int:
    """Bytes of the model's parameters and buffers (tied ones once)."""
    seen = {}
    for t in [*model.parameters(), *model.buffers()]:
        seen[t.data_ptr()] = t.numel() * t.element_size()
    return sum(seen.values())


def _rss_anon() -> int:
    """Bytes of this process's anonymous resident memory (0 without /proc)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("RssAnon:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


@contextlib.contextmanager
def peak_rss_delta(interval_s: float = 0.001) -> Iterator[list[int]]:
    """Yields a list that holds, after the block, the peak of RssAnon during it (sampled
    every `interval_s` by a thread, and at its end) less RssAnon before it, in bytes."""
    out, before, done = [0], _rss_anon(), threading.Event()

    def sample() -> None:
        while not done.wait(interval_s):
            out[0] = max(out[0], _rss_anon() - before)

    thread = threading.Thread(target=sample, name="vlmserve-rss", daemon=True)
    thread.start()
    try:
        yield out
    finally:
        done.set()
        thread.join()
        out[0] = max(out[0], _rss_anon() - before)
