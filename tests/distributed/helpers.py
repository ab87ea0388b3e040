"""Shared by the tensor-parallel tests: the one-process reference run."""

from __future__ import annotations

from tests.engine.helpers import mixed_prompts
from vlmserve import LLM, SamplingParams


def token_ids(llm: LLM, prompts: list, params: SamplingParams) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


def one_process(model: str, params: SamplingParams, count: int = 8, **kw
                ) -> tuple[LLM, list, list[list[int]]]:
    """`LLM(model, **kw)` in this process, the first `count` of `mixed_prompts` and their
    greedy tokens: what tensor-parallel runs must equal."""
    single = LLM(model, **kw)
    prompts = mixed_prompts(single)[:count]
    return single, prompts, token_ids(single, prompts, params)
