"""The Triton experts (`triton_moe.fused_moe`) against `moe_reference` (transformers' expert
by expert loop): the same sums for decode- and prefill-sized inputs, experts that get no
token, and one token, through the sorted block plan and through the few-pairs kernel; the
block plan covers every pair once (CUDA, or CPU through `TRITON_INTERPRET=1`)."""

from __future__ import annotations

import pytest
import torch

from tests.gpu.triton_target import DEVICE, ON_GPU  # first: skips without triton
from vlmserve.layers import triton_moe
from vlmserve.layers.fused import silu_mul
from vlmserve.layers.moe import moe_reference, route
from vlmserve.layers.triton_moe import FEW_PAIRS, align_to_blocks, fused_moe

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")
# (tokens, hidden, inter, experts, top_k)
# (at most FEW_PAIRS pairs take the few-pairs kernel, more the sorted block plan)
SHAPES = ([(1, 2048, 768, 128, 8), (8, 2048, 768, 128, 8), (64, 2048, 768, 128, 8),
           (700, 2048, 768, 128, 8)]
          if ON_GPU else [(1, 64, 48, 8, 2), (5, 64, 48, 8, 2), (21, 32, 24, 6, 3),
                          (40, 32, 24, 6, 3)])


def _inputs(t, hidden, inter, experts, top_k, dtype):
    g = torch.Generator().manual_seed(t * 31 + experts)
    x = torch.randn(t, hidden, generator=g)
    gate_up = torch.randn(experts, 2 * inter, hidden, generator=g) * hidden**-0.5
    down = torch.randn(experts, hidden, inter, generator=g) * inter**-0.5
    logits = torch.randn(t, experts, generator=g)
    logits[:, 0] -= 100  # expert 0 never picked
    weights, ids = route(logits, top_k)
    return [v.to(DEVICE, dtype) if v.is_floating_point() else v.to(DEVICE)
            for v in (x, gate_up, down, weights, ids)]


@pytest.mark.parametrize("shape", SHAPES)
def test_fused_experts_equal_the_reference(shape):
    dtype = torch.bfloat16 if ON_GPU else torch.float32
    x, gate_up, down, weights, ids = _inputs(*shape, dtype)
    want = moe_reference(x.float(), gate_up.float(), down.float(), weights.float(), ids)
    got = fused_moe(x, gate_up, down, weights, ids, silu_mul).float()
    tol = 3e-2 if ON_GPU else 1e-4
    torch.testing.assert_close(got, want, rtol=tol, atol=tol * want.abs().max().item())


@pytest.mark.parametrize("block_m", [16, 64])
def test_block_plan_covers_each_pair_once_within_its_experts_blocks(block_m):
    g = torch.Generator().manual_seed(block_m)
    experts, t, k = 8, 37, 3
    ids = torch.stack([torch.randperm(experts, generator=g)[:k] for _ in range(t)])
    ids[ids == 5] = 6  # expert 5 gets nothing (a token may now pick 6 twice: still a pair)
    pairs, block_expert, total = align_to_blocks(ids.to(DEVICE), experts, block_m)
    pairs, block_expert, total = pairs.cpu(), block_expert.cpu(), int(total)
    assert total % block_m == 0 and pairs.numel() % block_m == 0
    real = pairs[:total][pairs[:total] < t * k]
    assert sorted(real.tolist()) == list(range(t * k))  # every pair, once
    assert (pairs[total:] == t * k).all()  # past the total: padding only
    flat = ids.reshape(-1)
    for b in range(total // block_m):  # each block's pairs all go to its expert
        block = pairs[b * block_m:(b + 1) * block_m]
        block = block[block < t * k]
        assert (flat[block] == block_expert[b]).all()


@pytest.mark.parametrize("shape", [SHAPES[1], SHAPES[-1]])
def test_each_ranks_experts_sum_to_all_of_them(shape):
    """Expert parallelism: two ranks each hold half the experts; the picks of the other
    half map to id E (held elsewhere) and add nothing; the two sums add up to the whole
    (few pairs, and the block plan)."""
    dtype = torch.bfloat16 if ON_GPU else torch.float32
    x, gate_up, down, weights, ids = _inputs(*shape, dtype)
    want = moe_reference(x.float(), gate_up.float(), down.float(), weights.float(), ids)
    half = gate_up.shape[0] // 2
    got, ref = torch.zeros_like(want), torch.zeros_like(want)
    for start in (0, half):
        local = ids - start
        local = local.masked_fill((local < 0) | (local >= half), half)
        part = slice(start, start + half)
        got += fused_moe(x, gate_up[part], down[part], weights, local, silu_mul,
                         elsewhere=True).float()
        ref += moe_reference(x.float(), gate_up[part].float(), down[part].float(),
                             weights.float(), local)
    tol = 3e-2 if ON_GPU else 1e-4
    for sums in (got, ref):
        torch.testing.assert_close(sums, want, rtol=tol, atol=tol * want.abs().max().item())


def test_the_few_pairs_kernel_and_the_block_plan_give_the_same_sums(monkeypatch):
    """The same decode-sized step (tokens sharing experts) through both paths: the few-pairs
    kernel's program of an expert's first pair covers all of that expert's pairs."""
    t, hidden, inter, experts, top_k = (8, 256, 128, 16, 8) if ON_GPU else (6, 32, 24, 4, 2)
    assert t * top_k <= FEW_PAIRS
    dtype = torch.bfloat16 if ON_GPU else torch.float32
    x, gate_up, down, weights, ids = _inputs(t, hidden, inter, experts, top_k, dtype)
    assert ids.unique().numel() < ids.numel()  # some expert has several pairs
    few = fused_moe(x, gate_up, down, weights, ids, silu_mul).float()
    monkeypatch.setattr(triton_moe, "FEW_PAIRS", 0)
    planned = fused_moe(x, gate_up, down, weights, ids, silu_mul).float()
    tol = 3e-2 if ON_GPU else 1e-5
    torch.testing.assert_close(few, planned, rtol=tol, atol=tol * planned.abs().max().item())
