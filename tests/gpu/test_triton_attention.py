"""Triton attention kernels against the torch references.

Runs on CUDA at serving shapes, or on CPU through Triton's interpreter at small shapes:

    TRITON_INTERPRET=1 python -m pytest -q tests/gpu/test_triton_attention.py
"""

from __future__ import annotations

import random

import pytest
import torch

from tests.gpu.triton_target import DEVICE, ON_GPU  # first: skips without triton
from vlmserve.layers import kv_quant, triton_attention
from vlmserve.layers.attention import (
    Window,
    build_attention_metadata,
    paged_attention_reference,
)
from vlmserve.layers.triton_attention import (
    paged_attention_triton,
    varlen_attention_triton,
)
from vlmserve.layers.vision_attention import varlen_attention

# numpy warns about the interpreter's 1-element-array-to-int conversions.
pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")

# Sizes: serving shapes on the GPU, small ones for the (slow) interpreter, which CI runs on
# two CPU cores: there every (model, dtype) pair takes one of the two block sizes, so each
# model and each dtype still meets both.
MAX_CTX = 4000 if ON_GPU else 200
MAX_CHUNK = 2048 if ON_GPU else 50
DECODE_BATCHES = (1, 7, 64) if ON_GPU else (1, 6)
MAX_SEG = 4096 if ON_GPU else 150
MAX_SEGS = 16 if ON_GPU else 5
TOL = {torch.bfloat16: 1e-2, torch.float32: 1e-4}
# (heads, kv_heads, head_dim): GQA 1, Qwen2-VL-2B (6), Qwen2.5-VL-7B (7), head_dim 80.
MODELS = [(8, 8, 64), (12, 2, 128), (28, 4, 128), (8, 2, 80)]
if not ON_GPU:  # GQA 1, 7 (not a power of two), head_dim 80 (padded)
    MODELS = [(2, 2, 64), (7, 1, 128), (4, 2, 80)]
GQA_MODEL = (12, 2, 128) if ON_GPU else (7, 1, 128)


def _model_id(model: tuple[int, int, int]) -> str:
    h, kv, d = model
    return f"H{h}-KV{kv}-D{d}"


def _dtype_id(dtype: torch.dtype) -> str:
    return "bf16" if dtype == torch.bfloat16 else "fp32"


_ALL_DTYPES = [torch.bfloat16, torch.float32]
_LAYOUTS = [(m, bs, dt) for m in MODELS for dt in _ALL_DTYPES for bs in (16, 32)
            if ON_GPU or bs == (16, 32)[(MODELS.index(m) + _ALL_DTYPES.index(dt)) % 2]]
# (model, block_size, dtype): every combination on the GPU, pairwise in the interpreter
LAYOUTS = pytest.mark.parametrize(
    "model,block_size,dtype", _LAYOUTS,
    ids=[f"{_model_id(m)}-bs{bs}-{_dtype_id(dt)}" for m, bs, dt in _LAYOUTS])


def _ref_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float32 else torch.float32


def _check(out: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype, what: str) -> None:
    assert not out.isnan().any(), f"{what}: output elements left unwritten (NaN)"
    err = ((out.to(ref.dtype) - ref).norm() / ref.norm()).item()
    assert err < TOL[dtype], f"{what}: relative error {err:.3e}"


def _run_paged(
    rng: random.Random,
    query_lens: list[int],
    seq_lens: list[int],
    model: tuple[int, int, int],
    block_size: int,
    dtype: torch.dtype,
    num_splits: int | None = None,
    window: Window | None = None,
    softcap: float | None = None,
    spans: list[tuple[int, int, int]] | None = None,
    kv_scales: tuple[float, float] | None = None,
    head_major: bool = False,
) -> None:
    """`window`: its blocks before the first query's window point at one shared block of
    huge values (a windowed cache group's freed places); `spans`: read both ways;
    `kv_scales`: an FP8 cache of those (k, v) scales, the reference reading it dequantized;
    `head_major`: the queries a view of [heads, T, dim] (as transformers' attention
    interface hands them to the backend), not contiguous."""
    H, Hkv, D = model
    gen = torch.Generator(DEVICE).manual_seed(rng.randrange(1 << 30))
    counts = [-(-s // block_size) for s in seq_lens]
    num_blocks = sum(counts) + 4
    cpu_gen = torch.Generator().manual_seed(rng.randrange(1 << 30))
    perm = torch.randperm(num_blocks, generator=cpu_gen).tolist()  # scattered, unordered blocks
    block_ids, used = [], 0
    for n in counts:
        block_ids.append(perm[used : used + n])
        used += n
    if window is not None:
        null = num_blocks - 1
        for blocks, q_len, s in zip(block_ids, query_lens, seq_lens):
            first = min(min([window.first_key(p)] + [a for _, a, b in spans or ()
                                                     if a <= p < b])
                        for p in range(s - q_len, s))
            blocks[:first // block_size] = [null] * (first // block_size)
    meta = build_attention_metadata(query_lens, seq_lens, block_ids, block_size, DEVICE)
    meta.bidirectional = spans
    q = torch.randn(sum(query_lens), H, D, generator=gen, device=DEVICE).to(dtype)
    if head_major:
        q = q.transpose(0, 1).contiguous().transpose(0, 1)
    kv = torch.randn(2, num_blocks, block_size, Hkv, D, generator=gen, device=DEVICE)
    # Slots outside every context hold huge values: reading one would wreck the result.
    live = torch.zeros(num_blocks * block_size, dtype=torch.bool)
    for blocks, s in zip(block_ids, seq_lens):
        pos = torch.arange(s)
        pos = pos[torch.tensor(blocks)[pos // block_size] != num_blocks - 1] if window else pos
        live[torch.tensor(blocks)[pos // block_size] * block_size + pos % block_size] = True
    kv.view(2, -1, Hkv, D)[:, ~live.to(DEVICE)] = 1e4
    scale = D**-0.5
    rdt = _ref_dtype(dtype)
    fp8_scales = None
    if kv_scales is None:
        kv = kv.to(dtype)
        ref_kv = kv.to(rdt)
    else:  # those huge values clamp to 448 x scale: still far out of the others' range
        fp8_scales = torch.tensor(kv_scales, device=DEVICE)
        planes = fp8_scales.view(2, 1, 1, 1, 1)
        kv = kv_quant.quantize(kv, planes)
        ref_kv = kv_quant.dequantize(kv, planes, rdt)
    ref = paged_attention_reference(q.to(rdt), ref_kv, meta, scale, window, softcap)
    out = torch.full_like(q, float("nan"))
    paged_attention_triton(q, kv, meta, scale, window, softcap, kv_scales=fp8_scales,
                           num_splits=num_splits, out=out)
    what = (f"q={query_lens[:8]} ctx={seq_lens[:8]} model={model} bs={block_size} {dtype} "
            f"window={window} softcap={softcap} spans={spans} kv_scales={kv_scales}")
    _check(out, ref, dtype, f"{what} splits={num_splits}")


@LAYOUTS
@pytest.mark.parametrize("batch", DECODE_BATCHES, ids=[f"B{b}" for b in DECODE_BATCHES])
def test_paged_decode(batch, model, block_size, dtype):
    rng = random.Random(f"decode{batch}{model}{block_size}{dtype}")
    seq_lens = [rng.randint(1, MAX_CTX) for _ in range(batch)]
    seq_lens[0] = MAX_CTX if batch > 1 else seq_lens[0]
    for splits in (None, 1, 3) if dtype == torch.bfloat16 else (None, 5):
        _run_paged(rng, [1] * batch, seq_lens, model, block_size, dtype, splits)


@pytest.mark.parametrize("splits", [2, 7, 64])
def test_paged_decode_forced_splits(splits):
    """Split counts beyond what some contexts can fill (empty splits must merge to nothing)."""
    rng = random.Random(f"splits{splits}")
    seq_lens = [1, 2, 17, MAX_CTX // 3, MAX_CTX]
    _run_paged(rng, [1] * len(seq_lens), seq_lens, GQA_MODEL, 16, torch.bfloat16, splits)


@pytest.mark.parametrize("dtype", _ALL_DTYPES, ids=_dtype_id)
def test_paged_queries_laid_out_head_major(dtype):
    """A prefill chunk beside decodes, the queries strided head-major: the same answer."""
    rng = random.Random(f"headmajor{dtype}")
    query_lens = [MAX_CHUNK // 2, 1, 1, 3]
    seq_lens = [MAX_CHUNK // 2 + 7, MAX_CTX // 2, 5, MAX_CTX]
    _run_paged(rng, query_lens, seq_lens, GQA_MODEL, 16, dtype, head_major=True)


@LAYOUTS
def test_paged_prefill(model, block_size, dtype):
    rng = random.Random(f"prefill{model}{block_size}{dtype}")
    cases = [([MAX_CHUNK], [MAX_CHUNK]),  # first chunk, no prior context
             ([MAX_CHUNK], [MAX_CHUNK + MAX_CTX]),  # chunk after a long prefix
             ([1], [1]), ([1], [MAX_CTX // 2])]
    chunks = [rng.randint(1, MAX_CHUNK) for _ in range(3)]
    cases.append((chunks, [c + rng.randint(0, MAX_CTX) for c in chunks]))
    for query_lens, seq_lens in cases:
        _run_paged(rng, query_lens, seq_lens, model, block_size, dtype)


_MIXED = [(m, dt, seed) for m in MODELS for dt in _ALL_DTYPES for seed in (0, 1)
          if ON_GPU or seed == (MODELS.index(m) + _ALL_DTYPES.index(dt)) % 2]


@pytest.mark.parametrize("model,dtype,seed", _MIXED,
                         ids=[f"{seed}-{_model_id(m)}-{_dtype_id(dt)}" for m, dt, seed in _MIXED])
def test_paged_mixed(model, dtype, seed):
    """Decodes and prefill chunks of many lengths in one step (both program-mapping modes)."""
    rng = random.Random(f"mixed{model}{dtype}{seed}")
    n_dec = rng.randint(1, 40 if ON_GPU else 5)
    query_lens = [1] * n_dec + [rng.randint(2, MAX_CHUNK) for _ in range(rng.randint(1, 4))]
    query_lens.append(MAX_CHUNK)
    rng.shuffle(query_lens)
    seq_lens = [q + rng.randint(0, MAX_CTX) for q in query_lens]
    _run_paged(rng, query_lens, seq_lens, model, rng.choice([16, 32]), dtype)


@pytest.mark.parametrize("num_sms", [1, 1000])
def test_paged_tile_policies(monkeypatch, num_sms):
    """Pretend a tiny GPU (128-row prefill tiles) or a huge one (auto splits on short contexts)."""
    monkeypatch.setattr(triton_attention, "_num_sms", lambda device: num_sms)
    monkeypatch.setattr(triton_attention, "_MIN_SPLIT_TOKENS", 16)
    rng = random.Random(f"policy{num_sms}")
    for model in MODELS if ON_GPU else [GQA_MODEL]:
        query_lens = [1, MAX_CHUNK, 5, 1, MAX_CHUNK // 2]
        seq_lens = [q + rng.randint(0, MAX_CTX) for q in query_lens]
        _run_paged(rng, query_lens, seq_lens, model, 16, torch.bfloat16)
        _run_paged(rng, [1] * 3, [MAX_CTX, 40, 1], model, 32, torch.bfloat16)


_WINDOWS = [Window("sliding", 24), Window("sliding", 5), Window("chunked", 32)]


@pytest.mark.parametrize("window", _WINDOWS, ids=lambda w: f"{w.kind}{w.size}")
def test_paged_windows(window):
    """Sliding and chunked windows in decodes (split and not) and prefill chunks, over block
    tables whose passed places hold a block of huge values."""
    rng = random.Random(f"window{window}")
    model = GQA_MODEL
    for dtype in _ALL_DTYPES:
        seq_lens = [rng.randint(1, MAX_CTX) for _ in range(4)]
        for splits in (None, 3):
            _run_paged(rng, [1] * 4, seq_lens, model, 16, dtype, splits, window)
        query_lens = [1, MAX_CHUNK, 7, MAX_CHUNK // 2]
        seq_lens = [q + rng.randint(0, MAX_CTX) for q in query_lens]
        _run_paged(rng, query_lens, seq_lens, model, 16, dtype, window=window)


def test_paged_spans_both_ways_and_softcap():
    """Image spans read both ways inside prefill chunks (one cut by the chunk's start, one
    past a sliding window's reach), with and without a window, and soft-capped scores."""
    rng = random.Random("spans")
    query_lens, seq_lens = [1, 40, 30], [70, 100, 30]
    spans = [(1, 55, 65), (1, 75, 95), (2, 0, 25)]
    for window in (None, Window("sliding", 8)):
        for softcap in (None, 0.7):
            _run_paged(rng, query_lens, seq_lens, GQA_MODEL, 16, torch.float32,
                       window=window, softcap=softcap, spans=spans)
    _run_paged(rng, [1, 5], [50, 9], GQA_MODEL, 32, torch.bfloat16, softcap=1.3)


def test_paged_fp8_cache():
    """An FP8 cache (e4m3, per-tensor k and v scales) equals the reference reading the same
    cache dequantized: decodes (split and not) and prefill chunks beside decodes in 16 bits,
    a sliding window with spans read both ways and soft-capping in float32."""
    rng = random.Random("fp8")
    scales = (0.02, 0.05)
    for splits in (None, 3):
        _run_paged(rng, [1] * 3, [MAX_CTX, 40, 1], GQA_MODEL, 16, torch.bfloat16, splits,
                   kv_scales=scales)
    _run_paged(rng, [1, 24, 5], [60, 80, 5], (4, 2, 80), 32, torch.bfloat16,
               kv_scales=scales)
    _run_paged(rng, [1, 20], [50, 40], GQA_MODEL, 16, torch.float32,
               window=Window("sliding", 8), softcap=0.7, spans=[(1, 25, 35)],
               kv_scales=scales)


def _run_varlen(rng: random.Random, lengths: list[int], heads: int, dim: int,
                dtype: torch.dtype) -> None:
    gen = torch.Generator(DEVICE).manual_seed(rng.randrange(1 << 30))
    total = sum(lengths)
    cu = torch.tensor([0] + lengths, dtype=torch.int32).cumsum(0, dtype=torch.int32)
    q, k, v = (torch.randn(total, heads, dim, generator=gen, device=DEVICE).to(dtype)
               for _ in range(3))
    rdt = _ref_dtype(dtype)
    ref = varlen_attention(q.to(rdt), k.to(rdt), v.to(rdt), cu)
    out = torch.full_like(q, float("nan"))
    varlen_attention_triton(q, k, v, cu.to(DEVICE), max(lengths), out=out)
    _check(out, ref, dtype, f"varlen lengths={lengths[:8]} ({len(lengths)}) D={dim} {dtype}")


# (dim, dtype): every pair on the GPU; in the interpreter head_dim 80 (padded) in both dtypes
_VARLEN_DIMS = [(d, dt) for d in (80, 64, 128) for dt in _ALL_DTYPES
                if ON_GPU or d == 80 or (d == 64) == (dt == torch.bfloat16)]


@pytest.mark.parametrize("dim,dtype", _VARLEN_DIMS,
                         ids=[f"D{d}-{_dtype_id(dt)}" for d, dt in _VARLEN_DIMS])
@pytest.mark.parametrize("num_segs", sorted({1, 2, MAX_SEGS // 2 + 1, MAX_SEGS}) if ON_GPU
                         else [1, MAX_SEGS])
def test_varlen(num_segs, dim, dtype):
    rng = random.Random(f"varlen{num_segs}{dim}{dtype}")
    lengths = [rng.randint(1, MAX_SEG) for _ in range(num_segs)]
    lengths[0] = MAX_SEG if num_segs > 1 else lengths[0]
    # fp32 is checked against a float64 reference that materialises the scores: fewer heads.
    heads = (16 if dtype == torch.bfloat16 else 4) if ON_GPU else 2
    _run_varlen(rng, lengths, heads, dim, dtype)


@pytest.mark.parametrize("seg_len", [64, 16])
def test_varlen_windows(seg_len):
    """Qwen2.5-VL window attention: many equal windows, a few ragged ones at image edges."""
    rng = random.Random(f"windows{seg_len}")
    n = 300 if ON_GPU else 12
    lengths = [seg_len] * n
    for i in rng.sample(range(n), 3):
        lengths[i] = rng.randint(1, seg_len)
    _run_varlen(rng, lengths, 16 if ON_GPU else 2, 80, torch.bfloat16)
    _run_varlen(rng, [seg_len] * n, 16 if ON_GPU else 2, 80, torch.bfloat16)


def test_empty_segments_and_huge_segment():
    """Zero-length segments are skipped; one segment far longer than the rest."""
    lengths = [0, 5, 0, MAX_SEG, 1, 0, 33]
    gen = torch.Generator().manual_seed(0)
    total = sum(lengths)
    cu = torch.tensor([0] + lengths).cumsum(0).to(torch.int32)
    q, k, v = (torch.randn(total, 2, 80, generator=gen).to(DEVICE) for _ in range(3))
    ref = varlen_attention(q.double(), k.double(), v.double(), cu)
    out = torch.full_like(q, float("nan"))
    varlen_attention_triton(q, k, v, cu.to(DEVICE), max(lengths), out=out)
    _check(out, ref, torch.float32, "varlen with empty segments")


@pytest.mark.skipif(not ON_GPU, reason="CUDA graphs need a GPU")
def test_paged_decode_cuda_graph():
    """Capture once, then replay on new contexts written into the same metadata tensors."""
    H, Hkv, D, bs, B = 12, 2, 128, 16, 8
    max_blocks = 4096 // bs
    num_blocks = B * max_blocks
    kv = torch.randn(2, num_blocks, bs, Hkv, D, device=DEVICE, dtype=torch.bfloat16)
    ids = torch.randperm(num_blocks).view(B, max_blocks).tolist()
    meta = build_attention_metadata([1] * B, [4096] * B, ids, bs, DEVICE)
    q = torch.randn(B, H, D, device=DEVICE, dtype=torch.bfloat16)
    out = torch.empty_like(q)
    paged_attention_triton(q, kv, meta, D**-0.5, out=out)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        paged_attention_triton(q, kv, meta, D**-0.5, out=out)
    rng = random.Random("graph")
    for _ in range(3):
        seq_lens = [rng.randint(1, 4096) for _ in range(B)]
        new = build_attention_metadata([1] * B, seq_lens, ids, bs, DEVICE)
        meta.seq_lens.copy_(new.seq_lens)
        q.copy_(torch.randn_like(q))
        out.fill_(float("nan"))
        graph.replay()
        ref = paged_attention_reference(q.float(), kv.float(), new, D**-0.5)
        _check(out, ref, torch.bfloat16, f"graph replay ctx={seq_lens}")
