"""The offline Python API: `LLM(model=...).generate(...)` and `.chat(...)`."""

from __future__ import annotations

from collections.abc import Sequence
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
        ids: list[str] = []
        try:
            for prompt, sp in zip(prompts, params):
                ids.append(self.engine.add_request(prompt, sp))
        except Exception:
            self.engine.abort_request(ids)
            raise
        return self._run(ids, use_tqdm)

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

    def _run(self, ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        pending = set(ids)
        results: dict[str, RequestOutput] = {}
        bar = tqdm(total=len(ids), desc="Requests", disable=not use_tqdm, unit="req")
        try:
            while pending:
                for out in self.engine.step():
                    if out.finished and out.request_id in pending:
                        results[out.request_id] = out
                        pending.discard(out.request_id)
                        bar.update(1)
        except BaseException:
            self.engine.abort_request(list(pending))
            raise
        finally:
            bar.close()
        return [results[i] for i in ids]
