"""A sparse mixture-of-experts MLP (Qwen3-VL-MoE's): a router picks each token's top-k experts,
each expert is a SiLU-gated MLP, and the token's output is their sum weighted by the router's
probabilities (renormalized over the k picked).

The experts' weights are two 3-D tensors, as transformers holds them: `gate_up_proj`
[experts, 2 * inter, hidden] (the gate's rows, then the up projection's) and `down_proj`
[experts, hidden, inter]. Checkpoints store them either so or with the last two dims swapped
(the hub's Qwen3-VL-MoE files); `ExpertWeights.load` takes both, like transformers: a tensor
of the held shape is taken as it is, any other transposed.

On CUDA the experts run as two grouped GEMMs in Triton (`layers/triton_moe.py`), whose launch
plan is made on the device (no host sync, so CUDA graphs can capture it). Elsewhere `moe_reference`
computes what transformers computes, expert by expert.

Under tensor parallelism each rank holds every expert's slice of the intermediate columns
(`ExpertWeights(inter_start=...)`), or with expert parallelism a share of the experts whole
(`ExpertWeights(expert_start=...)`: a pick of another rank's expert adds nothing here); the
weighted sum is all-reduced (with a shared expert, `SharedExpertMoE`: the experts' and its
partial sums in one all-reduce).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from vlmserve.layers.attention import triton_available
from vlmserve.layers.fused import EAGER_OPS
from vlmserve.layers.norm import RMSNorm


def route(logits: torch.Tensor, top_k: int, renormalize: bool = True
          ) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights [T, k] in the logits' dtype, expert ids [T, k]): softmax in float32, the k
    largest, divided by their sum when `renormalize`."""
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights.to(logits.dtype), ids


def moe_reference(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor,
                  weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """The experts' weighted sum [T, hidden], expert by expert in id order (transformers'
    order of the sum): each expert's tokens through its gated MLP, scaled by their weight."""
    out = torch.zeros_like(x)
    held = gate_up.shape[0]  # an id past them: an expert held elsewhere (expert parallelism)
    hit = torch.bincount(ids.reshape(-1), minlength=held)[:held].nonzero().flatten()
    for k in hit.tolist():
        token, slot = torch.where(ids == k)
        h = F.linear(x[token], gate_up[k])
        gate, up = h.chunk(2, dim=-1)
        y = F.linear(F.silu(gate) * up, down[k]) * weights[token, slot, None]
        out.index_add_(0, token, y.to(out.dtype))
    return out


class Router(nn.Module):
    """The router's linear layer (`mlp.gate.weight` [experts, hidden]); replicated."""

    def __init__(self, hidden: int, num_experts: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_experts, hidden))


class ExpertWeights(nn.Module):
    """The gated MLPs of experts [expert_start, expert_start + num_experts) of `num_total`
    (all of them but under expert parallelism), or of each this rank's slice of the
    intermediate columns [inter_start, inter_start + inter) of `inter_total`."""

    def __init__(self, hidden: int, inter: int, num_experts: int, inter_start: int = 0,
                 inter_total: int | None = None, expert_start: int = 0,
                 num_total: int | None = None) -> None:
        super().__init__()
        self.hidden, self.inter, self.inter_start = hidden, inter, inter_start
        self.inter_total = inter if inter_total is None else inter_total
        self.expert_start = expert_start
        self.num_total = num_experts if num_total is None else num_total
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * inter, hidden))
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden, inter))

    @torch.no_grad()
    def load(self, name: str, tensor: torch.Tensor, seen: set[tuple[int, str]]) -> list[str]:
        """A checkpoint's experts tensor, this rank's columns of it copied in: the whole
        stacked `gate_up_proj` or `down_proj` (either layout), or one expert's
        `N.gate_proj.weight` / `N.up_proj.weight` [inter, hidden] or `N.down_proj.weight`
        [hidden, inter] (Qwen3-MoE's naming; an FP8 checkpoint's come read back). `seen`: the
        (expert, projection) pieces this load pass gave so far (the caller's, one a module).
        Returns the parameters now wholly loaded."""
        e, h, i, s, n = (self.gate_up_proj.shape[0], self.hidden, self.inter_total,
                         self.inter_start, self.inter)
        here = slice(self.expert_start, self.expert_start + e)
        if name == "gate_up_proj":
            t = _held_layout(tensor, (self.num_total, 2 * i, h), name)[here]
            self.gate_up_proj.copy_(torch.cat([t[:, s:s + n], t[:, i + s:i + s + n]], dim=1))
            return [name]
        if name == "down_proj":
            t = _held_layout(tensor, (self.num_total, h, i), name)[here]
            self.down_proj.copy_(t[:, :, s:s + n])
            return [name]
        expert, _, proj = name.partition(".")
        want = {"gate_proj.weight": (i, h), "up_proj.weight": (i, h),
                "down_proj.weight": (h, i)}.get(proj)
        if not expert.isdigit() or int(expert) >= self.num_total or want is None:
            raise KeyError(f"unexpected expert weight experts.{name}")
        if tuple(tensor.shape) != want:
            raise ValueError(f"experts.{name} has shape {tuple(tensor.shape)}; expected {want}")
        k = int(expert) - self.expert_start
        if not 0 <= k < e:  # another rank's expert
            return []
        if proj == "down_proj.weight":
            self.down_proj[k].copy_(tensor[:, s:s + n])
        else:
            rows = slice(0, n) if proj == "gate_proj.weight" else slice(n, 2 * n)
            self.gate_up_proj[k, rows].copy_(tensor[s:s + n])
        seen.add((k, proj))
        param, projs = (("down_proj", ("down_proj.weight",)) if proj == "down_proj.weight"
                        else ("gate_up_proj", ("gate_proj.weight", "up_proj.weight")))
        return [param] if all((x, q) in seen for x in range(e) for q in projs) else []


def _held_layout(t: torch.Tensor, shape: tuple[int, int, int], name: str) -> torch.Tensor:
    if tuple(t.shape) == shape:
        return t
    if tuple(t.shape) == (shape[0], shape[2], shape[1]):
        return t.transpose(1, 2)
    raise ValueError(f"experts.{name} has shape {tuple(t.shape)}; expected {shape} or "
                     f"{(shape[0], shape[2], shape[1])}")


class SparseMoE(nn.Module):
    """The MLP of a sparse layer: `forward(x, residual, norm)` like `Qwen2MLP`'s."""

    def __init__(self, hidden: int, inter: int, num_experts: int, top_k: int,
                 renormalize: bool = True) -> None:
        super().__init__()
        self.num_experts, self.top_k, self.renormalize = num_experts, top_k, renormalize
        self.gate = Router(hidden, num_experts)
        self.experts = ExpertWeights(hidden, inter, num_experts)
        self.tp = None  # a TensorParallel when the experts (or their columns) are split
        self.ops = EAGER_OPS

    def forward(self, x, residual, norm: RMSNorm) -> tuple[torch.Tensor, torch.Tensor]:
        h, residual = (norm(x), x) if residual is None else norm(x, residual)
        return self.experts_sum(h), residual

    def experts_sum(self, h: torch.Tensor) -> torch.Tensor:
        """The routed experts' weighted sum of the normed ``h [T, hidden]``."""
        weights, ids = route(F.linear(h, self.gate.weight), self.top_k, self.renormalize)
        gate_up, down = self.experts.gate_up_proj, self.experts.down_proj
        here = gate_up.shape[0]
        elsewhere = here != self.num_experts  # expert parallelism: the others' experts
        if elsewhere:  # ids of this rank's experts from 0; the others' all `here`
            ids = ids - self.experts.expert_start
            ids = ids.masked_fill((ids < 0) | (ids >= here), here)
        if triton_available(h.device):
            from vlmserve.layers.triton_moe import fused_moe
            y = fused_moe(h, gate_up, down, weights, ids, self.ops.silu_mul, elsewhere)
        else:
            y = moe_reference(h, gate_up, down, weights, ids)
        return y if self.tp is None else self.tp.all_reduce(y)


class SharedExpertMoE(nn.Module):
    """Qwen3.5-MoE's MLP: the routed experts (`routed`, a `SparseMoE`) plus
    ``sigmoid(shared_expert_gate(h)) * shared_expert(h)``, `shared_expert` a SiLU-gated MLP
    (`gate_up_proj`, `down_proj`). Under tensor parallelism both sums are this rank's partial
    ones, all-reduced together once (`tp`)."""

    def __init__(self, routed: SparseMoE, shared_expert: nn.Module, hidden: int) -> None:
        super().__init__()
        self.routed = routed
        self.shared_expert = shared_expert
        self.shared_expert_gate = nn.Module()
        self.shared_expert_gate.weight = nn.Parameter(torch.empty(1, hidden))  # replicated
        self.tp = None

    def forward(self, x, residual, norm: RMSNorm) -> tuple[torch.Tensor, torch.Tensor]:
        h, residual = (norm(x), x) if residual is None else norm(x, residual)
        mlp = self.shared_expert
        shared = mlp.down_proj(mlp.ops.silu_mul(mlp.ops.linear(h, mlp.gate_up_proj.w)))
        gate = torch.sigmoid(F.linear(h, self.shared_expert_gate.weight))
        y = self.routed.experts_sum(h) + gate * shared
        return (y if self.tp is None else self.tp.all_reduce(y)), residual


def is_sparse_layer(cfg, index: int) -> bool:
    """Whether decoder layer `index` of a text config has the experts' MLP (transformers'
    rule: experts configured, not in `mlp_only_layers`, every `decoder_sparse_step`-th)."""
    experts = num_experts(cfg)
    step = getattr(cfg, "decoder_sparse_step", 1) or 1
    return (experts > 0 and index not in (getattr(cfg, "mlp_only_layers", None) or [])
            and (index + 1) % step == 0)


def num_experts(cfg) -> int:
    return int(getattr(cfg, "num_experts", None) or getattr(cfg, "num_local_experts", 0) or 0)


def sparse_moe_for(cfg) -> SparseMoE:
    return SparseMoE(cfg.hidden_size, cfg.moe_intermediate_size, num_experts(cfg),
                     cfg.num_experts_per_tok, bool(getattr(cfg, "norm_topk_prob", True)))
