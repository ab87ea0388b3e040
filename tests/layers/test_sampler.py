"""The sampler's log-probabilities: raw log_softmax rows of only the requests that asked."""

from __future__ import annotations

import torch

from vlmserve.layers.sampler import compute_logprobs, logprob_dict, logprob_rows, sample
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
