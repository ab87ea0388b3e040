"""The sampler: batched top-k / top-p filters equal to the row-by-row ones, frequencies that
follow the filtered distribution, seeded rows independent of their batch; log-probabilities:
raw log_softmax rows of only the requests that asked."""

from __future__ import annotations

import torch

from vlmserve.layers.sampler import (
    compute_logprobs,
    filter_top_k_top_p,
    logprob_dict,
    logprob_rows,
    sample,
)
from vlmserve.sampling_params import SamplingParams


def test_rows_are_log_softmax_of_the_raw_logits_sampled_token_first() -> None:
    torch.manual_seed(0)
    logits = torch.randn(4, 50) * 3  # [N, vocab]
    params = [SamplingParams(temperature=0.0, logprobs=3), SamplingParams(),
              SamplingParams(temperature=2.0, top_k=5, logprobs=0),
              SamplingParams(temperature=0.5, top_p=0.5, logprobs=1)]
    gens = [None, None, torch.Generator().manual_seed(1), torch.Generator().manual_seed(2)]
    tokens = sample(logits, params, gens)
    rows = logprob_rows(params)
    assert rows == [0, 2, 3]
    ids, values = compute_logprobs(logits, tokens, rows, 3)
    assert ids.shape == values.shape == (3, 4)
    ref = torch.log_softmax(logits[rows], dim=-1)  # not scaled by any temperature
    assert ids[:, 0].tolist() == tokens[rows].tolist()
    torch.testing.assert_close(values, ref.gather(1, ids))
    torch.testing.assert_close(values[:, 1:], ref.topk(3).values)

    d = [logprob_dict(i, v, params[r].logprobs)
         for r, i, v in zip(rows, ids.tolist(), values.tolist())]
    assert list(d[0]) == ref[0].topk(3).indices.tolist()  # greedy: the argmax is first
    assert list(d[0])[0] == tokens[0].item()
    assert list(d[1]) == [tokens[2].item()]  # logprobs=0: the sampled token only
    assert tokens[3].item() in d[2] and len(d[2]) in (1, 2)


def test_a_sampled_token_outside_the_top_k_comes_last() -> None:
    assert logprob_dict([7, 1, 2], [-5.0, -0.1, -0.2], 2) == {1: -0.1, 2: -0.2, 7: -5.0}
    assert list(logprob_dict([7, 1, 2], [-5.0, -0.1, -0.2], 2)) == [1, 2, 7]
    assert logprob_dict([2, 1, 2], [-0.2, -0.1, -0.2], 2) == {1: -0.1, 2: -0.2}
    # a request asking fewer than the step's most: its own k
    assert logprob_dict([1, 1, 2, 3], [-0.1, -0.1, -0.2, -0.3], 1) == {1: -0.1}


def _filter_one_row(row: torch.Tensor, k: int, p: float) -> torch.Tensor:
    """The filters one row at a time (the sampler's loop before it was batched)."""
    if 0 < k < row.numel():
        row = row.masked_fill(row < torch.topk(row, k).values[-1], float("-inf"))
    if p < 1.0:
        sorted_logits, order = torch.sort(row, descending=True)
        probs = sorted_logits.softmax(-1)
        drop = (probs.cumsum(-1) - probs) >= p
        drop[0] = False
        row = row.clone()
        row[order[drop]] = float("-inf")
    return row


def test_batched_filters_equal_the_row_by_row_ones() -> None:
    torch.manual_seed(0)
    vocab = 97
    x = torch.randn(12, vocab) * 2
    x[3, :10] = 9.0  # ties at the k-th value are kept
    ks = [0, 1, 5, 10, 0, 96, 3, 0, 50, 0, 7, 2]
    ps = [1.0, 1.0, 0.5, 1.0, 0.3, 1.0, 0.99, 1e-9, 0.7, 1.0, 1.0, 0.6]
    got = filter_top_k_top_p(x, ks, ps)
    for j in range(len(ks)):
        assert torch.equal(got[j], _filter_one_row(x[j], ks[j], ps[j])), j
    assert torch.isinf(got[0]).sum() == 0 and torch.isinf(got[9]).sum() == 0  # no filter
    assert (got[1] > float("-inf")).sum() == 1 and (got[7] > float("-inf")).sum() == 1
    assert (got[3] > float("-inf")).sum() >= 10  # the 10 tied values all stay


def test_sampled_frequencies_follow_the_filtered_distribution() -> None:
    torch.manual_seed(1)
    logits = torch.tensor([2.0, 1.5, 1.0, 0.5, 0.0, -1.0])
    n = 40_000
    for temperature, k, p in [(1.0, -1, 1.0), (0.7, 4, 1.0), (1.3, -1, 0.8), (2.0, 3, 0.9)]:
        params = [SamplingParams(temperature=temperature, top_k=k, top_p=p)] * n
        tokens = sample(logits.expand(n, -1).clone(), params, [None] * n)
        freq = torch.bincount(tokens, minlength=6).float() / n
        want = _filter_one_row(logits / temperature, k, p).softmax(-1)
        assert (freq[want == 0] == 0).all(), (temperature, k, p)
        # 40,000 draws: a standard error of at most 0.0025 per token
        assert (freq - want).abs().max() < 0.012, (temperature, k, p, freq, want)


def test_a_seeded_row_samples_the_same_whatever_its_batch() -> None:
    torch.manual_seed(2)
    vocab = 64
    steps = [torch.randn(5, vocab) for _ in range(6)]
    seeded = SamplingParams(temperature=1.0, top_p=0.95, seed=9)

    def run(rows: list[SamplingParams], at: int, gens: list) -> list[int]:
        out = []
        for logits in steps:
            x = logits[:len(rows)].clone()
            x[at] = logits[0]  # the seeded request's logits, in row `at`
            out.append(sample(x, rows, gens)[at].item())
        return out
    alone = run([seeded], 0, [torch.Generator().manual_seed(9)])
    mixed = run([SamplingParams(temperature=0.0), SamplingParams(temperature=1.5, top_k=3),
                 seeded, SamplingParams(temperature=0.8, seed=1)], 2,
                [None, None, torch.Generator().manual_seed(9), torch.Generator().manual_seed(1)])
    assert alone == mixed and len(set(alone)) > 1


def test_greedy_rows_take_the_argmax_beside_sampled_ones() -> None:
    torch.manual_seed(3)
    logits = torch.randn(6, 40)
    params = [SamplingParams(temperature=0.0 if i % 2 == 0 else 1.0, top_k=1 if i == 3 else -1)
              for i in range(6)]
    tokens = sample(logits, params, [None] * 6)
    for i in (0, 2, 3, 4):  # greedy, and top_k=1
        assert tokens[i].item() == logits[i].argmax().item()


def test_top_k_1_is_greedy_in_one_kernel() -> None:
    """top_k 1 (Qwen2-VL's generation config: with temperature 0.1 and top_p 0.001) samples
    the argmax, without the temperature, top-p's sort or a draw."""
    torch.manual_seed(4)
    logits = torch.randn(8, 50)
    params = [SamplingParams(temperature=0.1, top_p=0.001, top_k=1, seed=i) for i in range(8)]
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        tokens = sample(logits, params, [torch.Generator().manual_seed(i) for i in range(8)])
    assert tokens.tolist() == logits.argmax(-1).tolist()
    ops = {e.key for e in prof.key_averages()}
    assert "aten::sort" not in ops and "aten::exponential_" not in ops
