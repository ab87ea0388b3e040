"""Triton attention kernels: paged KV attention for mixed steps and varlen vision attention.

``paged_attention_triton`` is a drop-in for ``paged_attention_reference``: one launch covers a
step mixing decodes and prefill chunks. A program owns one query tile of one request and one KV
head; the tile's rows are ``BLOCK_Q`` query tokens x the ``G`` query heads sharing that KV head,
so each K/V tile is loaded once for all of them. Keys are walked in ``BLOCK_N`` tiles gathered
through the block table, with an fp32 online softmax (base 2); the causal mask is applied only
to the tiles past the tile's first query position. Decode-only steps with few (request, KV head)
pairs split the context across programs (flash-decoding) and merge the partial results in a
second small kernel. An FP8 cache (`layers/kv_quant.py`) is read as e4m3 and converted in
registers; its scales are folded into the score scale (keys) and the output (values).

``varlen_attention_triton`` is the non-causal packed-segment attention of the vision towers.

Grid axis 0 enumerates query tiles. A program finds its request/segment either directly
(``cdiv(max_len, BLOCK)`` programs per sequence: exact for decodes and equal-length segments)
or, when that would launch mostly idle programs, by a binary search over ``start // BLOCK + i``
(a tile numbering that needs no prefix sums; ``total // BLOCK + num_seqs`` programs). Programs
past their sequence's end exit at once. Nothing reads device values on the host, so both
functions can be captured in CUDA graphs.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from vlmserve.layers import attention_launch as launch
from vlmserve.layers import kv_quant
from vlmserve.layers.attention import AttentionMetadata, Window
from vlmserve.layers.attention_launch import num_sms as _num_sms

_LOG2E = 1.4426950408889634
_MIN_SPLIT_TOKENS = launch.MIN_SPLIT_TOKENS
DECODE_TILE = None  # bf16/fp16 decode (BLOCK_N, num_warps, num_stages): set to force (sweeps)


@triton.jit
def _find_seq(
    pid, starts_ptr, num_seqs, tiles_per_seq, BLOCK: tl.constexpr, SEARCH_ITERS: tl.constexpr,
    REVERSE: tl.constexpr,
):
    """(sequence index, tile index inside it) of tile program ``pid``.

    Each sequence owns a range of ``count`` program ids, of which the first ``cdiv(len, BLOCK)``
    tiles are real. REVERSE hands a sequence's last (for causal attention: heaviest) tiles to
    its first programs, so they start early; the excess tiles still exit.
    """
    if SEARCH_ITERS == 0:
        seq = pid // tiles_per_seq
        tile = pid - seq * tiles_per_seq
        count = tiles_per_seq
    else:
        # Sequence i owns program ids [starts[i] // BLOCK + i, starts[i + 1] // BLOCK + i + 1).
        lo = pid * 0
        hi = lo + num_seqs
        for _ in tl.static_range(SEARCH_ITERS):
            mid = (lo + hi) // 2
            go = tl.load(starts_ptr + mid) // BLOCK + mid <= pid
            lo = tl.where(go, mid, lo)
            hi = tl.where(go, hi, mid)
        seq = lo
        first = tl.load(starts_ptr + seq) // BLOCK + seq
        tile = pid - first
        count = tl.load(starts_ptr + seq + 1) // BLOCK + seq + 1 - first
    if REVERSE:
        tile = count - 1 - tile
    return seq, tile


@triton.jit
def _load_tile(rows, offs_d, key_ok, MASK_KEYS: tl.constexpr, HEAD_DIM: tl.constexpr,
               D_PAD: tl.constexpr):
    """[BLOCK_N, D_PAD] tile at row pointers ``rows``, masked only where needed."""
    ptrs = rows[:, None] + offs_d[None, :]
    if MASK_KEYS:
        if HEAD_DIM == D_PAD:
            x = tl.load(ptrs, mask=key_ok[:, None], other=0.0)
        else:
            x = tl.load(ptrs, mask=key_ok[:, None] & (offs_d[None, :] < HEAD_DIM), other=0.0)
    elif HEAD_DIM == D_PAD:
        x = tl.load(ptrs)
    else:
        x = tl.load(ptrs, mask=(offs_d < HEAD_DIM)[None, :], other=0.0)
    return x


@triton.jit
def _dot(a, b, DOT_PREC: tl.constexpr):
    if DOT_PREC == "interpreter":  # the CPU interpreter mis-multiplies bf16: go through fp32
        c = tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    else:
        c = tl.dot(a, b, input_precision=DOT_PREC)
    return c


@triton.jit
def _attend(
    q, m_i, l_i, acc, k_rows, v_rows, keys, key_ok, pos, offs_d, qk_scale,
    HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, MASK_KEYS: tl.constexpr,
    CAUSAL: tl.constexpr, DOT_PREC: tl.constexpr, row_lo=None, softcap=None,
    LOWER: tl.constexpr = False, SOFTCAP: tl.constexpr = False,
):
    """One online-softmax step over a key tile. k_rows/v_rows: [BLOCK_N] row pointers. Each
    row sees keys up to its `pos` (CAUSAL) and from its `row_lo` (LOWER); with SOFTCAP the
    scores are ``tanh(s / cap) * cap`` (`qk_scale` then scale / cap, `softcap` cap in log2
    units). K and V tiles are read in the query's dtype (an FP8 cache's values exactly)."""
    k = _load_tile(k_rows, offs_d, key_ok, MASK_KEYS, HEAD_DIM, D_PAD).to(q.dtype)
    s = _dot(q, tl.trans(k), DOT_PREC) * qk_scale  # [M, N], log2 units
    if SOFTCAP:
        t = tl.exp(-2.0 * tl.abs(s))  # tanh(|s|) = (1 - t) / (1 + t), never overflowing
        s = tl.where(s < 0, t - 1.0, 1.0 - t) / (1.0 + t) * softcap
    if MASK_KEYS:
        ok = key_ok[None, :]
        if CAUSAL:
            ok = ok & (keys[None, :] <= pos[:, None])
        if LOWER:
            ok = ok & (keys[None, :] >= row_lo[:, None])
        s = tl.where(ok, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_new = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows with nothing visible yet
    else:
        m_new = tl.maximum(m_i, tl.max(s, 1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    v = _load_tile(v_rows, offs_d, key_ok, MASK_KEYS, HEAD_DIM, D_PAD).to(q.dtype)
    acc = acc * alpha[:, None] + _dot(p.to(v.dtype), v, DOT_PREC)
    return m_new, l_i, acc


# Sizes that change from step to step are plain runtime ints (no recompile when one is 1 or a
# multiple of 16), and so is the block-table row stride (the step's longest block list; read
# once per program); the other strides are fixed by the model and stay specialised for
# vectorised loads.
@triton.jit(do_not_specialize=["num_reqs", "tiles_per_seq", "num_tokens", "num_heads",
                               "num_splits", "stride_bt", "window"])
def _paged_attn_kernel(
    q_ptr, k_ptr, v_ptr, out_ptr, part_acc_ptr, part_ml_ptr,
    block_tables_ptr, qsl_ptr, seq_lens_ptr, spans_ptr, kv_scales_ptr,
    qk_scale, softcap, num_reqs, tiles_per_seq, num_tokens, num_heads, num_splits, window,
    stride_qt, stride_qh, stride_ot, stride_oh,
    stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh, stride_bt,
    G: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr,
    SEARCH_ITERS: tl.constexpr, SPLIT_KV: tl.constexpr, DOT_PREC: tl.constexpr,
    WINDOW: tl.constexpr = 0, SPANS: tl.constexpr = False, SOFTCAP: tl.constexpr = False,
    WINDOWED: tl.constexpr = False, FP8_KV: tl.constexpr = False,
):
    """WINDOW: 0 causal, 1 sliding (the last `window` positions), 2 chunked (the query's
    chunk of `window`); SPANS: per token [first, end) of the span it reads both ways
    (`spans_ptr` [T, 2] int32; first > end for none), widening its visible keys; WINDOWED:
    either (every tile then masked, from each row's first key). FP8_KV: the cache holds
    e4m3 values of keys / k_scale and values / v_scale (`kv_scales_ptr`: [2] float32):
    k_scale joins the score scale, v_scale the output."""
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    req, tile = _find_seq(
        tl.program_id(0), qsl_ptr, num_reqs, tiles_per_seq, BLOCK_Q, SEARCH_ITERS, True
    )
    q_start = tl.load(qsl_ptr + req)
    q_len = tl.load(qsl_ptr + req + 1) - q_start
    if tile * BLOCK_Q >= q_len:
        return
    ctx = tl.load(seq_lens_ptr + req) - q_len  # absolute position of the request's query 0

    rows = tl.arange(0, BLOCK_M)
    qi = tile * BLOCK_Q + rows // G  # query index inside the request
    head = kvh * G + rows % G
    row_ok = (rows < BLOCK_Q * G) & (qi < q_len)
    pos = ctx + qi
    tok = (q_start + qi).to(tl.int64)
    offs_d = tl.arange(0, D_PAD)
    qd_mask = row_ok[:, None] & (offs_d[None, :] < HEAD_DIM)
    q = tl.load(q_ptr + tok[:, None] * stride_qt + head[:, None] * stride_qh + offs_d[None, :],
                mask=qd_mask, other=0.0)

    if FP8_KV:
        qk_scale = qk_scale * tl.load(kv_scales_ptr)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, D_PAD], tl.float32)
    bt_row = block_tables_ptr + req.to(tl.int64) * stride_bt
    k_head = k_ptr + kvh * stride_kh
    v_head = v_ptr + kvh * stride_vh
    offs_n = tl.arange(0, BLOCK_N)
    if WINDOWED:
        # each row's keys [row_lo, row_hi); the program's [lo, hi), every tile masked
        if WINDOW == 1:
            row_lo = tl.maximum(pos - window + 1, 0)
        elif WINDOW == 2:
            row_lo = pos // window * window
        else:
            row_lo = pos * 0
        last = pos
        if SPANS:
            first = tl.load(spans_ptr + tok * 2, mask=row_ok, other=1 << 30)
            end = tl.load(spans_ptr + tok * 2 + 1, mask=row_ok, other=0)
            row_lo = tl.minimum(row_lo, first)
            last = tl.maximum(pos, end - 1)
        lo = tl.min(tl.where(row_ok, row_lo, 1 << 30), 0)
        hi = tl.max(tl.where(row_ok, last + 1, 0), 0)
        if SPLIT_KV:
            chunk = tl.cdiv(tl.cdiv(hi - lo, num_splits), BLOCK_N) * BLOCK_N
            lo = lo + split * chunk
            hi = tl.minimum(lo + chunk, hi)
        full_end = lo
    else:
        # Keys [lo, hi) of this program; those below `free` are visible to every row.
        row_lo = pos
        last = pos
        kv_end = ctx + tl.minimum(tile * BLOCK_Q + BLOCK_Q, q_len)
        free = ctx + tile * BLOCK_Q + 1
        if SPLIT_KV:
            chunk = tl.cdiv(tl.cdiv(kv_end, num_splits), BLOCK_N) * BLOCK_N
            lo = split * chunk
            hi = tl.minimum(lo + chunk, kv_end)
        else:
            lo = kv_end * 0
            hi = kv_end
        full_end = lo + tl.maximum(tl.minimum(free, hi) - lo, 0) // BLOCK_N * BLOCK_N
        for start in range(lo, full_end, BLOCK_N):
            keys = start + offs_n
            blk = tl.load(bt_row + keys // BLOCK_SIZE).to(tl.int64)
            slot = keys % BLOCK_SIZE
            m_i, l_i, acc = _attend(
                q, m_i, l_i, acc, k_head + blk * stride_kb + slot * stride_kt,
                v_head + blk * stride_vb + slot * stride_vt, keys, None, pos, offs_d, qk_scale,
                HEAD_DIM, D_PAD, False, False, DOT_PREC, None, softcap, False, SOFTCAP,
            )
    # the tiles some row of the program may not see: masked (each row's [row_lo, last])
    for start in range(full_end, hi, BLOCK_N):
        keys = start + offs_n
        key_ok = keys < hi
        blk = tl.load(bt_row + keys // BLOCK_SIZE, mask=key_ok, other=0).to(tl.int64)
        slot = keys % BLOCK_SIZE
        m_i, l_i, acc = _attend(
            q, m_i, l_i, acc, k_head + blk * stride_kb + slot * stride_kt,
            v_head + blk * stride_vb + slot * stride_vt, keys, key_ok, last, offs_d, qk_scale,
            HEAD_DIM, D_PAD, True, True, DOT_PREC, row_lo, softcap, WINDOWED, SOFTCAP,
        )

    if FP8_KV:
        acc = acc * tl.load(kv_scales_ptr + 1)
    if SPLIT_KV:
        # Partials: acc [num_splits, T, H, HEAD_DIM], (m, l) [2, num_splits, T, H], fp32.
        ml = (split * num_tokens + tok) * num_heads + head
        tl.store(part_acc_ptr + ml[:, None] * HEAD_DIM + offs_d[None, :], acc, mask=qd_mask)
        tl.store(part_ml_ptr + ml, m_i, mask=row_ok)
        tl.store(part_ml_ptr + num_splits * num_tokens * num_heads + ml, l_i, mask=row_ok)
    else:
        out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
        tl.store(out_ptr + tok[:, None] * stride_ot + head[:, None] * stride_oh + offs_d[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=qd_mask)


@triton.jit(do_not_specialize=["num_tokens", "num_heads", "num_splits"])
def _merge_splits_kernel(
    part_acc_ptr, part_ml_ptr, out_ptr, num_tokens, num_heads, num_splits, stride_ot, stride_oh,
    SPLITS_PAD: tl.constexpr, HEAD_DIM: tl.constexpr,
    D_PAD: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    s = tl.arange(0, SPLITS_PAD)
    s_ok = s < num_splits
    ml = (s * num_tokens + t) * num_heads + h
    m = tl.load(part_ml_ptr + ml, mask=s_ok, other=float("-inf"))
    lse = tl.load(part_ml_ptr + num_splits * num_tokens * num_heads + ml, mask=s_ok, other=0.0)
    m_max = tl.max(m, 0)
    m_max = tl.where(m_max == float("-inf"), 0.0, m_max)
    w = tl.exp2(m - m_max)  # empty splits have m = -inf -> weight 0
    offs_d = tl.arange(0, D_PAD)
    acc = tl.load(part_acc_ptr + ml[:, None] * HEAD_DIM + offs_d[None, :],
                  mask=s_ok[:, None] & (offs_d[None, :] < HEAD_DIM), other=0.0)
    num = tl.sum(acc * w[:, None], 0)
    den = tl.sum(lse * w, 0)
    out = num / tl.where(den == 0.0, 1.0, den)
    tl.store(out_ptr + t * stride_ot + h * stride_oh + offs_d, out.to(out_ptr.dtype.element_ty),
             mask=offs_d < HEAD_DIM)


@triton.jit(do_not_specialize=["num_seqs", "tiles_per_seq"])
def _varlen_attn_kernel(
    q_ptr, k_ptr, v_ptr, out_ptr, cu_ptr, qk_scale, num_seqs, tiles_per_seq,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_ot, stride_oh,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr,
    SEARCH_ITERS: tl.constexpr, DOT_PREC: tl.constexpr,
):
    h = tl.program_id(1)
    seg, tile = _find_seq(tl.program_id(0), cu_ptr, num_seqs, tiles_per_seq, BLOCK_M,
                          SEARCH_ITERS, False)
    start = tl.load(cu_ptr + seg)
    end = tl.load(cu_ptr + seg + 1)
    if tile * BLOCK_M >= end - start:
        return
    rows = tile * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < end - start
    tok = (start + rows).to(tl.int64)
    offs_d = tl.arange(0, D_PAD)
    qd_mask = row_ok[:, None] & (offs_d[None, :] < HEAD_DIM)
    q = tl.load(q_ptr + tok[:, None] * stride_qt + h * stride_qh + offs_d[None, :],
                mask=qd_mask, other=0.0)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, D_PAD], tl.float32)
    k_head = k_ptr + h * stride_kh
    v_head = v_ptr + h * stride_vh
    offs_n = tl.arange(0, BLOCK_N)
    full_end = start + (end - start) // BLOCK_N * BLOCK_N
    for kv in range(start, full_end, BLOCK_N):
        keys = (kv + offs_n).to(tl.int64)
        m_i, l_i, acc = _attend(
            q, m_i, l_i, acc, k_head + keys * stride_kt, v_head + keys * stride_vt, keys, None,
            None, offs_d, qk_scale, HEAD_DIM, D_PAD, False, False, DOT_PREC,
        )
    for kv in range(full_end, end, BLOCK_N):
        keys = (kv + offs_n).to(tl.int64)
        m_i, l_i, acc = _attend(
            q, m_i, l_i, acc, k_head + keys * stride_kt, v_head + keys * stride_vt, keys,
            keys < end, None, offs_d, qk_scale, HEAD_DIM, D_PAD, True, False, DOT_PREC,
        )
    out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
    tl.store(out_ptr + tok[:, None] * stride_ot + h * stride_oh + offs_d[None, :],
             out.to(out_ptr.dtype.element_ty), mask=qd_mask)


def _dot_precision(dtype: torch.dtype) -> str:
    if os.environ.get("TRITON_INTERPRET") == "1":
        return "interpreter"
    return "ieee" if dtype == torch.float32 else "tf32"


def _out_buffer(q: torch.Tensor, out: torch.Tensor | None) -> torch.Tensor:
    if out is None:  # contiguous: the same strides (one compiled variant) for one token too
        return torch.empty(q.shape, dtype=q.dtype, device=q.device)
    if out.shape != q.shape or out.dtype != q.dtype or out.stride(-1) != 1:
        raise ValueError(f"out must be {tuple(q.shape)} {q.dtype} with a contiguous last dim")
    return out


def default_num_splits(batch: int, kv_heads: int, max_seq_len: int, device: torch.device) -> int:
    """Flash-decoding splits of a decode-only step (see `attention_launch`)."""
    return launch.default_num_splits(batch, kv_heads, max_seq_len, _num_sms(device),
                                     _MIN_SPLIT_TOKENS)


def paged_attention_triton(
    q: torch.Tensor,  # [T, heads, dim]
    kv_cache: torch.Tensor,  # [2, num_blocks, block_size, kv_heads, dim]
    meta: AttentionMetadata,
    scale: float,
    window: Window | None = None,
    softcap: float | None = None,
    kv_scales: torch.Tensor | None = None,
    *,
    num_splits: int | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention of each request's new tokens to its paged context (one launch),
    within ``window`` if given, both ways inside the step's `bidirectional` spans, scores
    soft-capped by ``softcap`` if given, an FP8 cache read times ``kv_scales`` (as
    `paged_attention_reference`).

    ``num_splits`` (decode-only steps) overrides the flash-decoding split count; any value is
    correct for any context length, so a CUDA graph may fix it at capture time. ``out``: an
    optional ``[T, heads, dim]`` buffer to write into.
    """
    T, H, D = q.shape
    _, _, block_size, Hkv, Dk = kv_cache.shape
    if Dk != D or H % Hkv:
        raise ValueError(f"q {tuple(q.shape)} does not match kv_cache {tuple(kv_cache.shape)}")
    if q.stride(-1) != 1 or kv_cache.stride(-1) != 1:
        raise ValueError("q and kv_cache need a contiguous head_dim")
    if block_size & (block_size - 1):
        raise ValueError(f"block_size must be a power of two, got {block_size}")
    if window is not None and window.clips_spans and meta.bidirectional:
        raise ValueError("a window that clips both-ways spans runs on the reference attention")
    G = H // Hkv
    B = meta.seq_lens.shape[0]
    out = _out_buffer(q, out)
    if T == 0:
        return out
    d_pad = max(16, triton.next_power_of_2(D))
    cfg = launch.paged_launch(T, B, meta.max_query_len, meta.max_seq_len, H, Hkv, D,
                              q.dtype == torch.float32, _num_sms(q.device),
                              num_splits=num_splits, decode_tile=DECODE_TILE,
                              min_split_tokens=_MIN_SPLIT_TOKENS)
    splits = cfg.splits
    if splits > 1:
        part_acc = torch.empty(splits, T, H, D, dtype=torch.float32, device=q.device)
        part_ml = torch.empty(2, splits, T, H, dtype=torch.float32, device=q.device)
    else:
        part_acc = part_ml = out  # unused
    k_cache, v_cache = kv_cache[0], kv_cache[1]
    bt = meta.block_tables
    spans = meta.token_spans()
    kind = {None: 0, "sliding": 1, "chunked": 2}[window.kind if window else None]
    fp8 = kv_quant.is_fp8(kv_cache)
    if fp8 and kv_scales is None:
        kv_scales = kv_quant.unit_scales(q.device)
    qk_scale, cap = scale * _LOG2E, 0.0
    if softcap:
        qk_scale, cap = scale / softcap, softcap * _LOG2E
    _paged_attn_kernel[(cfg.programs, Hkv, splits)](
        q, k_cache, v_cache, out, part_acc, part_ml, bt, meta.query_start_loc, meta.seq_lens,
        spans if spans is not None else meta.seq_lens, kv_scales if fp8 else meta.seq_lens,
        qk_scale, cap, B, cfg.tiles_per_seq, T, H, splits, window.size if window else 0,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), bt.stride(0),
        G=G, BLOCK_Q=cfg.block_q, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n,
        BLOCK_SIZE=block_size, HEAD_DIM=D, D_PAD=d_pad, SEARCH_ITERS=cfg.search_iters,
        SPLIT_KV=splits > 1, DOT_PREC=_dot_precision(q.dtype), WINDOW=kind,
        SPANS=spans is not None, SOFTCAP=bool(softcap), WINDOWED=kind != 0 or spans is not None,
        FP8_KV=fp8,
        num_warps=cfg.warps,
        num_stages=cfg.stages,
    )
    if splits > 1:
        _merge_splits_kernel[(T, H)](
            part_acc, part_ml, out, T, H, splits, out.stride(0), out.stride(1),
            SPLITS_PAD=cfg.merge_pad, HEAD_DIM=D, D_PAD=d_pad, num_warps=cfg.merge_warps,
        )
    return out


def varlen_attention_triton(
    q: torch.Tensor,  # [total, heads, dim]
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens: torch.Tensor,  # [num_seqs + 1] int32
    max_seqlen: int,
    scale: float | None = None,
    *,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Non-causal attention inside each packed segment, into ``out`` if given.

    No host sync: ``max_seqlen`` (which must bound every segment length) sizes the grid.
    """
    total, H, D = q.shape
    if k.shape != q.shape or v.shape != q.shape:
        raise ValueError("q, k and v must have the same shape")
    if q.stride(-1) != 1 or k.stride(-1) != 1 or v.stride(-1) != 1:
        raise ValueError("q, k and v need a contiguous head_dim")
    out = _out_buffer(q, out)
    num_seqs = cu_seqlens.shape[0] - 1
    if total == 0 or num_seqs <= 0:
        return out
    scale = D**-0.5 if scale is None else scale
    d_pad = max(16, triton.next_power_of_2(D))
    cfg = launch.varlen_launch(total, num_seqs, max_seqlen, q.dtype == torch.float32)
    _varlen_attn_kernel[(cfg.programs, H)](
        q, k, v, out, cu_seqlens, scale * _LOG2E, num_seqs, cfg.tiles_per_seq,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        out.stride(0), out.stride(1),
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, HEAD_DIM=D, D_PAD=d_pad,
        SEARCH_ITERS=cfg.search_iters, DOT_PREC=_dot_precision(q.dtype),
        num_warps=cfg.warps, num_stages=2,
    )
    return out


__all__ = ["default_num_splits", "paged_attention_triton", "varlen_attention_triton"]
