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
