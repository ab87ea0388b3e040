"""Token sampling: greedy, temperature, top-k, top-p, per-request seeded generators; every
sampled row of a step in the same few kernels."""

from __future__ import annotations

import torch

from vlmserve.layers.attention import triton_available
from vlmserve.sampling_params import SamplingParams
from vlmserve.utils import to_device


def _dev(values: list, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A host list on ``device`` without waiting for the stream."""
    return to_device(torch.tensor(values, dtype=dtype), device)


class TokenHistory:
    """What the penalties of one request read: how often each token was generated (``counts``
    [vocab] int32, on the device, one added per sampled token by `count`) and, with a
    repetition penalty, which tokens its prompt holds (``in_prompt`` [vocab] bool)."""

    def __init__(self, params: SamplingParams, token_ids: list[int], num_prompt_tokens: int,
                 vocab: int, device: torch.device) -> None:
        self.counts = torch.zeros(vocab, dtype=torch.int32, device=device)
        out = token_ids[num_prompt_tokens:]
        if out:  # a request resumed after a preemption
            self.counts.index_add_(0, _dev(out, torch.int64, device),
                                   torch.ones(len(out), dtype=torch.int32, device=device))
        self.in_prompt = None
        if params.repetition_penalty != 1.0:
            self.in_prompt = torch.zeros(vocab, dtype=torch.bool, device=device).index_fill_(
                0, _dev(token_ids[:num_prompt_tokens], torch.int64, device), True)

    def count(self, token: torch.Tensor) -> None:
        """``token`` [1] int64, sampled for this request."""
        self.counts.index_add_(0, token, torch.ones(1, dtype=torch.int32, device=token.device))


def apply_penalties(logits: torch.Tensor, params: list[SamplingParams],
                    history: list[TokenHistory | None] | None = None,
                    banned: list[list[int]] | None = None) -> torch.Tensor:
    """``logits`` [N, vocab] with each row's logit biases, its repetition, frequency and
    presence penalties (the rows with a ``history``: the penalized ones) and its ``banned``
    tokens (EOS and stop tokens before min_tokens) at -inf: a new tensor (``logits`` itself
    unchanged, as the raw log-probabilities read it), or ``logits`` when no row has any."""
    history = history or [None] * len(params)
    banned = banned or [[]] * len(params)
    rows = [i for i, p in enumerate(params)
            if p.logit_bias or history[i] is not None or banned[i]]
    if not rows:
        return logits
    device = logits.device
    index = _dev(rows, torch.int64, device)
    x = logits.index_select(0, index).float()
    pen = [j for j, i in enumerate(rows) if history[i] is not None]
    if pen:
        counts = torch.stack([history[rows[j]].counts for j in pen])  # [P, vocab]
        some = None if len(pen) == len(rows) else _dev(pen, torch.int64, device)
        sub = x if some is None else x.index_select(0, some)
        rep = [params[rows[j]].repetition_penalty for j in pen]
        if any(r != 1.0 for r in rep):
            none = torch.zeros_like(counts[0], dtype=torch.bool)
            seen = (counts > 0) | torch.stack([
                h.in_prompt if (h := history[rows[j]]).in_prompt is not None else none
                for j in pen])
            r = _dev(rep, torch.float32, device)[:, None]
            sub = torch.where(seen, torch.where(sub > 0, sub / r, sub * r), sub)
        freq = _dev([params[rows[j]].frequency_penalty for j in pen], torch.float32, device)
        pres = _dev([params[rows[j]].presence_penalty for j in pen], torch.float32, device)
        sub = sub - freq[:, None] * counts - pres[:, None] * (counts > 0)
        x = sub if some is None else x.index_copy_(0, some, sub)
    bias = [(j, t, b) for j, i in enumerate(rows) for t, b in params[i].logit_bias.items()]
    bias += [(j, t, float("-inf")) for j, i in enumerate(rows) for t in banned[i]
             if 0 <= t < x.shape[1]]
    if bias:
        j, t, b = zip(*bias)
        x.index_put_((_dev(list(j), torch.int64, device), _dev(list(t), torch.int64, device)),
                     _dev(list(b), torch.float32, device), accumulate=True)
    return logits.float().index_copy(0, index, x)


def sample(
    logits: torch.Tensor,  # [N, vocab]
    params: list[SamplingParams],
    generators: list[torch.Generator | None],
    history: list[TokenHistory | None] | None = None,
    banned: list[list[int]] | None = None,
) -> torch.Tensor:
    """One token per row: int64 [N] on the logits' device, without a host sync. Logit biases
    and penalties first (`apply_penalties`; ``history``: each penalized row's). Greedy rows
    take the argmax. The other rows are sampled together, in a number of kernels that does
    not grow with the batch: logits divided by each row's temperature, its min-p, top-k and
    top-p filters (`filter_top_k_top_p`), then one draw from each row's distribution by the
    exponential race (the argmax of p_i / E_i with E_i ~ Exp(1) independent is token i with
    probability p_i); a row with top_k 1 is greedy. A row with a generator draws its E from
    it alone (so a seeded request
    samples the same tokens whatever it is batched with); the others from the global RNG.
    ``banned``: per row, token ids it may not sample this step."""
    logits = apply_penalties(logits, params, history, banned)
    out = logits.argmax(dim=-1)
    # top_k 1 keeps only the most likely token, whatever the temperature or top-p: greedy
    # (Qwen2-VL's generation config asks for it, so every request that sets nothing does)
    rows = [i for i, p in enumerate(params) if not p.greedy and p.top_k != 1]
    if not rows:
        return out
    device, vocab = logits.device, logits.shape[1]
    every = len(rows) == len(params)
    index = None if every else _dev(rows, torch.int64, device)
    x = logits if every else logits.index_select(0, index)
    x = x.float() / _dev([params[i].temperature for i in rows], torch.float32, device)[:, None]
    min_p = [params[i].min_p for i in rows]
    if any(min_p):
        probs = x.softmax(dim=-1)
        floor = _dev(min_p, torch.float32, device)[:, None] * probs.amax(dim=-1, keepdim=True)
        x = x.masked_fill(probs < floor, float("-inf"))  # the most likely token stays
    ks = [params[i].top_k if 0 < params[i].top_k < vocab else 0 for i in rows]
    ps = [params[i].top_p for i in rows]
    if any(ks) or any(p < 1.0 for p in ps):
        x = filter_top_k_top_p(x, ks, ps)
    probs = x.softmax(dim=-1)
    race = torch.empty_like(probs)
    seeded = [(j, generators[i]) for j, i in enumerate(rows) if generators[i] is not None]
    if len(seeded) < len(rows):
        race.exponential_()
    for j, gen in seeded:
        race[j].exponential_(generator=gen)
    # a draw of exactly 0 would divide a filtered-out token's 0 into NaN
    tokens = probs.div_(race.clamp_min_(torch.finfo(torch.float32).tiny)).argmax(dim=-1)
    if every:
        return tokens
    return out.index_copy_(0, index, tokens)


def filter_top_k_top_p(x: torch.Tensor, ks: list[int], ps: list[float]) -> torch.Tensor:
    """``x`` [M, vocab] (temperature-scaled float32 logits, the caller's own: the top-p filter
    may write into it) with, in each row j, the tokens outside its top ``ks[j]`` (0: no
    top-k) set to -inf (ties with the k-th kept), then those outside its top-p nucleus (1.0:
    no top-p): the tokens from the most likely down to the one where their probability mass
    first reaches ``ps[j]``, ties with that one kept; the most likely token always stays. On
    CUDA the nucleus is found without a sort (`triton_sampling.top_p_filter_`)."""
    device = x.device
    if any(ks):
        k = _dev([max(n, 1) - 1 for n in ks], torch.int64, device)[:, None]  # the k-th
        kth = x.topk(max(ks), dim=-1).values.gather(1, k)
        off = _dev([n == 0 for n in ks], torch.bool, device)[:, None]
        x = x.masked_fill((x < kth) & ~off, float("-inf"))
    if any(p < 1.0 for p in ps):
        top_p = _dev([min(p, 1.0) for p in ps], torch.float32, device)
        if triton_available(device) and x.dtype == torch.float32:
            from vlmserve.layers.triton_sampling import top_p_filter_

            return top_p_filter_(x.contiguous(), top_p)
        x = x.masked_fill(x < top_p_threshold(x, top_p)[:, None], float("-inf"))
    return x


def top_p_threshold(x: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Each row's smallest logit in its top-p nucleus (see `filter_top_k_top_p`), by a sort:
    [M]; a row with top_p 1.0 gets its smallest logit (nothing dropped)."""
    sorted_x = x.sort(dim=-1, descending=True).values
    sorted_p = sorted_x.softmax(dim=-1)
    # a token stays while the mass before it is under top_p (a prefix: the sum only grows)
    kept = ((sorted_p.cumsum(dim=-1) - sorted_p) < top_p[:, None]).sum(dim=-1, keepdim=True)
    kept = torch.where(top_p[:, None] >= 1.0, x.shape[1], kept.clamp_min(1))
    return sorted_x.gather(1, kept - 1).squeeze(1)


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
        index = _dev(rows, torch.int64, logits.device)
        logits, tokens = logits.index_select(0, index), tokens.index_select(0, index)
    logprobs = torch.log_softmax(logits.float(), dim=-1)  # [M, vocab]
    ids = tokens.unsqueeze(1)  # [M, 1]
    values = logprobs.gather(1, ids)
    if k > 0:
        top_values, top_ids = logprobs.topk(k, dim=-1)  # sorted, most likely first
        ids, values = torch.cat([ids, top_ids], 1), torch.cat([values, top_values], 1)
    return ids, values


def compute_prompt_logprobs(
    compute_logits,  # [rows, hidden] -> float [rows, vocab] (the model's; a collective
    # under tensor parallelism: every rank runs this alike)
    hidden: torch.Tensor,  # [M, hidden]: the prompt positions asked for
    targets: torch.Tensor,  # [M] int64: the prompt token each position predicts
    k: int,  # the most top tokens any of those requests asked for
    rows_at_once: int = 256,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Raw log-probabilities of prompt tokens: ids and values [M, 1 + k] as
    `compute_logprobs` gives them (column 0 the prompt's token), and that token's rank among
    the vocabulary [M] (1: the most likely). The logits of at most ``rows_at_once`` positions
    exist at a time (156 MB at a 152k vocabulary; a 2,048-token chunk's would be 1.2 GB)."""
    ids, values, ranks = [], [], []
    for lo in range(0, hidden.shape[0], rows_at_once):
        logprobs = torch.log_softmax(compute_logits(hidden[lo:lo + rows_at_once]).float(), -1)
        target = targets[lo:lo + rows_at_once].unsqueeze(1)
        value = logprobs.gather(1, target)
        ranks.append((logprobs > value).sum(-1) + 1)
        if k > 0:
            top_values, top_ids = logprobs.topk(k, dim=-1)
            target, value = torch.cat([target, top_ids], 1), torch.cat([value, top_values], 1)
        ids.append(target)
        values.append(value)
    return torch.cat(ids), torch.cat(values), torch.cat(ranks)


def logprob_dict(ids: list[int], values: list[float], k: int) -> dict[int, float]:
    """One row of `compute_logprobs` (read back) as {token id: logprob}: the row's request's
    k most likely tokens, most likely first, and the sampled token (last, if not among
    them)."""
    out = dict(zip(ids[1:k + 1], values[1:k + 1]))
    out.setdefault(ids[0], values[0])
    return out
