"""The sort-free top-p kernel against the sorted reference (`sampler.top_p_threshold`): the
same tokens kept in every row, whatever the vocabulary, top_p, ties or -inf entries (CUDA, or
CPU through `TRITON_INTERPRET=1`)."""

from __future__ import annotations

import pytest
import torch

from tests.gpu.triton_target import DEVICE, ON_GPU  # first: skips without triton
from vlmserve.layers.sampler import top_p_threshold
from vlmserve.layers.triton_sampling import top_p_filter_

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")
VOCABS = [151936, 32064, 7] if ON_GPU else [5003, 97, 1]


def _reference(x: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    return x.masked_fill(x < top_p_threshold(x, top_p)[:, None], float("-inf"))


@pytest.mark.parametrize("vocab", VOCABS)
def test_kept_tokens_equal_the_sorted_nucleus(vocab):
    g = torch.Generator().manual_seed(vocab)
    ps = [0.9, 1.0, 0.5, 1e-9, 0.999, 0.3, 0.95, 1.5]
    x = torch.randn(len(ps), vocab, generator=g) * torch.tensor([1, 1, 3, 1, 0.5, 8, 2, 1])[:, None]
    x[2, ::3] = float("-inf")  # a top-k filter before it
    x[6] = x[6].round()  # many ties, some at the threshold
    if vocab > 1:
        x[7, 0] = float("-inf")
    top_p = torch.tensor(ps)
    want = _reference(x, top_p)
    got = top_p_filter_(x.to(DEVICE), top_p.to(DEVICE)).cpu()
    kept_got, kept_want = got > float("-inf"), want > float("-inf")
    assert torch.equal(kept_got, kept_want), (kept_got.sum(1), kept_want.sum(1))
    assert torch.equal(got[kept_got], x[kept_got])  # kept logits unchanged
    assert kept_got[1].sum() == (x[1] > float("-inf")).sum()  # top_p 1: nothing dropped
    assert kept_got[3].sum() == 1  # the most likely token always stays


def test_a_flat_row_and_a_peaked_row():
    vocab = 4099
    x = torch.zeros(2, vocab)
    x[1, 17] = 30.0  # one token holds nearly all the mass
    top_p = torch.tensor([0.5, 0.9])
    got = top_p_filter_(x.to(DEVICE), top_p.to(DEVICE)).cpu()
    assert (got[0] > float("-inf")).all()  # all tied: all stay
    assert (got[1] > float("-inf")).nonzero().flatten().tolist() == [17]
