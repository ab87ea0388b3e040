"""Paged KV attention for a step that mixes prefill chunks and decodes.

The worker flattens every scheduled token of the step into one sequence of T tokens. Each
request's new keys/values are written to its KV blocks (`slot_mapping`), then each query
attends causally to its request's cached context. `AttentionMetadata` is built once per step
and passed to every layer; backends share it. The torch reference backend groups requests
(all single-token decodes in one padded batch, each prefill chunk on its own) and runs
`scaled_dot_product_attention` per group; it runs on CPU and GPU.
"""

from __future__ import annotations

import dataclasses
import itertools
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from vlmserve.config import auto_kernels
from vlmserve.layers import kv_quant
from vlmserve.utils import cuda_module_available, to_device


@dataclass
class AttentionGroup:
    """Requests attended together: padded to `max_q` queries and `max_kv` keys."""

    token_index: torch.Tensor  # [n] positions in the flat step of this group's tokens
    pad_index: torch.Tensor  # [n] positions of those tokens in the [B * max_q] padded batch
    block_tables: torch.Tensor  # [B, blocks] int64
    mask: torch.Tensor  # [B, 1, max_q, max_kv] bool, True where attention is allowed
    batch: int
    max_q: int


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [T] int64: cache slot (block * block_size + offset) per token
    query_start_loc: torch.Tensor  # [B + 1] int32
    seq_lens: torch.Tensor  # [B] int32: context length after this step
    block_tables: torch.Tensor  # [B, max_blocks] int64 (padded with 0)
    max_query_len: int
    max_seq_len: int
    block_size: int = 16
    query_lens_cpu: list[int] | None = None  # host copies, for the reference backend
    seq_lens_cpu: list[int] | None = None
    # spans whose tokens attend to each other both ways (request index, first, end: absolute
    # positions), e.g. an image's tokens in models that read images bidirectionally
    bidirectional: list[tuple[int, int, int]] | None = None
    # the other KV groups' metadata (models with several attention kinds: `for_group`)
    groups: list[AttentionMetadata] | None = None
    # the step's sequences as linear-attention layers read them (their state slots): a
    # `layers.linear_metadata.LinearAttentionMetadata`, in models that have such layers
    linear: Any = None
    _groups: dict[Window | None, list[AttentionGroup]] = field(default_factory=dict)
    _spans: torch.Tensor | None = None

    def for_group(self, group: int) -> AttentionMetadata:
        """The metadata of KV group `group` (this one for group 0): its block tables and
        slots, the step's tokens and spans alike."""
        return self if group == 0 else self.groups[group - 1]

    def token_spans(self) -> torch.Tensor | None:
        """[T, 2] int32 on the step's device: the span [first, end) each token reads both
        ways (first > end for none), or None where the step has no `bidirectional` spans;
        built once per step."""
        if not self.bidirectional:
            return None
        if self._spans is None:
            q, s = self.query_lens_cpu, self.seq_lens_cpu
            spans = torch.tensor([1 << 30, 0], dtype=torch.int32).repeat(sum(q), 1)
            starts = np.concatenate([[0], np.cumsum(q)])
            for r, first, end in self.bidirectional:
                ctx = s[r] - q[r]
                lo, hi = max(first, ctx), min(end, s[r])
                if lo < hi:
                    rows = spans[starts[r] + lo - ctx:starts[r] + hi - ctx]
                    rows[:, 0], rows[:, 1] = first, min(end, s[r])
            self._spans = to_device(spans, self.slot_mapping.device)
        return self._spans

    def reference_groups(self, window: Window | None = None) -> list[AttentionGroup]:
        """The reference backend's padded batches, built once per step and `window` on first
        use: all single-token decodes together, each prefill chunk on its own."""
        if window not in self._groups:
            q, s = self.query_lens_cpu, self.seq_lens_cpu
            starts = [0]
            for n in q:
                starts.append(starts[-1] + n)
            decodes = [i for i, n in enumerate(q) if n == 1]
            prefills = [[i] for i, n in enumerate(q) if n > 1]
            self._groups[window] = [
                _build_group(m, q, s, starts, self.block_tables, self.block_size, window,
                             self.bidirectional)
                for m in ([decodes] if decodes else []) + prefills]
        return self._groups[window]


@dataclass(frozen=True)
class Window:
    """Keys a layer's query sees besides the causal rule: the last `size` positions up to
    its own (``"sliding"``), or those of its own chunk of `size` positions (``"chunked"``,
    Llama 4's local layers). ``clips_spans``: the window bounds the step's `bidirectional`
    spans too (Gemma 4's sliding layers: an image token sees its image's tokens both ways,
    but none behind the window); otherwise a span is read whole (Gemma 3's)."""

    kind: str
    size: int
    clips_spans: bool = False

    def first_key(self, pos: int) -> int:
        """The first key position a query at `pos` sees."""
        if self.kind == "sliding":
            return max(pos - self.size + 1, 0)
        return pos // self.size * self.size

    def allows(self, qpos: torch.Tensor, kpos: torch.Tensor) -> torch.Tensor:
        if self.kind == "sliding":
            return kpos > qpos - self.size
        return kpos // self.size == qpos // self.size


def block_table_tensor(block_ids: list[list[int]], width: int | None = None) -> torch.Tensor:
    """[B, width] int64, rows padded with 0. Built from one flat array (a nested list through
    `torch.tensor` took 5 ms for 181 requests beside an 8k-token prompt: every step with a
    prompt chunk pays it on the host)."""
    lens = np.fromiter(map(len, block_ids), dtype=np.int64, count=len(block_ids))
    width = width or int(lens.max())
    flat = np.fromiter(itertools.chain.from_iterable(block_ids), dtype=np.int64,
                       count=int(lens.sum()))
    table = np.zeros((len(block_ids), width), dtype=np.int64)
    table[np.arange(width) < lens[:, None]] = flat  # row-major: each row's ids in order
    return torch.from_numpy(table)


def build_attention_metadata(
    query_lens: list[int],
    seq_lens: list[int],
    block_ids: list[list[int]],
    block_size: int,
    device: torch.device,
) -> AttentionMetadata:
    """query_lens[i] new tokens of request i end at context length seq_lens[i]."""
    table = block_table_tensor(block_ids)
    q = torch.tensor(query_lens, dtype=torch.int64)
    s = torch.tensor(seq_lens, dtype=torch.int64)
    starts = torch.zeros(len(query_lens) + 1, dtype=torch.int64)
    torch.cumsum(q, 0, out=starts[1:])
    return AttentionMetadata(
        slot_mapping=to_device(_slots(table, q, s, starts, block_size), device),
        query_start_loc=to_device(starts.to(torch.int32), device),
        seq_lens=to_device(s.to(torch.int32), device),
        block_tables=to_device(table, device),
        max_query_len=max(query_lens),
        max_seq_len=max(seq_lens),
        block_size=block_size,
        query_lens_cpu=list(query_lens),
        seq_lens_cpu=list(seq_lens),
    )


def _slots(table, q, s, starts, block_size: int) -> torch.Tensor:
    """[T] cache slot of each token of the step."""
    req = torch.repeat_interleave(torch.arange(len(q)), q)  # [T] request of each token
    pos = torch.arange(int(starts[-1])) - starts[req] + (s - q)[req]  # absolute positions
    return table[req, pos // block_size] * block_size + pos % block_size


def add_group_metadata(meta: AttentionMetadata, group_block_ids: list[list[list[int]]]
                       ) -> None:
    """Give `meta` (the first KV group's) the other KV groups' metadata: the same tokens
    and spans over each group's block tables (`group_block_ids[g][i]`: request i's table in
    group g + 1)."""
    q = torch.tensor(meta.query_lens_cpu, dtype=torch.int64)
    s = torch.tensor(meta.seq_lens_cpu, dtype=torch.int64)
    starts = torch.zeros(len(q) + 1, dtype=torch.int64)
    torch.cumsum(q, 0, out=starts[1:])
    device = meta.slot_mapping.device
    meta.groups = []
    for block_ids in group_block_ids:
        table = block_table_tensor(block_ids)
        meta.groups.append(dataclasses.replace(
            meta, slot_mapping=to_device(_slots(table, q, s, starts, meta.block_size), device),
            block_tables=to_device(table, device), groups=None, _groups={}))


def _build_group(members, query_lens, seq_lens, starts, table, block_size,
                 window: Window | None = None,
                 bidirectional: list[tuple[int, int, int]] | None = None):
    device = table.device
    max_q = max(query_lens[i] for i in members)
    max_kv = max(seq_lens[i] for i in members)
    nblocks = -(-max_kv // block_size)
    token_index, pad_index = [], []
    mask = torch.zeros(len(members), 1, max_q, nblocks * block_size, dtype=torch.bool)
    for b, i in enumerate(members):
        q, s = query_lens[i], seq_lens[i]
        token_index.extend(range(starts[i], starts[i] + q))
        pad_index.extend(range(b * max_q, b * max_q + q))
        qpos = torch.arange(s - q, s)[:, None]  # absolute position of each query
        kpos = torch.arange(s)[None, :]
        allowed = kpos <= qpos
        if window is not None and not window.clips_spans:
            allowed &= window.allows(qpos, kpos)
        for r, first, end in bidirectional or ():
            if r == i:
                allowed |= ((qpos >= first) & (qpos < end)) & ((kpos >= first) & (kpos < end))
        if window is not None and window.clips_spans:
            allowed &= window.allows(qpos, kpos)
        mask[b, 0, :q, :s] = allowed
        mask[b, 0, q:, 0] = True  # padded query rows attend somewhere (discarded)
    return AttentionGroup(
        token_index=to_device(torch.tensor(token_index, dtype=torch.int64), device),
        pad_index=to_device(torch.tensor(pad_index, dtype=torch.int64), device),
        block_tables=table[members, :nblocks],
        mask=to_device(mask, device),
        batch=len(members),
        max_q=max_q,
    )


def write_kv(kv_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor,
             kv_scales: torch.Tensor | None = None):
    """kv_cache: [2, num_blocks, block_size, kv_heads, head_dim]; k, v: [T, kv_heads, dim].
    An FP8 cache takes them quantized by `kv_scales` ([k_scale, v_scale]; None: 1.0)."""
    if kv_quant.is_fp8(kv_cache):
        s = kv_quant.unit_scales(k.device) if kv_scales is None else kv_scales
        k, v = kv_quant.quantize(k, s[0]), kv_quant.quantize(v, s[1])
        kv_cache, k, v = (t.view(torch.uint8) for t in (kv_cache, k, v))  # no fp8 index_copy_
    flat = kv_cache.view(2, -1, *kv_cache.shape[-2:])
    flat[0].index_copy_(0, slots, k)
    flat[1].index_copy_(0, slots, v)


def paged_attention_reference(
    q: torch.Tensor,  # [T, heads, dim]
    kv_cache: torch.Tensor,  # [2, num_blocks, block_size, kv_heads, dim]
    meta: AttentionMetadata,
    scale: float,
    window: Window | None = None,
    softcap: float | None = None,
    kv_scales: torch.Tensor | None = None,
) -> torch.Tensor:
    """Each query over its request's cached keys: causal, within ``window`` if given, and
    both ways inside the step's `bidirectional` spans; with ``softcap``, the scores capped
    (``tanh(s / cap) * cap``, Gemma 2's) before the softmax. An FP8 cache is read back
    times `kv_scales` ([k_scale, v_scale]; None: 1.0)."""
    T, H, D = q.shape
    Hkv = kv_cache.shape[-2]
    G = H // Hkv  # query heads per KV head: folded into the query axis, K/V never repeated
    out = q.new_empty(T, H, D)
    fp8 = kv_quant.is_fp8(kv_cache)
    if fp8 and kv_scales is None:
        kv_scales = kv_quant.unit_scales(q.device)

    def read(plane: int, g: AttentionGroup) -> torch.Tensor:  # [B, Hkv, keys, D]
        x = kv_cache[plane][g.block_tables].view(g.batch, -1, Hkv, D).transpose(1, 2)
        return kv_quant.dequantize(x, kv_scales[plane], q.dtype) if fp8 else x

    for g in meta.reference_groups(window):
        qp = q.new_zeros(g.batch * g.max_q, H, D)
        qp[g.pad_index] = q[g.token_index]
        # [B, max_q, Hkv, G, D] -> [B, Hkv, G * max_q, D]
        qp = qp.view(g.batch, g.max_q, Hkv, G, D).permute(0, 2, 3, 1, 4)
        qp = qp.reshape(g.batch, Hkv, G * g.max_q, D)
        k, v = read(0, g), read(1, g)
        mask = g.mask if g.max_q == 1 else g.mask.repeat(1, 1, G, 1)
        if softcap is None:
            o = F.scaled_dot_product_attention(qp, k, v, attn_mask=mask, scale=scale)
        else:
            s = torch.tanh((qp @ k.transpose(-1, -2)) * (scale / softcap)) * softcap
            o = torch.softmax(s.masked_fill(~mask, float("-inf")), dim=-1).to(v.dtype) @ v
        # [B, Hkv, G * max_q, D] -> [B * max_q, H, D]
        o = o.view(g.batch, Hkv, G, g.max_q, D).permute(0, 3, 1, 2, 4)
        out[g.token_index] = o.reshape(g.batch * g.max_q, H, D)[g.pad_index]
    return out


def triton_available(device: torch.device) -> bool:
    """Triton kernels can run here: a CUDA device and an importable triton."""
    return cuda_module_available(device, "triton")


def get_paged_attention_backend(name: str, device: torch.device):
    """`torch` (reference, any device), `triton` (CUDA), or `auto` (`config.auto_kernels`:
    triton on CUDA when importable; an engine's config comes resolved)."""
    if name == "auto":
        name = auto_kernels(device.type, triton_available(device), None)["attention_backend"]
    if name == "torch":
        return paged_attention_reference
    if name == "triton":
        if device.type != "cuda":
            raise ValueError("the triton attention backend needs a CUDA device")
        from vlmserve.layers.triton_attention import paged_attention_triton

        return paged_attention_triton
    raise ValueError(f"unknown attention backend {name!r}; choose auto, torch or triton")
