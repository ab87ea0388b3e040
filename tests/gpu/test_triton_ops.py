"""Triton norm / SiLU-and-mul / rotary kernels against the eager functions they replace
(CUDA, or CPU through `TRITON_INTERPRET=1`)."""

from __future__ import annotations

import pytest
import torch

from tests.gpu.triton_target import DEVICE, ON_GPU  # first: skips without triton
from vlmserve.layers import fused, triton_ops
from vlmserve.layers.rotary import MRotaryEmbedding

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")

DTYPES = pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
# bf16: one rounding of the fused result vs several in eager, so a unit in the last place
TOL = {torch.bfloat16: dict(atol=2e-2, rtol=2e-2), torch.float32: dict(atol=1e-5, rtol=1e-5)}
HIDDEN = [1536, 3584, 80] if ON_GPU else [64, 80]
TOKENS = [1, 7, 2048] if ON_GPU else [1, 5]


def _randn(*shape, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g).to(dtype).to(DEVICE)


@DTYPES
@pytest.mark.parametrize("hidden", HIDDEN)
@pytest.mark.parametrize("tokens", TOKENS)
def test_norms(dtype, hidden, tokens):
    x = _randn(tokens, hidden, dtype=dtype, seed=1)
    r = _randn(tokens, hidden, dtype=dtype, seed=2)
    w = 1 + 0.1 * _randn(hidden, dtype=dtype, seed=3)
    torch.testing.assert_close(triton_ops.rms_norm(x, w, 1e-6), fused.rms_norm(x, w, 1e-6),
                               **TOL[dtype])
    out, total = triton_ops.add_rms_norm(x, r, w, 1e-6)
    ref_out, ref_total = fused.add_rms_norm(x, r, w, 1e-6)
    # one rounding of the same float32 sum (the interpreter emulates bf16 by truncation)
    exact = ON_GPU or dtype == torch.float32
    torch.testing.assert_close(total, ref_total, **(dict(atol=0, rtol=0) if exact else TOL[dtype]))
    torch.testing.assert_close(out, ref_out, **TOL[dtype])
    b = 0.1 * _randn(hidden, dtype=dtype, seed=4)
    torch.testing.assert_close(triton_ops.layer_norm(x, w, b, 1e-6),
                               fused.layer_norm(x, w, b, 1e-6), **TOL[dtype])
    out, total = triton_ops.add_layer_norm(x, r, w, b, 1e-6)
    ref_out, ref_total = fused.add_layer_norm(x, r, w, b, 1e-6)
    torch.testing.assert_close(total, ref_total, **(dict(atol=0, rtol=0) if exact else TOL[dtype]))
    torch.testing.assert_close(out, ref_out, **TOL[dtype])


@DTYPES
@pytest.mark.parametrize("inter", [8960, 18944, 100] if ON_GPU else [100, 48])
@pytest.mark.parametrize("tokens", TOKENS)
def test_silu_mul(dtype, inter, tokens):
    x = _randn(tokens, 2 * inter, dtype=dtype)
    torch.testing.assert_close(triton_ops.silu_mul(x), fused.silu_mul(x), **TOL[dtype])


# (out, in, bias): 2B qkv / o / gate_up / down, a 7B width (GEMV K tile 2048), odd sizes
LINEAR_SHAPES = ([(2048, 1536, True), (1536, 1536, False), (17920, 1536, False),
                  (1536, 8960, False), (4608, 3584, True), (100, 37, True)] if ON_GPU
                 else [(48, 96, True), (37, 600, False), (5, 3000, True)])


@DTYPES
@pytest.mark.parametrize("out_f,in_f,bias", LINEAR_SHAPES)
@pytest.mark.parametrize("tokens", [1, 3])
def test_linear(dtype, out_f, in_f, bias, tokens):
    """One token takes the GEMV, more fall back to F.linear; both match F.linear."""
    x = _randn(tokens, in_f, dtype=dtype, seed=1)
    w = _randn(out_f, in_f, dtype=dtype, seed=2) * in_f**-0.5
    b = _randn(out_f, dtype=dtype, seed=3) if bias else None
    ref = torch.nn.functional.linear(x.float(), w.float(), None if b is None else b.float())
    torch.testing.assert_close(triton_ops.linear(x, w, b).float(), ref, **TOL[dtype])
    torch.testing.assert_close(triton_ops.linear(x[0], w, b).float(), ref[0], **TOL[dtype])


# (out, in, bias, gated): 2B qkv and gate_up, 7B qkv and gate_up, odd sizes
NORM_LINEAR_SHAPES = ([(2048, 1536, True, False), (17920, 1536, False, True),
                       (4608, 3584, True, False), (37888, 3584, False, True),
                       (100, 80, True, False), (74, 600, False, True)] if ON_GPU
                      else [(48, 96, True, False), (74, 600, False, True),
                            (10, 3000, False, True)])


@DTYPES
@pytest.mark.parametrize("out_f,in_f,bias,gated", NORM_LINEAR_SHAPES)
@pytest.mark.parametrize("with_residual", [True, False], ids=["residual", "first"])
@pytest.mark.parametrize("tokens", [1, 3])
def test_rms_norm_linear(dtype, out_f, in_f, bias, gated, with_residual, tokens):
    """Residual add + RMSNorm + projection (+ SiLU-and-mul): one GEMV launch for one token,
    the separate kernels for more; both match the eager ops, output and residual sum."""
    x = _randn(tokens, in_f, dtype=dtype, seed=1)
    r = _randn(tokens, in_f, dtype=dtype, seed=4) if with_residual else None
    nw = 1 + 0.1 * _randn(in_f, dtype=dtype, seed=5)
    w = _randn(out_f, in_f, dtype=dtype, seed=2) * in_f**-0.5
    b = _randn(out_f, dtype=dtype, seed=3) if bias else None
    args = (nw, 1e-6, w, b, gated)
    y_ref, s_ref = fused.compose_rms_norm_linear(fused.EAGER_OPS, x, r, *args)
    assert y_ref.shape == (tokens, out_f // 2 if gated else out_f)
    y, s = triton_ops.rms_norm_linear(x, r, *args)
    # gated bf16: a last-place difference in gate or up can move silu(gate) * up by a few
    tol = dict(atol=4e-2, rtol=4e-2) if gated and dtype == torch.bfloat16 else TOL[dtype]
    torch.testing.assert_close(y.float(), y_ref.float(), **tol)
    torch.testing.assert_close(s.float(), s_ref.float(), **TOL[dtype])
    if with_residual:
        assert s.data_ptr() not in (x.data_ptr(), r.data_ptr()), "inputs are not overwritten"


# (hidden, heads, kv_heads, head_dim): 2B attention, a 7B-like width (separate kernels), odd
QKV_ROPE_SHAPES = ([(1536, 12, 2, 128), (3584, 28, 4, 128), (600, 3, 1, 80)] if ON_GPU
                   else [(64, 4, 2, 16), (600, 3, 1, 8)])


@DTYPES
@pytest.mark.parametrize("hidden,heads,kv_heads,head_dim", QKV_ROPE_SHAPES)
@pytest.mark.parametrize("with_residual", [True, False], ids=["residual", "first"])
@pytest.mark.parametrize("tokens", [1, 3])
def test_rms_norm_qkv_rope(dtype, hidden, heads, kv_heads, head_dim, with_residual, tokens):
    """Norm + QKV projection + rotary + paged-KV write: one launch for one token (the
    separate kernels for more); rotated q, residual sum and the cache match the eager ops."""
    n_out = (heads + 2 * kv_heads) * head_dim
    x = _randn(tokens, hidden, dtype=dtype, seed=1)
    r = _randn(tokens, hidden, dtype=dtype, seed=4) if with_residual else None
    nw = 1 + 0.1 * _randn(hidden, dtype=dtype, seed=5)
    w = _randn(n_out, hidden, dtype=dtype, seed=2) * hidden**-0.5
    b = _randn(n_out, dtype=dtype, seed=3)
    rope = MRotaryEmbedding(head_dim, 1e6, [head_dim // 8, 3 * head_dim // 16,
                                            head_dim // 2 - head_dim // 8 - 3 * head_dim // 16]
                            ).to(DEVICE)
    g = torch.Generator().manual_seed(6)
    cos, sin = rope.cos_sin(torch.randint(0, 5000, (3, tokens), generator=g).to(DEVICE), dtype)
    slots = torch.randperm(4 * 8, generator=g)[:tokens].to(DEVICE)  # 4 blocks of 8 slots
    caches = [torch.zeros(2, 4, 8, kv_heads, head_dim, dtype=dtype, device=DEVICE)
              for _ in range(2)]
    args = (nw, 1e-6, w, b, heads, kv_heads, cos, sin)
    q_ref, s_ref = fused.compose_rms_norm_qkv_rope(fused.EAGER_OPS, x, r, *args, caches[0],
                                                   slots)
    q, s = triton_ops.rms_norm_qkv_rope(x, r, *args, caches[1], slots)
    assert q.shape == q_ref.shape == (tokens, heads, head_dim)
    torch.testing.assert_close(q.float(), q_ref.float(), **TOL[dtype])
    torch.testing.assert_close(s.float(), s_ref.float(), **TOL[dtype])
    torch.testing.assert_close(caches[1].float(), caches[0].float(), **TOL[dtype])
    assert caches[1].flatten(1, 2)[:, slots].abs().sum(-1).gt(0).all(), "k and v written"


@DTYPES
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(12, 2, 128), (16, 16, 80), (4, 1, 64)])
@pytest.mark.parametrize("tokens", TOKENS)
def test_rotary_in_place_on_qkv_views(dtype, heads, kv_heads, head_dim, tokens):
    qkv = _randn(tokens, (heads + 2 * kv_heads) * head_dim, dtype=dtype)
    sizes = [heads * head_dim, kv_heads * head_dim, kv_heads * head_dim]
    rope = MRotaryEmbedding(head_dim, 1e6, [head_dim // 8, 3 * head_dim // 16,
                                            3 * head_dim // 16]).to(DEVICE)
    g = torch.Generator().manual_seed(5)
    positions = torch.randint(0, 5000, (3, tokens), generator=g).to(DEVICE)
    cos, sin = rope.cos_sin(positions, dtype)

    def views(t):
        q, k, v = t.split(sizes, dim=-1)
        return q.view(tokens, heads, head_dim), k.view(tokens, kv_heads, head_dim), v

    ref_q, ref_k = fused.rotary_qk(*views(qkv.clone())[:2], cos, sin)
    ours = qkv.clone()
    q, k, v = views(ours)
    triton_ops.rotary_qk(q, k, cos, sin)
    torch.testing.assert_close(q, ref_q, **TOL[dtype])
    torch.testing.assert_close(k, ref_k, **TOL[dtype])
    torch.testing.assert_close(v, views(qkv)[2], atol=0, rtol=0)  # v untouched


@DTYPES
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(12, 2, 128), (4, 1, 80)])
@pytest.mark.parametrize("tokens", TOKENS)
def test_rotary_writes_kv_cache(dtype, heads, kv_heads, head_dim, tokens):
    """The fused rotary + cache write fills exactly the given slots with rotated k and v."""
    num_blocks, block_size = 2 * tokens // 16 + 3, 16
    qkv = _randn(tokens, (heads + 2 * kv_heads) * head_dim, dtype=dtype)
    sizes = [heads * head_dim, kv_heads * head_dim, kv_heads * head_dim]
    positions = torch.arange(tokens, device=DEVICE) * 3
    cos, sin = MRotaryEmbedding(head_dim, 1e4, None).to(DEVICE).cos_sin(positions, dtype)
    g = torch.Generator().manual_seed(7)
    slots = torch.randperm(num_blocks * block_size, generator=g)[:tokens].to(DEVICE)

    def run(fn):
        t = qkv.clone()
        q, k, v = (x.view(tokens, -1, head_dim) for x in t.split(sizes, dim=-1))
        cache = torch.zeros(2, num_blocks, block_size, kv_heads, head_dim, dtype=dtype,
                            device=DEVICE)
        return fn(q, k, v, cos, sin, cache, slots), cache

    q, cache = run(triton_ops.rotary_qk_cache)
    ref_q, ref_cache = run(fused.rotary_qk_cache)
    torch.testing.assert_close(q, ref_q, **TOL[dtype])
    torch.testing.assert_close(cache, ref_cache, **TOL[dtype])
    assert (cache.view(2, -1, kv_heads, head_dim).abs().sum((0, 2, 3)) > 0).sum() == tokens


def _fp8_close(cache: torch.Tensor, ref: torch.Tensor, scales: torch.Tensor,
               dtype: torch.dtype) -> None:
    """Equal e4m3 caches, read back, give or take one e4m3 step (an eighth) where the fused
    kernel's 16-bit result was rounded to the other side of a boundary (a few values)."""
    a, b = (c.float() * scales.view(2, 1, 1, 1, 1) for c in (cache, ref))
    torch.testing.assert_close(a, b, rtol=0.13, atol=TOL[dtype]["atol"])
    assert (a != b).float().mean() < 0.02, "most values are the very same e4m3"


# the interpreter (two CPU cores in CI) checks float32 alone: 16 bits round alike
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32] if ON_GPU else [torch.float32],
                         ids=lambda dt: str(dt).removeprefix("torch."))
def test_fp8_kv_writes(dtype):
    """Both fused KV writes into an FP8 cache (rotary + write for a step's tokens; norm +
    QKV + rotary + write for one token) store what the eager write stores: k / k_scale and
    v / v_scale clamped to e4m3's range (448: the large values here reach it)."""
    heads, kv_heads, head_dim, hidden, tokens = 4, 2, 16, 64, 5
    scales = torch.tensor([0.01, 0.02], device=DEVICE)
    g = torch.Generator().manual_seed(11)
    slots = torch.randperm(4 * 8, generator=g)[:tokens].to(DEVICE)
    rope = MRotaryEmbedding(head_dim, 1e4, None).to(DEVICE)
    cos, sin = rope.cos_sin(torch.arange(tokens, device=DEVICE) * 3, dtype)
    qkv = 3 * _randn(tokens, (heads + 2 * kv_heads) * head_dim, dtype=dtype, seed=12)
    caches = []
    for fn in (triton_ops.rotary_qk_cache, fused.rotary_qk_cache):
        q, k, v = (x.view(tokens, -1, head_dim) for x in qkv.clone().split(
            [heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1))
        caches.append(torch.zeros(2, 4, 8, kv_heads, head_dim, dtype=torch.float8_e4m3fn,
                                  device=DEVICE))
        fn(q, k, v, cos, sin, caches[-1], slots, scales)
    _fp8_close(*caches, scales, dtype)
    assert caches[0].float().abs().amax() == 448, "some values clamped"
    x, r = _randn(1, hidden, dtype=dtype, seed=13), _randn(1, hidden, dtype=dtype, seed=14)
    w = _randn((heads + 2 * kv_heads) * head_dim, hidden, dtype=dtype, seed=15)
    args = (x, r, 1 + 0.1 * _randn(hidden, dtype=dtype, seed=16), 1e-6, w, None, heads,
            kv_heads, cos[:1], sin[:1])
    caches = [torch.zeros_like(caches[0]) for _ in range(2)]
    triton_ops.rms_norm_qkv_rope(*args, caches[0], slots[:1], scales)
    fused.compose_rms_norm_qkv_rope(fused.EAGER_OPS, *args, caches[1], slots[:1], scales)
    _fp8_close(*caches, scales, dtype)
    assert caches[0].float().abs().sum() > 0, "k and v written"


@DTYPES
@pytest.mark.parametrize("tokens", TOKENS)
def test_vision_rotary_and_quick_gelu(dtype, tokens):
    """Vision towers: float32 rotary on q/k views of the fused qkv, QuickGELU."""
    heads, head_dim = (16, 80) if ON_GPU else (2, 80)
    qkv = _randn(tokens, 3 * heads * head_dim, dtype=dtype)
    g = torch.Generator().manual_seed(9)
    angles = (torch.rand(tokens, head_dim // 2, generator=g) * 50).to(DEVICE)
    emb = torch.cat([angles, angles], dim=-1)
    cos, sin = emb.cos(), emb.sin()  # float32, as the vision rotary makes them

    def qk(t):
        return t.view(tokens, 3, heads, head_dim).unbind(1)[:2]

    ref_q, ref_k = fused.rotary_qk_float32(*qk(qkv), cos, sin)
    ours = qkv.clone()
    q, k = triton_ops.rotary_qk_float32(*qk(ours), cos, sin)
    torch.testing.assert_close(q, ref_q, **TOL[dtype])
    torch.testing.assert_close(k, ref_k, **TOL[dtype])
    x = 3 * _randn(tokens, 300, dtype=dtype)
    torch.testing.assert_close(triton_ops.quick_gelu(x), fused.quick_gelu(x), **TOL[dtype])


@DTYPES
@pytest.mark.parametrize("tokens", TOKENS)
def test_gated_rms_norm(dtype, tokens):
    """The linear-attention layers' output norm: float32 rule outputs [T, H, D], the gate z
    a split of the projection (rows apart)."""
    heads, dim = 4, (128 if ON_GPU else 16)
    x = _randn(tokens, heads, dim, dtype=torch.float32, seed=1)
    z = _randn(tokens, heads * dim + 24, dtype=dtype, seed=2)[:, 8:8 + heads * dim]
    w = 1 + 0.1 * _randn(dim, dtype=dtype, seed=3)
    got = triton_ops.gated_rms_norm(x, z, w, 1e-6)
    torch.testing.assert_close(got, fused.gated_rms_norm(x, z, w, 1e-6), **TOL[dtype])
    assert got.dtype == dtype and got.shape == (tokens, heads * dim)
