"""The offline Python API: `LLM(model=...).generate(...)` and `.chat(...)`."""

from __future__ import annotations

import dataclasses
import weakref
from collections import deque
from collections.abc import Sequence
from concurrent.futures import Future
from typing import Any

from tqdm.auto import tqdm

from vlmserve.config import EngineConfig
from vlmserve.frontend.llm_engine import LLMEngine
from vlmserve.inputs.chat import parse_chat_messages
from vlmserve.inputs.processor import PromptInput
from vlmserve.models.processing import ChatTemplateOptions
from vlmserve.multimodal.fetch import FetchPolicy, RemoteImageFetcher
from vlmserve.multimodal.inputs import ProcessedPrompt
from vlmserve.outputs import RequestOutput
from vlmserve.sampling_params import SamplingParams


class LLM:
    """A vision-language model served in-process.

    `LLM(model="tiny-qwen2-vl", max_num_seqs=8, ...)` takes every engine option by name
    (see `vlmserve.config`).
    """

    def __init__(self, model: str = "tiny-qwen2-vl", *, allow_remote_images: bool = True,
                 allowed_remote_hosts: str | Sequence[str] | None = None,
                 remote_image_timeout: float = FetchPolicy.timeout,
                 max_remote_image_bytes: int = FetchPolicy.max_bytes,
                 remote_image_fetch_workers: int = 8, preprocess_workers: int = 0,
                 **kwargs: Any) -> None:
        # http(s) image and video URLs of chats: fetched as the server fetches them (its
        # options by the same names), but on by default as vLLM's offline API
        self.fetcher = RemoteImageFetcher(FetchPolicy(
            remote_image_timeout, max_remote_image_bytes,
            FetchPolicy.parse_hosts(allowed_remote_hosts)),
            remote_image_fetch_workers) if allow_remote_images else None
        if preprocess_workers < 0:
            raise ValueError(f"preprocess_workers must be 0 or more, got {preprocess_workers}")
        self.engine = LLMEngine.from_kwargs(model=model, **kwargs)
        self.preprocess_workers = preprocess_workers
        self._pool = None  # started by the first `generate` that needs it

    __init__.__doc__ = (
        "Remote media of `chat` (the server's options by the same names): allow_remote_images "
        "(default True: http(s) image and video URLs fetched, public addresses only), "
        "allowed_remote_hosts (host names, addresses, CIDR networks that may be private), "
        "remote_image_timeout (seconds a fetch in all), max_remote_image_bytes, "
        "remote_image_fetch_workers (fetches at once). preprocess_workers (default 0): "
        "processes that preprocess prompts (images decoded and processed, tokens, hashes) "
        "ahead of the engine, as the server's --preprocess-workers; 0: on the engine's "
        "thread, between its launches (spawned processes: a script's code under "
        "`if __name__ == '__main__':`).\n"
        "Engine options (keyword arguments; the CLI's flags by these names):\n" + (
            "\n".join(f"    {f.name} (default {f.default!r}): {f.metadata.get('help', '')}"
                      for f in EngineConfig.option_fields())))

    def reset_prefix_cache(self) -> None:
        """Forget every cached prefix: the next prompts are computed from scratch."""
        self.engine.reset_prefix_cache()

    def get_tokenizer(self):
        return self.engine.tokenizer

    def get_default_sampling_params(self) -> SamplingParams:
        """What `generate` and `chat` use when given none: `SamplingParams` with the model's
        generation config (its temperature, top_p, top_k, min_p, repetition_penalty and
        max_new_tokens; `generation_config="vllm"`: SamplingParams' own defaults)."""
        return SamplingParams(**self.engine.sampling_defaults)

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
            params = [sampling_params or self.get_default_sampling_params()] * len(prompts)
        else:
            params = list(sampling_params)
            if len(params) != len(prompts):
                raise ValueError(f"{len(params)} sampling params for {len(prompts)} prompts")
        final_only: dict[int, SamplingParams] = {}  # one copy per distinct params object
        for p in params:
            if id(p) not in final_only:
                final_only[id(p)] = dataclasses.replace(p, output_kind="final_only")
        params = [final_only[id(p)] for p in params]  # no per-step outputs: only the last
        return self._run(deque(zip(prompts, params)), use_tqdm)

    def chat(
        self,
        messages: list[dict[str, Any]] | list[list[dict[str, Any]]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        tools: list[dict[str, Any]] | None = None,
        chat_template: str | None = None,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        chat_template_kwargs: dict[str, Any] | None = None,
        mm_processor_kwargs: dict[str, Any] | None = None,
    ) -> list[RequestOutput]:
        """OpenAI-style messages (text, image_url and video_url parts: data URLs, paths, or
        http(s) URLs fetched under the `LLM`'s remote media options; vLLM's image_pil parts)
        through the chat template, with
        ``tools`` (OpenAI's function definitions) where the template shows them; vLLM's
        ``chat_template`` (a Jinja template instead of the model's), ``add_generation_prompt``,
        ``continue_final_message`` (the last, assistant message continued),
        ``chat_template_kwargs`` (variables for the template) and ``mm_processor_kwargs``
        (the image processor's options for these images: min_pixels / max_pixels for the
        Qwen models)."""
        conversations = messages if messages and isinstance(messages[0], list) else [messages]
        options = ChatTemplateOptions(chat_template, add_generation_prompt,
                                      continue_final_message, chat_template_kwargs or {})
        prompts = [self.chat_prompt(conv, tools, options) for conv in conversations]
        if self.fetcher is not None:  # every conversation's remote images at once
            media = [p["multi_modal_data"] for p in prompts]
            fetched = self.fetcher.fetch_all_sync(
                [(mm["image"] + mm.get("video", []),
                  ["image"] * len(mm["image"]) + ["video"] * len(mm.get("video", [])))
                 for mm in media])
            for mm, sources in zip(media, fetched):
                mm["image"], videos = sources[:len(mm["image"])], sources[len(mm["image"]):]
                if videos:
                    mm["video"] = videos
        if mm_processor_kwargs:
            prompts = [{**p, "mm_processor_kwargs": mm_processor_kwargs} for p in prompts]
        return self.generate(prompts, sampling_params, use_tqdm)

    def chat_prompt(self, messages: list[dict[str, Any]],
                    tools: list[dict[str, Any]] | None = None,
                    options: ChatTemplateOptions | None = None) -> dict[str, Any]:
        """The engine prompt (templated text + images) for one conversation."""
        hf_messages, images, videos = parse_chat_messages(messages)
        text = self.engine.input_processor.model_processor.apply_chat_template(
            hf_messages, tools, options)
        mm = {"image": images, "video": videos} if videos else {"image": images}
        return {"prompt": text, "multi_modal_data": mm}

    def _run(self, todo: deque[tuple[PromptInput, SamplingParams]], use_tqdm: bool
             ) -> list[RequestOutput]:
        """Preprocess and admit the prompts in input order, keeping the scheduler fed, and
        step until every request finishes.

        Preprocessing (tokens, image decoding and processing, hashes) runs on this thread,
        mostly while the device works on a step (`LLMEngine.step(while_waiting=...)`), and
        synchronously only when less than one step's worth of prompt tokens is queued; how
        far ahead is `Scheduler.needs_requests` / `has_room_ahead`. On a pool of threads it
        would overlap too, but then the step loop, which gives up the GIL at every kernel
        launch, queues behind them for it (docs/benchmarks.md: W1 8.9-9.0 s this way, 9.6 s on
        four threads, 9.0-9.8 s queueing only two steps of tokens ahead). With
        `preprocess_workers`, processes do it instead, two prompts a process ahead of the
        engine; this thread only admits what they made, in order, never waiting for one
        while the device is busy.
        """
        engine = self.engine
        sched = engine.scheduler
        groups: list[list[str]] = []  # per prompt, its requests' ids (`SamplingParams.n`)
        pending: set[str] = set()
        results: dict[str, RequestOutput] = {}
        failed: list[Exception] = []
        pool = self._preprocess_pool() if self.preprocess_workers and todo else None
        ahead: deque[tuple[Future, SamplingParams]] = deque()  # prompts in the pool, in order
        if pool is not None:
            from vlmserve.frontend.preprocess import process_in_worker

        def send_ahead() -> None:
            while todo and len(ahead) < 2 * self.preprocess_workers:
                prompt, params = todo.popleft()
                ahead.append((pool.submit(process_in_worker, prompt),
                              engine.checked_params(params)))

        def next_requests(wait: bool) -> list | None:
            """The next prompt's requests, if there is room ahead: processed here, or the
            pool's (None where it is not done and not `wait`)."""
            if pool is None:
                if not todo or not sched.has_room_ahead():
                    return None
                return engine.process_requests(*todo.popleft())
            send_ahead()
            if not ahead or not sched.has_room_ahead() or not (wait or ahead[0][0].done()):
                return None
            future, params = ahead.popleft()
            send_ahead()
            return engine.requests_of(self._local(future.result()), params)

        def admit_next(wait: bool = True) -> bool:
            """Preprocess (or take preprocessed) and queue the next prompt, if any."""
            reqs = next_requests(wait)
            if reqs is None:
                return False
            groups.append([engine.add_processed_request(r) for r in reqs])
            pending.update(groups[-1])
            return True

        def admit_while_waiting() -> bool:
            try:
                return admit_next(wait=False)
            except Exception as e:  # raised after the step, which must finish its read-back
                failed.append(e)
                todo.clear()
                return False

        bar = tqdm(total=sum(p.n for _, p in todo), desc="Requests", disable=not use_tqdm,
                   unit="req")
        try:
            while todo or ahead or pending:
                while (todo or ahead) and sched.needs_requests():
                    admit_next()
                for out in engine.step(admit_while_waiting):
                    if out.finished and out.request_id in pending:
                        results[out.request_id] = out
                        pending.discard(out.request_id)
                        bar.update(1)
                if failed:
                    raise failed[0]
        except BaseException:
            for future, _ in ahead:
                future.cancel()
            engine.abort_request(list(pending))
            engine.drain()
            raise
        finally:
            bar.close()
        return [_merged([results[i] for i in ids]) for ids in groups]

    def _preprocess_pool(self):
        """The pool of `preprocess_workers` processes (the server's), started once."""
        if self._pool is None:
            from vlmserve.frontend.preprocess import start_pool

            engine = self.engine
            self._pool = start_pool(self.preprocess_workers, engine.config.model_config,
                                    engine.core.info.limits, engine.eos_token_ids)
            weakref.finalize(self, self._pool.shutdown)
        return self._pool

    def _local(self, processed: ProcessedPrompt) -> ProcessedPrompt:
        """A prompt a pool process made, its images' pixel transform this process's (the
        one every image of the model shares: images batch by it)."""
        transform = self.engine.input_processor.model_processor.pixel_transform
        return dataclasses.replace(processed, images=[
            img if img.transform is None else dataclasses.replace(img, transform=transform)
            for img in processed.images])


def _merged(outputs: list[RequestOutput]) -> RequestOutput:
    """One prompt's output: its first request's, with every completion's output in order
    (`index` 0, 1, ...)."""
    first = outputs[0]
    if len(outputs) > 1:
        first.outputs = [dataclasses.replace(o.outputs[0], index=i)
                         for i, o in enumerate(outputs)]
        first.finished = all(o.finished for o in outputs)
    return first
