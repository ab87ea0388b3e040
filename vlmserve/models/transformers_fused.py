"""The engine's kernels inside a transformers model (the transformers backend): its
canonical RMSNorms and rotary on the fused ops, its vision towers' attention on the vision
backend.

A model's RMSNorm modules whose ``forward`` is transformers' canonical one, the very code of
``LlamaRMSNorm.forward`` (statistics in float32, the cast back, then the weight: Qwen2/3,
Qwen3-VL, Mistral, Idefics3, GLM-4V, InternViT and the many others copied from it), run the
engine's ``rms_norm`` (`layers/fused.FusedOps`: one Triton kernel on CUDA where transformers
launches seven or eight; the same arithmetic on the CPU). A norm written otherwise (Gemma's
``1 + weight``, Qwen3.5's, Llama 4's) runs as transformers wrote it: the code, not the name,
decides. So for the rotaries: where a module applies one with Llama's
``apply_rotary_pos_emb`` or Qwen2-VL's ``apply_rotary_pos_emb_vision`` (the same code), the
engine's forward and tower run the fused ``rotary_qk_float32`` instead (`fuse_rotary`,
`rotary_ops`: one kernel for q and k on CUDA where transformers launches about ten; to the bit
on the CPU), and for QuickGELU (`fuse_quick_gelus`). Sibling projections of one
input (q/k/v, gate/up) run as one GEMM (`join_projections`), and a gated MLP with SiLU written
as Llama's runs the engine's ``silu_mul`` on it, the native models' path.

A vision tower whose transformers code has a varlen path for its attention (the Qwen towers,
GLM-4V's, ...) runs it through the engine's vision attention backend (`vision_attention`:
every image and window of a forward in one call, where transformers' default makes a call per
image after reading the lengths back from the device).
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
import inspect
from collections.abc import Iterator
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from vlmserve.layers.vision_attention import build_varlen_plan, varlen_attention
from vlmserve.models.transformers_grids import host_copy


def _code(fn) -> tuple | None:
    """What a function does: its bytecode, names and non-string constants (not its docstring,
    file or line)."""
    code = getattr(fn, "__code__", None)
    if code is None:
        return None
    return (code.co_code, code.co_names, code.co_varnames,
            tuple(c for c in code.co_consts if not isinstance(c, str)))


@functools.cache
def _canonical() -> tuple | None:
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    return _code(LlamaRMSNorm.forward)


def _rms_norm(module: nn.Module, ops, hidden_states: torch.Tensor) -> torch.Tensor:
    if hidden_states.dtype != module.weight.dtype:  # transformers' result would be promoted
        return type(module).forward(module, hidden_states)
    return ops.rms_norm(hidden_states, module.weight, module.variance_epsilon)


def _route(model: nn.Module, canonical: tuple | None, forward) -> int:
    """Each module of ``model`` whose forward has the ``canonical`` code runs
    ``forward(module)`` instead; returns how many."""
    count = 0
    for module in model.modules():
        if _code(type(module).forward) == canonical:
            module.forward = forward(module)
            count += 1
    return count


def fuse_rms_norms(model: nn.Module, ops) -> int:
    """Route ``model``'s canonical RMSNorms through ``ops.rms_norm``; returns how many."""
    return _route(model, _canonical(), lambda m: functools.partial(_rms_norm, m, ops))


# projections of one input that transformers runs as separate GEMMs: one GEMM over their
# weights laid end to end (each module's weight a view of its rows: no copy), its output split
_SIBLINGS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))


class _Joined:
    """Sibling linear layers' one GEMM: the first call with an input computes every part,
    each sibling takes its own (a call with another input computes again; once every sibling
    has taken its part, the input and the parts are let go)."""

    def __init__(self, linears: list[nn.Linear]) -> None:
        self.weight = torch.cat([m.weight.detach() for m in linears])
        self.bias = (torch.cat([m.bias.detach() for m in linears])
                     if linears[0].bias is not None else None)
        self.sizes = [m.out_features for m in linears]
        at = 0
        for m, n in zip(linears, self.sizes, strict=True):  # views of the joined tensors
            m.weight = nn.Parameter(self.weight[at:at + n], requires_grad=False)
            if self.bias is not None:
                m.bias = nn.Parameter(self.bias[at:at + n], requires_grad=False)
            at += n
        self._input: torch.Tensor | None = None  # held: no other tensor takes its id
        self._parts: tuple[torch.Tensor, ...] = ()
        self._taken: set[int] = set()

    def part(self, i: int, x: torch.Tensor) -> torch.Tensor:
        if self._input is not x or i in self._taken:
            self._input, self._taken = x, set()
            self._parts = F.linear(x, self.weight, self.bias).split(self.sizes, dim=-1)
        out = self._parts[i]
        self._taken.add(i)
        if len(self._taken) == len(self.sizes):  # every sibling served: let them go
            self._input, self._parts = None, ()
        return out


def _joinable(linears: list[Any]) -> bool:
    first = linears[0]
    return all(type(m) is nn.Linear and m.in_features == first.in_features
               and m.weight.dtype == first.weight.dtype and m.weight.device == first.weight.device
               and (m.bias is None) == (first.bias is None) for m in linears)


@functools.cache
def _canonical_mlp() -> tuple | None:
    from transformers.models.llama.modeling_llama import LlamaMLP

    return _code(LlamaMLP.forward)


def _gated_mlp(module: nn.Module, joined: _Joined, ops, x: torch.Tensor) -> torch.Tensor:
    return module.down_proj(ops.silu_mul(F.linear(x, joined.weight, joined.bias)))


def join_projections(model: nn.Module, ops) -> int:
    """Run each module's sibling projections (q/k/v, gate/up) of one input as one GEMM; a
    module whose forward is transformers' canonical gated MLP with SiLU (Llama's code) runs
    ``down_proj(ops.silu_mul(gate_up(x)))``, the native models' path. Returns how many
    modules were joined."""
    count = 0
    for module in model.modules():
        for names in _SIBLINGS:
            linears = [getattr(module, n, None) for n in names]
            done = getattr(module, "vlmserve_joined", {})
            if names in done:  # joined before (other ops now)
                joined = done[names]
            elif any(m is None for m in linears) or not _joinable(linears):
                continue
            else:
                joined = _Joined(linears)
                module.vlmserve_joined = {**done, names: joined}
            count += 1
            act = getattr(module, "act_fn", None)
            if (names[0] == "gate_proj" and _code(type(module).forward) == _canonical_mlp()
                    and type(act).__name__ in ("SiLU", "SiLUActivation")):
                module.forward = functools.partial(_gated_mlp, module, joined, ops)
                continue
            for i, m in enumerate(linears):
                m.forward = functools.partial(joined.part, i)
    return count


# the rotary where transformers applies it with a canonical function (Llama's
# `apply_rotary_pos_emb`, copied into Qwen2/3, Qwen2-VL, Mistral, InternVL, ...; Qwen2-VL's
# `apply_rotary_pos_emb_vision`, copied into the Qwen towers, GLM-4V's, ...): the fused ops of
# the engine's forward running (None: transformers' own, as for any other caller)
_ROTARY_OPS: contextvars.ContextVar[Any] = contextvars.ContextVar("vlmserve_rotary_ops",
                                                                 default=None)


@functools.cache
def _canonical_rotaries() -> dict[str, tuple | None]:
    from transformers.models.llama import modeling_llama
    from transformers.models.qwen2_vl import modeling_qwen2_vl

    return {"apply_rotary_pos_emb": _code(modeling_llama.apply_rotary_pos_emb),
            "apply_rotary_pos_emb_vision": _code(modeling_qwen2_vl.apply_rotary_pos_emb_vision)}


class _Routed:
    """A canonical rotary through ``ops.rotary_qk_float32`` (q [T, heads, D], cos [T, D];
    one kernel for q and k on CUDA, float32 inside and one rounding: to the bit of
    transformers' on float32). The kernel reads the first half of cos and sin: the first
    call outside a graph capture checks that their halves agree (one read back, once), and
    a model whose halves differ keeps transformers' function."""

    def __init__(self, original) -> None:
        self.original = original
        self.halves_agree: bool | None = None

    def usable(self, cos: torch.Tensor) -> bool:
        if self.halves_agree is None:
            if cos.is_cuda and torch.cuda.is_current_stream_capturing():
                return False
            half = cos.shape[-1] // 2
            self.halves_agree = bool(torch.equal(cos[..., :half], cos[..., half:]))
        return self.halves_agree

    def text(self, q, k, cos, sin, unsqueeze_dim=1):
        """q [1, heads, T, D], k [1, kv heads, T, D], cos and sin [1, T, D]."""
        ops = _ROTARY_OPS.get()
        if (ops is None or unsqueeze_dim != 1 or q.shape[0] != 1 or cos.dim() != 3
                or not self.usable(cos)):
            return self.original(q, k, cos, sin, unsqueeze_dim)
        rq, rk = ops.rotary_qk_float32(q[0].transpose(0, 1), k[0].transpose(0, 1),
                                       cos[0], sin[0])
        return rq.transpose(0, 1)[None], rk.transpose(0, 1)[None]

    def vision(self, q, k, cos, sin):
        """q [T, heads, D], k [T, heads, D], cos and sin [T, D]."""
        ops = _ROTARY_OPS.get()
        if ops is None or q.dim() != 3 or cos.dim() != 2 or not self.usable(cos):
            return self.original(q, k, cos, sin)
        return ops.rotary_qk_float32(q, k, cos, sin)


def fuse_rotary(model: nn.Module) -> int:
    """Route the canonical rotaries of ``model``'s modules (the globals of its classes'
    modules) through the fused ops inside `rotary_ops`; returns how many functions."""
    count = 0
    for module in {inspect.getmodule(type(m)) for m in model.modules()}:
        for name, code in _canonical_rotaries().items():
            fn = getattr(module, name, None)
            if hasattr(fn, "__self__") and isinstance(fn.__self__, _Routed):
                count += 1
            elif fn is not None and _code(fn) == code:
                routed = _Routed(fn)
                setattr(module, name, routed.vision if name.endswith("vision") else routed.text)
                count += 1
    return count


@contextlib.contextmanager
def rotary_ops(ops) -> Iterator[None]:
    """Inside: the routed rotaries run ``ops.rotary_qk_float32`` (None: transformers')."""
    token = _ROTARY_OPS.set(ops)
    try:
        yield
    finally:
        _ROTARY_OPS.reset(token)


@functools.cache
def _canonical_quick_gelu() -> tuple | None:
    from transformers.activations import QuickGELUActivation

    return _code(QuickGELUActivation.forward)


def fuse_quick_gelus(model: nn.Module, ops) -> int:
    """``x * sigmoid(1.702 x)`` modules (transformers' QuickGELU: CLIP's, the Qwen2-VL
    tower's) run ``ops.quick_gelu`` (one kernel on CUDA where transformers launches three);
    returns how many."""
    return _route(model, _canonical_quick_gelu(), lambda m: ops.quick_gelu)


def use_engine_ops(model: nn.Module, ops) -> dict[str, int]:
    """Everything above on ``model``: how many norms, rotary functions, joined modules and
    QuickGELUs run the engine's ``ops`` (the rotaries inside `rotary_ops`)."""
    return {"rms_norms": fuse_rms_norms(model, ops), "rotaries": fuse_rotary(model),
            "joined": join_projections(model, ops), "quick_gelus": fuse_quick_gelus(model, ops)}


# the vision towers' attention where transformers has a varlen path for it (a name with
# "flash" in it is what makes transformers take that path: every image and window of a
# forward in one call, with `cu_seqlens`, instead of an attention call per image)
VISION_ATTENTION_NAME = "vlmserve_flash_varlen"


def vision_attention(module: nn.Module, query: torch.Tensor, key: torch.Tensor,
                     value: torch.Tensor, attention_mask: Any, scaling: float | None = None,
                     dropout: float = 0.0, **kwargs: Any) -> tuple[torch.Tensor, None]:
    """A vision tower's attention through the engine's vision attention backend: packed
    segments (``cu_seq_lens_q``, ``query [1, heads, N, dim]``) in one varlen call; a dense
    batch (no ``cu_seq_lens_q``) as transformers' SDPA -> ``[B, N, heads, dim]``."""
    cu = kwargs.get("cu_seq_lens_q")
    if cu is None:
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        return sdpa_attention_forward(module, query, key, value, attention_mask,
                                      scaling=scaling, dropout=dropout, **kwargs)
    q, k, v = (t[0].transpose(0, 1) for t in (query, key, value))  # [N, heads, dim]
    vision: _VisionAttention = getattr(module, "vlmserve_vision", None) or _VisionAttention()
    if vision.fn is not None:  # flash or triton: device cu_seqlens, a bound on every segment
        out = vision.fn(q, k, v, cu.to(torch.int32), int(kwargs["max_length_q"]),
                        scale=scaling)
        return out[None], None
    if vision.cu is not cu:  # planned once a forward: its layers share cu (and this object)
        vision.cu, vision.plan = cu, build_varlen_plan(host_copy(cu), device=q.device)
    return varlen_attention(q, k, v, cu, scale=scaling, plan=vision.plan)[None], None


@dataclasses.dataclass
class _VisionAttention:
    """What a model's vision attention modules share: the engine's varlen function (None:
    the grouped SDPA) and the grouped SDPA's plan for the forward's ``cu_seqlens``."""

    fn: Any = None
    cu: torch.Tensor | None = None
    plan: Any = None


def use_varlen_vision_attention(model: nn.Module, hf_config) -> None:
    """A vision tower whose transformers code has a varlen path for its attention takes
    the engine's (`vision_attention`). Set on the loaded model's vision configs: at load,
    transformers would look for a name with "flash" among its kernels."""
    if "cu_seq_lens_q=cu_seqlens" not in inspect.getsource(inspect.getmodule(type(model))):
        return
    kinds = tuple({type(getattr(hf_config, name)) for name in getattr(hf_config, "sub_configs", {})
                   if "vision" in name and getattr(hf_config, name, None) is not None})
    for config in {id(m.config): m.config for m in model.modules()
                   if isinstance(getattr(m, "config", None), kinds)}.values():
        config._attn_implementation = VISION_ATTENTION_NAME


def set_vision_attention(model: nn.Module, fn) -> None:
    """``model``'s vision attention modules run ``fn`` (flash, triton), or the grouped SDPA
    for None; towers without a varlen path keep transformers' attention."""
    shared = _VisionAttention(fn)
    for module in model.modules():
        if hasattr(module, "is_causal"):  # attention modules (the text's ignore it)
            module.vlmserve_vision = shared
