"""Gated DeltaNet linear attention (Qwen3.5's `linear_attention` layers) over a pool of
per-sequence states.

A layer: one input projection (q | k | v | z | b | a), a short causal depthwise convolution
over q | k | v with SiLU (its state: the last ``kernel - 1`` inputs of each sequence), the
gated delta rule (its state: a ``[v_heads, k_dim, v_dim]`` matrix per sequence), a gated
RMSNorm (``norm(o) * weight * silu(z)`` per value head) and the output projection.

The recurrence, with q and k L2-normalised, q scaled by ``1/sqrt(k_dim)``, decay
``g = -exp(A_log) * softplus(a + dt_bias)`` and ``beta = sigmoid(b)``, per value head:
``S_t = exp(g_t) S_{t-1} + k_t (beta_t (v_t - exp(g_t) S_{t-1}^T k_t))^T``, ``o_t = S_t^T q_t``.

A step's tokens are flat (``[T, hidden]``) with per-sequence starts (`LinearAttentionMetadata`
in `layers/linear_metadata.py`, like the paged attention's metadata); each sequence reads and
writes its states at its slot of the pools (``conv_state [slots, kernel - 1, conv_dim]``,
``ssm_state [slots, v_heads, k_dim, v_dim]`` float32). A sequence without an initial state
(the first chunk of a prompt) starts from zeros. Any mix of prefill chunks and single-token
decodes runs in one call.

Backends (`get_linear_attention_backend`): ``torch`` (any device; the chunked form for
prefill chunks, 64 tokens a chunk, the step-by-step recurrence for decodes) and ``fla``
(CUDA: flash-linear-attention's `chunk_gated_delta_rule` for steps with prefill chunks,
imported only there; `triton_gdn.gdn_decode`, one kernel on the states in place, for
decode-only steps). The
convolution is a gather of ``kernel`` rows on both (device index ops of fixed shape per
batch: capturable in CUDA graphs), except decodes on CUDA: one kernel,
`triton_gdn.conv_decode`. The convolution alone (`depthwise_conv`, no
activation) also runs LFM2's gated short convolutions in the transformers backend, whose
state pools hold a conv state and no recurrent state.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from vlmserve.layers.fused import EAGER_OPS
from vlmserve.layers.linear import Linear, MergedLinear
from vlmserve.layers.linear_metadata import CHUNK, LinearAttentionMetadata
from vlmserve.utils import cuda_module_available

# steps of at most this many tokens (decodes, short chunks) gather the convolution's windows
# at once; longer ones tap by tap
GATHER_TOKENS = 1024


def causal_conv(x: torch.Tensor, weight: torch.Tensor, conv_state: torch.Tensor,
                meta: LinearAttentionMetadata) -> torch.Tensor:
    """SiLU(causal depthwise conv) of the step's ``x [T, C]`` with ``weight [C, kernel]``
    (`depthwise_conv`), in ``x``'s dtype."""
    return depthwise_conv(x, weight, conv_state, meta, silu=True)


def depthwise_conv(x: torch.Tensor, weight: torch.Tensor, conv_state: torch.Tensor,
                   meta: LinearAttentionMetadata, bias: torch.Tensor | None = None,
                   silu: bool = False) -> torch.Tensor:
    """The causal depthwise conv of the step's ``x [T, C]`` with ``weight [C, kernel]`` (and
    ``bias [C]``) -> float32 ``[T, C]`` (with ``silu``: SiLU of it in ``x``'s dtype), each
    sequence continuing its ``conv_state`` row (zeros without an initial state), whose new
    state is written back (and the snapshots' states to theirs). Decodes on CUDA that leave
    no snapshot: one kernel (`triton_gdn.conv_decode`)."""
    if x.is_cuda and meta.decode_only and not meta.snapshots:
        from vlmserve.layers.triton_gdn import conv_decode

        return conv_decode(x, weight, conv_state, meta.state_slots, meta.has_initial_state,
                           bias, silu)
    out = depthwise_conv_torch(x, weight, conv_state, meta, bias)
    return F.silu(out).to(x.dtype) if silu else out


def depthwise_conv_torch(x: torch.Tensor, weight: torch.Tensor, conv_state: torch.Tensor,
                         meta: LinearAttentionMetadata, bias: torch.Tensor | None = None
                         ) -> torch.Tensor:
    """`depthwise_conv` by torch ops (gathers over [states | step tokens]), any device."""
    prev = conv_state.index_select(0, meta.state_slots)  # [B, kernel - 1, C]
    prev = torch.where(meta.has_initial_state[:, None, None], prev, 0)  # not a product:
    # whatever a slot's last request left (inf, NaN) never reaches a fresh sequence
    rows = torch.cat([prev.reshape(-1, x.shape[1]).to(x.dtype), x])  # [B * (K - 1) + T, C]
    T, C = x.shape
    if T <= GATHER_TOKENS:  # every token's window in one gather: a few kernels a layer
        win = rows.index_select(0, meta.conv_index.reshape(-1)).view(T, -1, C)
        out = (win.float() * weight.t().float()).sum(1)
    else:  # tap by tap, without a [T, kernel, C] temporary
        out = None
        for j in range(weight.shape[1]):
            term = rows.index_select(0, meta.conv_index[:, j]).float() * weight[:, j].float()
            out = term if out is None else out + term
    n = meta.conv_state_index.shape[0]
    new_state = rows[meta.conv_state_index.reshape(-1)].view(n, -1, x.shape[1])
    conv_state.index_copy_(0, meta.conv_write_slots, new_state.to(conv_state.dtype))
    return out if bias is None else out + bias.float()


def gate_values(a: torch.Tensor, b: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """The decay ``g = -exp(A_log) * softplus(a + dt_bias)`` (float32) and ``beta =
    sigmoid(b)`` (in b's dtype) of ``a``, ``b [T, Hv]``, as transformers computes them."""
    return -A_log.float().exp() * F.softplus(a.float() + dt_bias), b.sigmoid()


@dataclass
class Gates:
    """A step's raw gate inputs ``a``, ``b [T, Hv]`` (views of the input projection) and the
    layer's ``A_log``, ``dt_bias [Hv]``: a recurrence computes the gates (`gate_values`), or
    its kernel does."""

    a: torch.Tensor
    b: torch.Tensor
    A_log: torch.Tensor
    dt_bias: torch.Tensor

    def values(self) -> tuple[torch.Tensor, torch.Tensor]:
        return gate_values(self.a, self.b, self.A_log, self.dt_bias)

    def take(self, rows: torch.Tensor) -> Gates:
        return Gates(self.a[rows], self.b[rows], self.A_log, self.dt_bias)


def l2_normalize(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


def _prepare(q, k, v, g, beta):
    """float32 [H, L, D] / [H, L] per head, q and k normalised (q scaled), q and k repeated
    to the value heads."""
    rep = v.shape[1] // q.shape[1]
    q, k = (l2_normalize(t.float()).repeat_interleave(rep, dim=1) for t in (q, k))
    q = q * q.shape[-1] ** -0.5
    return (q.transpose(0, 1), k.transpose(0, 1), v.float().transpose(0, 1),
            g.float().t(), beta.float().t())


def delta_rule_chunked(q, k, v, g, beta, state: torch.Tensor
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence: q, k ``[L, Hk, Dk]``, v ``[L, Hv, Dv]``, g, beta ``[L, Hv]``, ``state
    [Hv, Dk, Dv]`` float32 -> (``[L, Hv, Dv]`` float32, the state after the L tokens).

    Per chunk of C tokens with cumulative log decay G: the corrected values
    ``U = (I + A)^-1 (beta V - beta e^G K S)``, ``A_ij = beta_i e^(G_i - G_j) k_i.k_j`` (j < i);
    outputs ``e^G Q S + (Q K^T * e^(G_i - G_j), j <= i) U``; state ``e^G_C S + K^T (e^(G_C -
    G) U)``."""
    q, k, v, g, beta = _prepare(q, k, v, g, beta)
    H, L, _ = v.shape
    out = v.new_empty(H, L, v.shape[-1])
    for s in range(0, L, CHUNK):
        e = min(s + CHUNK, L)
        qc, kc, vc, bc = q[:, s:e], k[:, s:e], v[:, s:e], beta[:, s:e]
        G = g[:, s:e].cumsum(-1)  # [H, C]
        n = e - s
        lower = torch.ones(n, n, dtype=torch.bool, device=q.device).tril()
        decay = (G[:, :, None] - G[:, None, :]).masked_fill(~lower, float("-inf")).exp()
        A = (bc[:, :, None] * (kc @ kc.transpose(-1, -2)) * decay).masked_fill(
            lower.logical_not() | torch.eye(n, dtype=torch.bool, device=q.device), 0)
        eG = G.exp()[:, :, None]
        rhs = bc[:, :, None] * (vc - eG * (kc @ state))
        eye = torch.eye(n, dtype=A.dtype, device=A.device)
        u = torch.linalg.solve_triangular(eye + A, rhs, upper=False, unitriangular=True)
        out[:, s:e] = eG * (qc @ state) + ((qc @ kc.transpose(-1, -2)) * decay) @ u
        tail = (G[:, -1:] - G).exp()[:, :, None]  # [H, C, 1]
        state = G[:, -1].exp()[:, None, None] * state + kc.transpose(-1, -2) @ (tail * u)
    return out.transpose(0, 1), state


def delta_rule_step(q, k, v, g, beta, state: torch.Tensor
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """One token of each of B sequences: q, k ``[B, Hk, Dk]``, v ``[B, Hv, Dv]``, g, beta
    ``[B, Hv]``, ``state [B, Hv, Dk, Dv]`` float32 -> (``[B, Hv, Dv]``, new states)."""
    rep = v.shape[1] // q.shape[1]
    q, k = (l2_normalize(t.float()).repeat_interleave(rep, dim=1) for t in (q, k))
    q = q * q.shape[-1] ** -0.5
    state = state * g.float().exp()[:, :, None, None]
    seen = (state * k[..., None]).sum(-2)  # [B, H, Dv]: the decayed state's read of k
    delta = (v.float() - seen) * beta.float()[..., None]
    state = state + k[..., None] * delta[..., None, :]
    return (state * q[..., None]).sum(-2), state


def gated_delta_rule_torch(q, k, v, gates: Gates, ssm_state: torch.Tensor,
                           meta: LinearAttentionMetadata) -> torch.Tensor:
    """The step's sequences (flat ``[T, heads, dim]``) through the recurrence from their
    states (read and written at their slots) -> ``[T, Hv, Dv]`` float32. Single-token
    sequences go as one batch, each longer one by the chunked form."""
    g, beta = gates.values()
    slots = meta.state_slots
    init = torch.where(meta.has_initial_state[:, None, None, None],
                       ssm_state.index_select(0, slots), 0)
    if meta.decode_only:  # no host-built index: a decode graph captures this
        out, final = delta_rule_step(q, k, v, g, beta, init)
        ssm_state.index_copy_(0, slots, final.to(ssm_state.dtype))
        return out
    out = v.new_empty(v.shape, dtype=torch.float32)
    starts = np.concatenate([[0], np.cumsum(meta.query_lens_cpu)]).tolist()
    final = torch.empty_like(init)
    assert meta.single_rows is not None or 1 not in meta.query_lens_cpu, \
        "metadata of single-token sequences without their rows: build_linear_metadata's"
    if meta.single_rows is not None:
        rows, seqs = meta.single_rows, meta.single_seqs
        o, s = delta_rule_step(q[rows], k[rows], v[rows], g[rows], beta[rows], init[seqs])
        out[rows] = o
        final[seqs] = s
    for i, n in enumerate(meta.query_lens_cpu):
        if n > 1:
            a, b = starts[i], starts[i + 1]
            out[a:b], final[i] = delta_rule_chunked(q[a:b], k[a:b], v[a:b], g[a:b],
                                                    beta[a:b], init[i])
    ssm_state.index_copy_(0, slots, final.to(ssm_state.dtype))
    return out


def gated_delta_rule_fla(q, k, v, gates: Gates, ssm_state: torch.Tensor,
                         meta: LinearAttentionMetadata) -> torch.Tensor:
    """The same on CUDA: decode-only steps by our one-kernel recurrence on the states in
    place, the gates computed there too (`triton_gdn.gdn_decode`, graph-capturable), others
    by flash-linear-attention's chunked kernel over the step's sequences (`cu_seqlens`, with
    its host copy and the chunk indices built with the step's metadata: fla would read them
    back from the device)."""
    if meta.decode_only:
        from vlmserve.layers.triton_gdn import gdn_decode

        return gdn_decode(q, k, v, gates.a, gates.b, gates.A_log, gates.dt_bias, ssm_state,
                          meta.state_slots, meta.has_initial_state)
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule

    g, beta = gates.values()
    slots = meta.state_slots
    init = torch.where(meta.has_initial_state[:, None, None, None],
                       ssm_state.index_select(0, slots), 0)
    o, final = chunk_gated_delta_rule(
        q=q[None], k=k[None], v=v[None], g=g[None].float(), beta=beta[None],
        initial_state=init, output_final_state=True, use_qk_l2norm_in_kernel=True,
        cu_seqlens=meta.query_start_loc, cu_seqlens_cpu=meta.query_start_loc_cpu,
        chunk_indices=meta.chunk_indices)
    ssm_state.index_copy_(0, slots, final.to(ssm_state.dtype))
    return o[0]


def delta_rule_with_snapshots(rule_fn, q, k, v, gates: Gates, ssm_state: torch.Tensor,
                              meta: LinearAttentionMetadata) -> torch.Tensor:
    """`rule_fn` over the step; a step whose chunks hold snapshots by its passes
    (`snapshot_passes`, built with the step's metadata: nothing here waits for the
    device)."""
    if not meta.snapshots:
        return rule_fn(q, k, v, gates, ssm_state, meta)
    out = v.new_empty(v.shape, dtype=torch.float32)
    for p in meta.passes:
        rows = p.rows
        out[rows] = rule_fn(q[rows], k[rows], v[rows], gates.take(rows), ssm_state,
                            p.meta).float()
        if p.copies is not None:
            src, dst = p.copies
            ssm_state.index_copy_(0, dst, ssm_state.index_select(0, src))
    return out


LINEAR_ATTENTION_BACKENDS = ("auto", "torch", "fla")


def fla_available(device: torch.device) -> bool:
    return cuda_module_available(device, "fla.ops.gated_delta_rule")


def get_linear_attention_backend(name: str, device: torch.device):
    """``torch`` (any device), ``fla`` (CUDA, flash-linear-attention installed) or ``auto``
    (fla where it runs, else torch)."""
    if name == "auto":
        name = "fla" if fla_available(device) else "torch"
    if name == "torch":
        return gated_delta_rule_torch
    if name == "fla":
        if not fla_available(device):
            raise ValueError("the fla linear-attention backend needs a CUDA device and "
                             "flash-linear-attention (pip install fla-core)")
        return gated_delta_rule_fla
    raise ValueError(f"unknown linear-attention backend {name!r}; choose "
                     f"{', '.join(LINEAR_ATTENTION_BACKENDS)}")


class GatedRMSNorm(nn.Module):
    """``rms_norm(x) * weight * silu(z)`` over each value head (`fused.gated_rms_norm`: float32
    inside; one kernel with the Triton ops)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps
        self.ops = EAGER_OPS

    def forward(self, x: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        """``x [T, heads, dim]``, ``z [T, heads * dim]`` -> ``[T, heads * dim]``."""
        return self.ops.gated_rms_norm(x, z, self.weight, self.eps)


class GatedDeltaNet(nn.Module):
    """A linear-attention token mixer; the checkpoint's ``in_proj_qkv``, ``in_proj_z``,
    ``in_proj_b``, ``in_proj_a`` are the four parts of `in_proj` (`load_weights`).
    ``k_heads`` / ``v_heads``: this rank's heads (all of them without tensor parallelism)."""

    def __init__(self, hidden: int, k_heads: int, v_heads: int, k_dim: int, v_dim: int,
                 kernel: int, eps: float) -> None:
        super().__init__()
        self.k_heads, self.v_heads, self.k_dim, self.v_dim = k_heads, v_heads, k_dim, v_dim
        self.kernel = kernel
        key, value = k_heads * k_dim, v_heads * v_dim
        self.conv_dim = 2 * key + value
        self.in_proj = MergedLinear(hidden, [key, key, value, value, v_heads, v_heads],
                                    bias=False)
        self.conv1d = nn.Module()
        self.conv1d.weight = nn.Parameter(torch.empty(self.conv_dim, 1, kernel))
        self.dt_bias = nn.Parameter(torch.ones(v_heads))
        self.A_log = nn.Parameter(torch.zeros(v_heads))
        self.norm = GatedRMSNorm(v_dim, eps)
        self.out_proj = Linear(value, hidden, bias=False)
        self.rule_fn = gated_delta_rule_torch
        self.ops = EAGER_OPS

    def state_shapes(self) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """Per slot: (conv state, recurrent state)."""
        return ((self.kernel - 1, self.conv_dim),
                (self.v_heads, self.k_dim, self.v_dim))

    def mix(self, proj: torch.Tensor, conv_state: torch.Tensor, ssm_state: torch.Tensor,
            meta: LinearAttentionMetadata) -> torch.Tensor:
        """``proj [T, in_proj width]`` (the input projection of the step's tokens) -> the
        gated-norm output ``[T, v_heads * v_dim]`` (before `out_proj`)."""
        T = proj.shape[0]
        key, value = self.k_heads * self.k_dim, self.v_heads * self.v_dim
        qkv, z, b, a = proj.split([self.conv_dim, value, self.v_heads, self.v_heads], dim=-1)
        qkv = causal_conv(qkv, self.conv1d.weight[:, 0], conv_state, meta)
        q, k, v = qkv.split([key, key, value], dim=-1)
        o = delta_rule_with_snapshots(
            self.rule_fn, q.reshape(T, self.k_heads, self.k_dim),
            k.reshape(T, self.k_heads, self.k_dim), v.reshape(T, self.v_heads, self.v_dim),
            Gates(a, b, self.A_log, self.dt_bias), ssm_state, meta)
        return self.norm(o, z)  # o in proj's dtype first, as transformers has it

    def forward(self, x: torch.Tensor, conv_state: torch.Tensor, ssm_state: torch.Tensor,
                meta: LinearAttentionMetadata) -> torch.Tensor:
        """``x [T, hidden]`` (normed) -> ``[T, hidden]``; the states at the step's slots are
        read and updated."""
        return self.out_proj(self.mix(self.in_proj(x), conv_state, ssm_state, meta))

    _PARTS = {"in_proj_qkv": (0, 1, 2), "in_proj_z": (3,), "in_proj_b": (4,),
              "in_proj_a": (5,)}

    @torch.no_grad()
    def load_weights(self, weights) -> set[str]:
        """Checkpoint names relative to the layer (``in_proj_qkv.weight``, ``conv1d.weight``,
        ``A_log``, ``dt_bias``, ``norm.weight``, ``out_proj.weight``)."""
        params = dict(self.named_parameters())
        loaded = set()
        for name, tensor in weights:
            part = name.split(".")[0]
            if part in self._PARTS:
                shards = self._PARTS[part]
                sizes = [self.in_proj.out_sizes[i] for i in shards]
                for shard, piece in zip(shards, tensor.split(sizes, dim=0)):
                    self.in_proj.load_shard(shard, piece)
                loaded.add("in_proj.weight")
                continue
            if name not in params:
                raise KeyError(f"unexpected linear-attention weight {name!r}")
            assert params[name].shape == tensor.shape, (name, params[name].shape, tensor.shape)
            params[name].copy_(tensor)
            loaded.add(name)
        return loaded
