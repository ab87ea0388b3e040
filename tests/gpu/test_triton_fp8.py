"""The FP8 product (`triton_fp8.fp8_linear`) and read-back kernel against the eager path
(`Fp8Weight.dequantize` then `F.linear`): every row-count bucket of the GEMM, the dequantize
path for large inputs, partial blocks, bias, and through the Triton ops (CUDA, or CPU
through `TRITON_INTERPRET=1`, whose bfloat16 products are wrong: float16 there)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tests.gpu.triton_target import DEVICE, ON_GPU  # first: skips without triton
from vlmserve.layers import fused, triton_ops
from vlmserve.layers.fp8 import Fp8Weight
from vlmserve.layers.triton_fp8 import _DEQUANT_MIN_ROWS, dequantize, fp8_linear
from vlmserve.models.quantization import quantize_fp8_block

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")
DTYPE = torch.bfloat16 if ON_GPU else torch.float16
# (rows of the weight, its columns, block): whole blocks, partial last blocks, narrow ones
SHAPES = ([(1536, 1536, (128, 128)), (8960 * 2, 1536, (128, 128)), (1536, 8960, (128, 128)),
           (200, 300, (128, 128))] if ON_GPU else
          [(96, 80, (32, 32)), (70, 45, (32, 16)), (64, 256, (64, 128))])
ROWS = [1, 7, 64, 300, _DEQUANT_MIN_ROWS + 3] if ON_GPU else [1, 17, 65]


def _close(got: torch.Tensor, ref: torch.Tensor) -> None:
    """Equal to 16-bit precision at the output's scale: the products round their inputs and
    outputs to 16 bits and cuBLAS may reduce in bfloat16 (PyTorch's default), so an entry
    that cancels to near zero carries the error of the largest ones (on the H100: 0.05 beside
    entries of about 5 with K = 8,960 rows, and after SiLU-and-mul)."""
    torch.testing.assert_close(got.float(), ref.float(), rtol=2e-2,
                               atol=max(2e-2, 1e-2 * ref.abs().amax().item()))


def _weight(n: int, k: int, block: tuple[int, int], seed: int = 0) -> Fp8Weight:
    g = torch.Generator().manual_seed(seed)
    q, s = quantize_fp8_block(torch.randn(n, k, generator=g) * 0.05, block)
    return Fp8Weight(q.to(DEVICE), s.to(DEVICE), block)


@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("bias", [False, True])
def test_fp8_linear_equals_the_read_back_product(shape, rows, bias):
    n, k, block = shape
    w = _weight(n, k, block)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(rows, k, generator=g).to(DTYPE).to(DEVICE)
    b = torch.randn(n, generator=g).to(DTYPE).to(DEVICE) if bias else None
    ref = F.linear(x.float(), w.dequantize(torch.float32), None if b is None else b.float())
    got = fp8_linear(x, w, b)
    assert got.shape == (rows, n) and got.dtype == DTYPE
    _close(got, ref)
    # three dimensions in, three out (a batch of token rows)
    torch.testing.assert_close(fp8_linear(x.view(1, rows, k), w, b).view(rows, n), got)


@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_dequantize_kernel_is_exact(shape):
    w = _weight(*shape)
    assert torch.equal(dequantize(w, DTYPE), w.dequantize(DTYPE))


@pytest.mark.parametrize("residual", [False, True])
@pytest.mark.parametrize("gated", [False, True])
def test_triton_ops_take_fp8_weights(residual, gated):
    """The ops a decoder layer calls (`linear`, `rms_norm_linear` with the residual and
    SiLU-and-mul): one token through the GEMV with FP8 values and block scales (the norm
    folded in), more through the FP8 product; equal to reading the weight back."""
    n, k, block = SHAPES[0]
    w = _weight(2 * n if gated else n, k, block)
    g = torch.Generator().manual_seed(2)
    for rows in (1, 5):
        x = torch.randn(rows, k, generator=g).to(DTYPE).to(DEVICE)
        r = torch.randn(rows, k, generator=g).to(DTYPE).to(DEVICE) if residual else None
        norm = (1 + 0.1 * torch.randn(k, generator=g)).to(DTYPE).to(DEVICE)
        _close(triton_ops.linear(x, w), fused.EAGER_OPS.linear(x, w))
        got, total = triton_ops.rms_norm_linear(x, r, norm, 1e-6, w, gated_silu=gated)
        ref, ref_total = fused.compose_rms_norm_linear(fused.EAGER_OPS, x, r, norm, 1e-6, w,
                                                       None, gated)
        _close(got, ref)
        torch.testing.assert_close(total, ref_total)


def test_fp8_qkv_rope_takes_the_composed_path():
    """The fused one-token QKV + rotary kernel reads 16-bit weights only: an FP8 weight goes
    through `rms_norm_linear` (its GEMV) and the rotary kernel, equal to the eager ops."""
    from vlmserve.layers.rotary import MRotaryEmbedding

    heads, kv_heads, d = 4, 2, 32 if not ON_GPU else 128
    k = SHAPES[0][1]
    w = _weight((heads + 2 * kv_heads) * d, k, SHAPES[0][2])
    g = torch.Generator().manual_seed(3)
    x = torch.randn(1, k, generator=g).to(DTYPE).to(DEVICE)
    nw = (1 + 0.1 * torch.randn(k, generator=g)).to(DTYPE).to(DEVICE)
    rope = MRotaryEmbedding(d, 1e6, [d // 8, 3 * d // 16, d // 2 - d // 8 - 3 * d // 16]
                            ).to(DEVICE)
    cos, sin = rope.cos_sin(torch.randint(0, 5000, (3, 1), generator=g).to(DEVICE), DTYPE)
    slots = torch.tensor([5], device=DEVICE)
    caches = [torch.zeros(2, 2, 8, kv_heads, d, dtype=DTYPE, device=DEVICE) for _ in range(2)]
    args = (nw, 1e-6, w, None, heads, kv_heads, cos, sin)
    q_ref, _ = fused.compose_rms_norm_qkv_rope(fused.EAGER_OPS, x, None, *args, caches[0], slots)
    q, _ = triton_ops.rms_norm_qkv_rope(x, None, *args, caches[1], slots)
    _close(q, q_ref)
    _close(caches[1], caches[0])


def test_small_inputs_split_k_so_every_sm_reads():
    """At one token the 2B's narrow projections (qkv, o, down: 24-64 column tiles) split K
    until the SMs have about two programs each; gate_up (560 tiles) does not; every split
    has columns to read and together they cover K."""
    from vlmserve.layers.triton_fp8 import _config

    sms = 132
    for n, k, splits in ((2048, 1536, 4), (1536, 1536, 4), (1536, 8960, 5), (17920, 1536, 1)):
        bm, bn, bk, _, _, split, per_split = _config(1, n, k, 128, sms)
        assert split == splits, (n, k, split)
        assert per_split % bk == 0 and (split - 1) * per_split < k <= split * per_split
        assert split == 1 or split * (n // bn) <= 2 * sms
    assert _config(300, 2048, 1536, 128, sms)[5] == 1  # compute-bound: no split
