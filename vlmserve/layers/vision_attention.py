"""Variable-length (packed) non-causal attention for vision encoders.

Tokens of many independent segments (images, frames, attention windows) are packed along one
dimension; each token attends only to the tokens of its own segment. This is the reference
implementation in plain PyTorch (CPU and CUDA); a fused varlen kernel can replace it behind
:func:`varlen_attention` without touching the callers.

Strategy: segments are grouped into buckets of similar length. A bucket whose segments are
adjacent and of equal length is a zero-copy view ``[num_seqs, len, heads, dim]``; otherwise its
tokens are gathered into a padded batch ``[num_seqs, max_len, heads, dim]`` with a key-padding
mask. A bucket is one ``scaled_dot_product_attention`` launch per power of two in its segment
count (13 images -> batches of 8, 4 and 1), so hundreds of windows cost a handful of launches,
while one huge image never pads many small ones up to its length.

Why powers of two: on CUDA, SDPA runs cuDNN's attention, which builds a graph for every new
shape (batch size included), at tens to hundreds of milliseconds each. With the batch sizes
bounded, a server meets each (batch, length) shape of its image sizes within its first steps,
not again for every new count of equal images in a step.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from vlmserve.config import auto_kernels
from vlmserve.utils import to_device

# Segments join the current bucket when no longer than this (launch overhead dominates) ...
_SMALL_SEGMENT = 256
# ... or when at least this fraction of the bucket's longest segment (bounds padding waste).
_MIN_FILL = 0.7


@dataclass
class _Bucket:
    """One SDPA launch over ``num_seqs`` segments padded to ``max_len``."""

    num_seqs: int
    max_len: int
    start: int = -1  # contiguous equal-length run: token range [start, start + num_seqs*max_len)
    gather: torch.Tensor | None = None  # [num_seqs, max_len] token ids (padding -> 0)
    key_mask: torch.Tensor | None = None  # [num_seqs, 1, 1, max_len] bool, True = real key
    valid: torch.Tensor | None = None  # [num_valid] flat positions in num_seqs*max_len
    tokens: torch.Tensor | None = None  # [num_valid] destination token ids


@dataclass
class VarlenPlan:
    """Precomputed bucketing for one ``cu_seqlens``; reusable across layers of a forward."""

    total_tokens: int
    max_seqlen: int
    buckets: list[_Bucket]


def _group_segments(lengths: list[int]) -> list[list[int]]:
    """Group segment indices into buckets by length (longest first)."""
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    groups: list[list[int]] = []
    bucket_max = 0
    for i in order:
        n = lengths[i]
        if groups and (bucket_max <= _SMALL_SEGMENT or n >= _MIN_FILL * bucket_max):
            groups[-1].append(i)
        else:
            groups.append([i])
            bucket_max = n
    for g in groups:
        g.sort()  # original order inside a bucket keeps contiguous runs detectable
    return groups


def _pow2_parts(n: int) -> list[int]:
    """``n`` as a sum of distinct powers of two, largest first (13 -> [8, 4, 1])."""
    return [1 << b for b in reversed(range(n.bit_length())) if n >> b & 1]


def _bucket(group: list[int], starts: list[int], lengths: list[int],
            device: torch.device) -> _Bucket:
    """One launch for the segments `group`: a view if they are adjacent and equally long,
    else a padded gather."""
    lens = [lengths[i] for i in group]
    max_len = max(lens)
    if all(n == max_len for n in lens) and all(
            starts[a] + max_len == starts[b] for a, b in zip(group[:-1], group[1:])):
        return _Bucket(len(group), max_len, start=starts[group[0]])
    seg_start = torch.tensor([starts[i] for i in group], dtype=torch.long)  # [g]
    seg_len = torch.tensor(lens, dtype=torch.long)  # [g]
    pos = torch.arange(max_len, dtype=torch.long)  # [L]
    real = pos[None, :] < seg_len[:, None]  # [g, L]
    gather = torch.where(real, seg_start[:, None] + pos[None, :], 0)  # [g, L]
    uniform = bool(real.all())

    def dev(t: torch.Tensor) -> torch.Tensor:  # built on the host: no wait for the stream
        return to_device(t, device)
    return _Bucket(
        len(group),
        max_len,
        gather=dev(gather),
        key_mask=None if uniform else dev(real[:, None, None, :]),
        valid=None if uniform else dev(real.flatten().nonzero().squeeze(1)),
        tokens=dev(gather[real]),
    )


def build_varlen_plan(
    cu_seqlens: torch.Tensor, device: torch.device | str | None = None
) -> VarlenPlan:
    """Plan the attention launches for ``cu_seqlens`` ``[num_seqs + 1]``.

    Reads ``cu_seqlens`` on the host (pass a CPU tensor to avoid a device sync); index tensors
    are created on ``device`` (default: ``cu_seqlens.device``).
    """
    device = cu_seqlens.device if device is None else torch.device(device)
    bounds = [int(x) for x in cu_seqlens.tolist()]
    starts, lengths = bounds[:-1], [b - a for a, b in zip(bounds[:-1], bounds[1:])]
    keep = [i for i, n in enumerate(lengths) if n > 0]
    starts, lengths = [starts[i] for i in keep], [lengths[i] for i in keep]
    buckets: list[_Bucket] = []
    for whole in _group_segments(lengths):
        for n in _pow2_parts(len(whole)):
            group, whole = whole[:n], whole[n:]
            buckets.append(_bucket(group, starts, lengths, device))
    return VarlenPlan(bounds[-1], max(lengths, default=0), buckets)


def _sdpa(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None,
    scale: float | None,
):
    """SDPA on ``[b, L, H, D]`` inputs, returning ``[b, L, H, D]``."""
    out = F.scaled_dot_product_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask, scale=scale
    )  # [b, H, L, D]
    return out.transpose(1, 2)


def varlen_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens: torch.Tensor,
    max_seqlen: int | None = None,
    *,
    scale: float | None = None,
    plan: VarlenPlan | None = None,
) -> torch.Tensor:
    """Non-causal attention restricted to each packed segment.

    Args:
        q, k, v: ``[total_tokens, num_heads, head_dim]``.
        cu_seqlens: int tensor ``[num_seqs + 1]`` of segment boundaries (starts at 0, ends at
            ``total_tokens``).
        max_seqlen: longest segment (for kernels that need it; unused here).
        scale: softmax scale, default ``head_dim ** -0.5``.
        plan: result of :func:`build_varlen_plan` for this ``cu_seqlens``, to skip re-planning
            (and the host read of ``cu_seqlens``) in every layer.

    Returns:
        ``[total_tokens, num_heads, head_dim]``.
    """
    del max_seqlen
    if plan is None:
        plan = build_varlen_plan(cu_seqlens, device=q.device)
    total, heads, dim = q.shape
    if total != plan.total_tokens:
        raise ValueError(f"q has {total} tokens but cu_seqlens covers {plan.total_tokens}")
    buckets = plan.buckets
    if len(buckets) == 1 and buckets[0].start == 0:  # one contiguous equal-length run: no copies
        b = buckets[0]
        shape = (b.num_seqs, b.max_len, heads, dim)
        return _sdpa(q.view(shape), k.view(shape), v.view(shape), None, scale).reshape(
            total, heads, dim
        )

    out = q.new_empty(q.shape)  # [total, H, D]
    for b in buckets:
        shape = (b.num_seqs, b.max_len, heads, dim)
        if b.start >= 0:
            end = b.start + b.num_seqs * b.max_len
            o = _sdpa(
                q[b.start : end].view(shape),
                k[b.start : end].view(shape),
                v[b.start : end].view(shape),
                None,
                scale,
            )  # [g, L, H, D]
            out[b.start : end] = o.reshape(-1, heads, dim)
            continue
        idx = b.gather.flatten()
        o = _sdpa(q[idx].view(shape), k[idx].view(shape), v[idx].view(shape), b.key_mask, scale)
        o = o.reshape(-1, heads, dim)  # [g*L, H, D]
        if b.valid is not None:
            o = o[b.valid]
        out.index_copy_(0, b.tokens, o)
    return out


def varlen_attention_flash(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                           cu_seqlens: torch.Tensor, max_seqlen: int,
                           scale: float | None = None) -> torch.Tensor:
    """Every segment in one call of torch's own varlen FlashAttention kernel (CUDA; fp16 or
    bf16; ``cu_seqlens`` int32 on the device, ``max_seqlen`` bounding every segment): one
    call per layer and no per-shape plans, where the grouping makes several cuDNN calls per
    layer, each with a graph built per new (batch, length) shape."""
    return torch.ops.aten._flash_attention_forward(
        q, k, v, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen, 0.0, False, False,
        scale=scale)[0]


def get_vision_attention_backend(name: str, device: torch.device, dtype: torch.dtype | None = None):
    """None (torch SDPA, grouped by segment length) for `torch`; a function of
    ``(q, k, v, cu_seqlens, max_seqlen)`` making one launch for every image or window for
    `flash` (torch's varlen FlashAttention; fp16 or bf16) and `triton` (ours), CUDA only;
    `auto` (`config.auto_kernels`): `flash` on CUDA in fp16 or bf16, else `torch` (an
    engine's config comes resolved)."""
    if name == "auto":
        dtype_name = None if dtype is None else str(dtype).removeprefix("torch.")
        name = auto_kernels(device.type, False, dtype_name)["vision_attention_backend"]
    if name == "torch":
        return None
    if name == "flash":
        if device.type != "cuda":
            raise ValueError("the flash vision attention backend needs a CUDA device")
        if dtype is not None and dtype not in (torch.float16, torch.bfloat16):
            raise ValueError(f"the flash vision attention backend needs float16 or bfloat16, "
                             f"not {dtype}")
        return varlen_attention_flash
    if name == "triton":
        if device.type != "cuda":
            raise ValueError("the triton vision attention backend needs a CUDA device")
        from vlmserve.layers.triton_attention import varlen_attention_triton

        return varlen_attention_triton
    raise ValueError(f"unknown vision attention backend {name!r}; choose auto, torch, flash "
                     "or triton")


def graph_attention(device: torch.device, dtype: torch.dtype):
    """The attention a vision CUDA graph captures where the eager steps run SDPA: one launch
    over device ``cu_seqlens``, `flash` in float16 or bfloat16, else `triton` (CUDA)."""
    name = "flash" if dtype in (torch.float16, torch.bfloat16) else "triton"
    return get_vision_attention_backend(name, device, dtype)
