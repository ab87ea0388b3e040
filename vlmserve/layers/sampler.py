"""Token sampling: greedy, temperature, top-k, top-p, per-request seeded generators."""

from __future__ import annotations

import torch

from vlmserve.sampling_params import SamplingParams


def sample(
    logits: torch.Tensor,  # [N, vocab] float32
    params: list[SamplingParams],
    generators: list[torch.Generator | None],
) -> torch.Tensor:
    """One token per row: int64 [N] on the logits' device, without a host sync. Greedy rows
    take the argmax; the others sample from the filtered, temperature-scaled distribution
    with their own generator (None: the global RNG)."""
    out = logits.argmax(dim=-1)
    sampled_rows = [i for i, p in enumerate(params) if not p.greedy]
    for i in sampled_rows:
        p = params[i]
        row = logits[i] / p.temperature
        if p.top_k > 0 and p.top_k < row.numel():
            kth = torch.topk(row, p.top_k).values[-1]
            row = row.masked_fill(row < kth, float("-inf"))
        if p.top_p < 1.0:
            sorted_logits, order = torch.sort(row, descending=True)
            probs = sorted_logits.softmax(-1)
            # drop a token when the mass before it already reaches top_p (the top one stays)
            drop = (probs.cumsum(-1) - probs) >= p.top_p
            drop[0] = False  # even when top_p rounds to 0 in float32
            row = row.clone()
            row[order[drop]] = float("-inf")
        probs = row.softmax(-1)
        out[i] = torch.multinomial(probs, 1, generator=generators[i]).squeeze(0)
    return out


def logprob_rows(params: list[SamplingParams]) -> list[int]:
    """The rows whose requests asked for log-probabilities."""
    return [i for i, p in enumerate(params) if p.logprobs is not None]


def compute_logprobs(
    logits: torch.Tensor,  # [N, vocab]: what `sample` took
    tokens: torch.Tensor,  # [N] int64: what it sampled
    rows: list[int],  # `logprob_rows(params)`, not empty
    k: int,  # the most any of those rows asked for
) -> tuple[torch.Tensor, torch.Tensor]:
    """Raw log-probabilities (log_softmax of the logits as the model gave them: before
    temperature, top-k and top-p, as vLLM's default "raw_logprobs") of the given rows only:
    ids and values [len(rows), 1 + k] on the logits' device, without a host sync; column 0
    is the sampled token, columns 1.. the k most likely, most likely first."""
    if len(rows) < logits.shape[0]:
        index = torch.tensor(rows, dtype=torch.int64).to(logits.device, non_blocking=True)
        logits, tokens = logits.index_select(0, index), tokens.index_select(0, index)
    logprobs = torch.log_softmax(logits.float(), dim=-1)  # [M, vocab]
    ids = tokens.unsqueeze(1)  # [M, 1]
    values = logprobs.gather(1, ids)
    if k > 0:
        top_values, top_ids = logprobs.topk(k, dim=-1)  # sorted, most likely first
        ids, values = torch.cat([ids, top_ids], 1), torch.cat([values, top_values], 1)
    return ids, values


def logprob_dict(ids: list[int], values: list[float], k: int) -> dict[int, float]:
    """One row of `compute_logprobs` (read back) as {token id: logprob}: the row's request's
    k most likely tokens, most likely first, and the sampled token (last, if not among
    them)."""
    out = dict(zip(ids[1:k + 1], values[1:k + 1]))
    out.setdefault(ids[0], values[0])
    return out
