"""The offline Python API: `LLM(model=...).generate(...)` and `.chat(...)`."""

from __future__ import annotations

import os
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from tqdm.auto import tqdm

from vlmserve.engine.chat import parse_chat_messages
from vlmserve.engine.llm_engine import LLMEngine
from vlmserve.engine.processor import PromptInput
from vlmserve.outputs import RequestOutput
from vlmserve.sampling_params import SamplingParams


class LLM:
    """A vision-language model served in-process.

    `LLM(model="tiny-qwen2-vl", max_num_seqs=8, ...)` takes every engine option by name
    (see `vlmserve.config`).
    """

    def __init__(self, model: str = "tiny-qwen2-vl", **kwargs: Any) -> None:
        self.engine = LLMEngine.from_kwargs(model=model, **kwargs)

    def get_tokenizer(self):
        return self.engine.tokenizer

    def generate(
        self,
        prompts: PromptInput | Sequence[PromptInput],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Run every prompt to completion; outputs come back in input order."""
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        prompts = list(prompts)
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            params = [sampling_params or SamplingParams()] * len(prompts)
        else:
            params = list(sampling_params)
            if len(params) != len(prompts):
                raise ValueError(f"{len(params)} sampling params for {len(prompts)} prompts")
        # preprocessing (image decoding and processing, tokenization) runs on a thread pool
        # and overlaps the engine steps; requests join the engine in input order
        with ThreadPoolExecutor(max_workers=min(4, os.cpu_count() or 1)) as pool:
            futures = [pool.submit(self.engine.process_request, p, sp)
                       for p, sp in zip(prompts, params)]
            try:
                return self._run(futures, use_tqdm)
            finally:
                for f in futures:
                    f.cancel()

    def chat(
        self,
        messages: list[dict[str, Any]] | list[list[dict[str, Any]]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """OpenAI-style messages (text and image_url parts) through the chat template."""
        conversations = messages if messages and isinstance(messages[0], list) else [messages]
        prompts = [self.chat_prompt(conv) for conv in conversations]
        return self.generate(prompts, sampling_params, use_tqdm)

    def chat_prompt(self, messages: list[dict[str, Any]]) -> dict[str, Any]:
        """The engine prompt (templated text + images) for one conversation."""
        hf_messages, images = parse_chat_messages(messages)
        text = self.engine.input_processor.model_processor.apply_chat_template(hf_messages)
        return {"prompt": text, "multi_modal_data": {"image": images}}

    def _run(self, futures: list[Future], use_tqdm: bool) -> list[RequestOutput]:
        engine = self.engine
        ids: list[str] = []
        pending: set[str] = set()
        results: dict[str, RequestOutput] = {}
        bar = tqdm(total=len(futures), desc="Requests", disable=not use_tqdm, unit="req")
        try:
            while len(ids) < len(futures) or pending:
                # admit what is preprocessed; wait for the next request only when idle
                while len(ids) < len(futures) and (futures[len(ids)].done()
                                                   or not engine.has_unfinished_requests()):
                    rid = engine.add_processed_request(futures[len(ids)].result())
                    ids.append(rid)
                    pending.add(rid)
                for out in engine.step():
                    if out.finished and out.request_id in pending:
                        results[out.request_id] = out
                        pending.discard(out.request_id)
                        bar.update(1)
        except BaseException:
            engine.abort_request(list(pending))
            engine.drain()
            raise
        finally:
            bar.close()
        return [results[i] for i in ids]
