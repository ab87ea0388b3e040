"""What `LLM.generate` returns."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None  # "stop", "length", "abort" or None while running
    # with SamplingParams(logprobs=k): one {token id: logprob} per token of `token_ids`, the k
    # most likely tokens (most likely first) and the sampled one; raw logprobs (log_softmax
    # of the logits before temperature, top-k, top-p). None when not asked for.
    logprobs: list[dict[int, float]] | None = None
    # with logprobs asked for: the sum of the sampled tokens' logprobs over the whole output
    # so far (vLLM's), else None
    cumulative_logprob: float | None = None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput] = field(default_factory=list)
    finished: bool = False
    # with SamplingParams(prompt_logprobs=k), from the first output on: per prompt token, None
    # for the first, then {token id: logprob} (the k most likely there, and the prompt's own
    # token last if not among them), and that token's rank (1: most likely)
    prompt_logprobs: list[dict[int, float] | None] | None = None
    prompt_logprob_ranks: list[int | None] | None = None
