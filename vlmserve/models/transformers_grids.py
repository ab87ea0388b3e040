"""Image grids read on the host in a transformers model's vision tower (the transformers
backend), so that the tower's launch need not wait for the device.

transformers' Qwen towers and some thirty others (GLM-4V, PaddleOCR-VL, Hunyuan-VL, ...)
compute what they need beside the pixels (rotary positions, attention segments, window
order, interpolation taps) from each image's grid with the helpers of
``transformers.vision_utils``; their model reads the grid back once more to split the
tower's rows per image. Given the grid on the device, each of those reads is a wait for the
device (a handful per forward: the tower's launch cannot run ahead of the step before it).
Here the grids stay on the host: `wrap_vision_helpers` puts the helpers' results (and
``get_max_seqlen``'s input) on the device only once they are computed, inside `host_grids`.

A model whose tower mixes a host grid with device tensors elsewhere raises on its first
forward; `HostGrids` then gives it device grids from then on.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import inspect
import logging
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from vlmserve.utils import to_device

logger = logging.getLogger(__name__)

# the device the helpers' results go to (None: outside `host_grids`, they run as written), and
# by id each device tensor they made in this forward with its host tensor (both kept alive:
# no other tensor takes the id while the forward runs)
_Hosts = dict[int, tuple[torch.Tensor, torch.Tensor]]
_TARGET: contextvars.ContextVar[tuple[torch.device, _Hosts] | None] = \
    contextvars.ContextVar("vlmserve_host_grids", default=None)


def _to_device(value: Any, device: torch.device, hosts: _Hosts) -> Any:
    if isinstance(value, torch.Tensor) and value.device != device:
        moved = to_device(value, device)
        hosts[id(moved)] = moved, value
        return moved
    if isinstance(value, (tuple, list)):
        return type(value)(_to_device(v, device, hosts) for v in value)
    return value


def host_copy(t: torch.Tensor) -> torch.Tensor:
    """``t`` on the host: the tensor a helper made it from inside `host_grids`, else a copy
    (a wait for the device)."""
    target = _TARGET.get()
    pair = target[1].get(id(t)) if target is not None else None
    return pair[1] if pair is not None and pair[0] is t else t.cpu()


def _helper(fn):
    @functools.wraps(fn)
    def on_device(*args: Any, **kwargs: Any) -> Any:
        target = _TARGET.get()
        if target is None:
            return fn(*args, **kwargs)
        return _to_device(fn(*args, **kwargs), *target)
    on_device.vlmserve_host = fn
    return on_device


def _max_seqlen(fn):
    @functools.wraps(fn)
    def from_host(cu_seqlens: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        if _TARGET.get() is not None:
            cu_seqlens = host_copy(cu_seqlens)
        return fn(cu_seqlens, *args, **kwargs)
    from_host.vlmserve_host = fn
    return from_host


def wrap_vision_helpers(model: nn.Module) -> bool:
    """Wrap transformers' vision helpers where ``model``'s modules call them (the globals of
    its classes' modules); whether any module calls one (its grids may stay on the host)."""
    try:
        from transformers import vision_utils
        from transformers.utils.generic import get_max_seqlen
    except ImportError:  # a transformers without them
        return False
    helpers = {id(f) for name, f in vars(vision_utils).items()
               if name.startswith("get_vision_") and inspect.isfunction(f)}
    found = False
    for module in {inspect.getmodule(type(m)) for m in model.modules()}:
        for name, f in list(vars(module).items()):
            if hasattr(f, "vlmserve_host"):
                found = found or id(f.vlmserve_host) in helpers
            elif id(f) in helpers:
                setattr(module, name, _helper(f))
                found = True
            elif f is get_max_seqlen:
                setattr(module, name, _max_seqlen(f))
    return found


@contextlib.contextmanager
def host_grids(device: torch.device) -> Iterator[None]:
    """Inside: the wrapped helpers' tensors go to ``device`` once computed on the host."""
    token = _TARGET.set((device, {}))
    try:
        yield
    finally:
        _TARGET.reset(token)


class HostGrids:
    """How a model's tower is called: its small integer tensors (``hosted``: grids, sizes) on
    the host where its modules call transformers' vision helpers (`on`), until a call shows
    that it mixes them with device tensors; else moved to the device first."""

    def __init__(self, model: nn.Module) -> None:
        self.on = wrap_vision_helpers(model)

    def call(self, fn, kwargs: dict[str, torch.Tensor], hosted: set[str],
             device: torch.device) -> Any:
        if self.on:
            try:
                with host_grids(device):
                    return fn(**kwargs)
            except torch.OutOfMemoryError:
                raise
            except RuntimeError as e:  # a host grid met a device tensor
                self.on = False
                logger.info("a vision tower reads its grids on the device from now on (%s)",
                            str(e).splitlines()[0])
        moved = {k: to_device(v, device) for k, v in kwargs.items() if k in hosted}
        return fn(**{**kwargs, **moved})
