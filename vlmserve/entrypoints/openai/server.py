"""OpenAI-compatible HTTP server: chat completions with images, completions, streaming, metrics.

    vlmserve serve tiny-qwen2-vl --port 8000
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import os
import re
import time
from typing import Any

import msgspec
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST

from vlmserve import __version__
from vlmserve.encoder.client import EncoderUnavailableError
from vlmserve.entrypoints.args import ServerConfig
from vlmserve.entrypoints.openai.http_util import (
    ApiError,
    check_bearer,
    error_response,
    install_error_handlers,
    read_body,
    require_key,
)
from vlmserve.entrypoints.openai.logprobs import (
    TokenTexts,
    chat_logprobs,
    completion_choice_logprobs,
    prompt_logprobs_json,
)
from vlmserve.entrypoints.openai.metrics import ServerMetrics
from vlmserve.entrypoints.openai.openapi import openapi_schema
from vlmserve.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
    random_id,
)
from vlmserve.entrypoints.openai.reasoning import prompt_opens_thinking, split_reasoning
from vlmserve.entrypoints.openai.responses import (
    AssistantMessage,
    ChatChoice,
    ChatCompletionResponse,
    CompletionChoice,
    CompletionResponse,
    DetokenizeResponse,
    ModelCard,
    ModelList,
    TokenizeResponse,
    UsageInfo,
)
from vlmserve.entrypoints.openai.streaming import chat_events, completion_events, event_stream
from vlmserve.entrypoints.openai.tool_calls import auto_calls_of, tool_calls_of
from vlmserve.errors import (
    InvalidImageError,
    InvalidRequestError,
    InvalidSamplingParamsError,
    PromptTooLongError,
)
from vlmserve.frontend.async_llm import AsyncLLM, EngineDeadError, RequestStream
from vlmserve.frontend.streams import RequestFailedError
from vlmserve.inputs.chat import parse_chat_messages
from vlmserve.multimodal.fetch import FetchPolicy, RemoteImageFetcher
from vlmserve.multimodal.image import RestrictedImageLoader
from vlmserve.outputs import RequestOutput
from vlmserve.sampling_params import SamplingParams
from vlmserve.transfer.wire import EncoderOutputWire, output_from_wire

logger = logging.getLogger(__name__)
# a UTF-16 surrogate escape: when the body fails to decode, the likely cause is a lone one
_LONE_SURROGATE = re.compile(rb"\\u[dD][89a-fA-F][0-9a-fA-F]{2}")


class OpenAIServing:
    """The request handlers, bound to one engine and one server configuration."""

    def __init__(self, engine: AsyncLLM, cfg: ServerConfig, model_names: tuple[str, ...]
                 ) -> None:
        """`model_names`: what requests may name (--served-model-name); responses report the
        first."""
        self.engine, self.cfg = engine, cfg
        self.model_names, self.model_name = model_names, model_names[0]
        # --default-max-tokens, else the model's generation config's max_new_tokens
        self.default_max_tokens = (cfg.default_max_tokens if cfg.default_max_tokens is not None
                                   else engine.sampling_defaults.get("max_tokens"))
        self.draining = False  # shutting down: new requests are refused
        self.api_key = cfg.api_key or os.environ.get("VLMSERVE_API_KEY") or None
        # handle kinds a client may send in multi_modal_embeddings
        self.accepted_handles = tuple(k.strip() for k in cfg.accept_encoder_handles.split(",")
                                      if k.strip())
        self.image_loader = RestrictedImageLoader(
            allowed_local_dir=cfg.allowed_local_media_path, max_pixels=cfg.max_image_pixels,
            max_request_pixels=cfg.max_request_pixels, max_image_bytes=cfg.max_image_bytes,
            video_num_frames=max(1, cfg.video_num_frames))
        # http(s) images are fetched here, in the front end, by a bounded fetcher of their
        # own, and reach the preprocessing processes as bytes
        self.fetcher = RemoteImageFetcher(FetchPolicy(
            cfg.remote_image_timeout, cfg.max_remote_image_bytes,
            FetchPolicy.parse_hosts(cfg.allowed_remote_hosts)),
            cfg.remote_image_fetch_workers) if cfg.allow_remote_images else None
        self.token_texts = TokenTexts(engine.input_processor.model_processor.tokenizer)
        self.chat_template = cfg.chat_template_text()  # None: the model's

    def check_auth(self, request: Request) -> None:
        check_bearer(request, self.api_key)

    def check_accepting(self) -> None:
        if self.draining:
            raise ApiError(503, "the server is shutting down", type="server_error")

    # ---- shared steps ----------------------------------------------------------------------

    async def read_json(self, request: Request) -> dict[str, Any]:
        body = await read_body(request, self.cfg)
        try:  # msgspec: several times faster than json on megabytes of base64 images
            data = msgspec.json.decode(body)
        except msgspec.DecodeError as e:
            if _LONE_SURROGATE.search(body):  # msgspec calls these "truncated"
                raise ApiError(400, "request body holds a lone UTF-16 surrogate escape (such "
                                    "as \\ud800), which is not text") from None
            raise ApiError(400, f"request body is not valid JSON: {e}") from None
        except RecursionError:
            raise ApiError(400, "request body is not valid JSON: nested too deeply") from None
        if not isinstance(data, dict):
            raise ApiError(400, "request body must be a JSON object")
        return data

    def check_model(self, model: str | None) -> None:
        if model is not None and model not in self.model_names:
            raise ApiError(404, f"The model `{model}` does not exist; this server serves "
                                + ", ".join(f"`{m}`" for m in self.model_names) + ".",
                           param="model", code="model_not_found")

    def check_logprobs(self, params: SamplingParams, field: str) -> None:
        """--max-logprobs: a request's `field` (top_logprobs or logprobs) and prompt_logprobs
        at most it (a 400 naming it, as vLLM)."""
        limit = self.cfg.max_logprobs
        for name, value in ((field, params.logprobs), ("prompt_logprobs", params.prompt_logprobs)):
            if value is not None and value > limit:
                raise InvalidRequestError(f"{name}={value} is more than this server allows: "
                                          f"at most {limit} (--max-logprobs)")

    def check_prompt_chars(self, num_chars: int) -> None:
        """Refuse a prompt too long to tokenize at all (before spending the time on it)."""
        limit = self.cfg.max_prompt_chars or 32 * self.engine.max_model_len
        if num_chars > limit:
            raise PromptTooLongError(
                f"the request holds {num_chars} characters of text, more than the limit of "
                f"{limit} (--max-prompt-chars)")

    async def chat_prompt(self, req: ChatCompletionRequest | TokenizeRequest
                          ) -> dict[str, Any]:
        if req.tools and len(req.tools) > self.cfg.max_tools:
            raise InvalidRequestError(f"{len(req.tools)} tools in one request; at most "
                                      f"{self.cfg.max_tools} are allowed (--max-tools)")
        self.check_prompt_chars(sum(m.num_chars for m in req.messages))
        hf_messages, sources, videos = parse_chat_messages([m.to_dict() for m in req.messages])
        limit = self.cfg.limit_mm_per_prompt
        if isinstance(limit, int) and len(sources) + len(videos) > limit:
            raise InvalidRequestError(f"{len(sources) + len(videos)} images and videos in one "
                                      f"request; at most {limit} are allowed "
                                      "(--limit-mm-per-prompt)")
        for kind, items in (("image", sources), ("video", videos)):
            if len(items) > self.cfg.mm_limit(kind):
                raise InvalidRequestError(
                    f"{len(items)} {kind}s in one request; at most {self.cfg.mm_limit(kind)} "
                    "are allowed (--limit-mm-per-prompt)")

        # the engine's preprocessing decodes the images, off the event loop (with
        # `image_loader`, under this server's limits); remote ones are fetched first, here
        tools = [t.model_dump(exclude_none=True) for t in req.tools] if req.tools else None
        options = req.template_options(self.chat_template)
        try:
            prompt = self.engine.apply_chat_template(hf_messages, tools, options)
        except Exception as e:  # noqa: BLE001 - the template refused these messages
            raise InvalidRequestError(
                f"the model's chat template cannot render these messages: {e}") from None
        fetched = await self.fetch_remote(sources + videos,
                                          ["image"] * len(sources) + ["video"] * len(videos))
        mm = {"image": fetched[:len(sources)]}
        if videos:  # video files, decoded by the preprocessing
            mm["video"] = fetched[len(sources):]
        if req.mm_processor_kwargs:
            return {"prompt": prompt, "multi_modal_data": mm,
                    "mm_processor_kwargs": req.mm_processor_kwargs}
        return {"prompt": prompt, "multi_modal_data": mm}

    async def fetch_remote(self, sources: list, kinds: list[str]) -> list:
        """`sources` (of ``kinds``: image or video) with each http(s) URL replaced by its
        fetched bytes (with --allow-remote-images; otherwise the loader refuses them): the
        fetcher's `fetch_all`."""
        if self.fetcher is None:
            return sources
        return await self.fetcher.fetch_all(sources, kinds)

    async def last_outputs(self, streams: list[RequestStream], request: Request
                           ) -> list[RequestOutput]:
        """Run a non-streamed request's choices to the end; abort them all if the client goes
        away or one fails."""

        async def client_gone() -> None:
            while (await request.receive())["type"] != "http.disconnect":
                pass

        async def collect(stream: RequestStream) -> RequestOutput:
            final = None
            async for out in stream:
                final = out
            assert final is not None
            return final

        watcher = asyncio.create_task(client_gone())
        collector = asyncio.gather(*(collect(s) for s in streams))
        try:
            await asyncio.wait({watcher, collector}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            watcher.cancel()
            if not collector.done():
                collector.cancel()
            if not collector.done() or collector.cancelled() or collector.exception():
                for stream in streams:
                    stream.abort()
        if not collector.done() or collector.cancelled():
            raise ApiError(499, "client disconnected")
        return collector.result()

    # ---- endpoints -------------------------------------------------------------------------

    async def chat(self, request: Request) -> Response:
        arrival = time.monotonic()
        self.check_auth(request)
        self.check_accepting()
        req = ChatCompletionRequest.model_validate(await self.read_json(request))
        req._auto_tool_choice = self.cfg.enable_auto_tool_choice
        self.check_model(req.model)
        params = req.sampling_params(self.engine.sampling_defaults)
        self.check_logprobs(params, "top_logprobs")
        prompt = await self.chat_prompt(req)
        if self.cfg.reasoning_parser is not None and req.tool_call_mode in (None, "auto"):
            # under a grammar the answer is what the grammar lets it write: thinking only
            # where it opens <think> itself
            req._reasoning = (params.structured_outputs is None
                              and prompt_opens_thinking(prompt["prompt"]))
        rid, created = random_id("chatcmpl"), int(time.time())
        streams = await self.engine.add_requests(prompt, params, rid, req.n or 1, arrival,
                                                 self.image_loader, self.default_max_tokens)
        if req.stream:
            return event_stream(chat_events(streams, req, params, rid, created,
                                            self.model_name, self.token_texts), streams)
        outs = await self.last_outputs(streams, request)
        mode = req.tool_call_mode
        choices = []
        for i, out in enumerate(outs):
            c = out.outputs[0]
            logprobs = None if params.logprobs is None else chat_logprobs(
                self.token_texts, c.token_ids, c.logprobs, params.logprobs)
            finish, text, reasoning = c.finish_reason, c.text, None
            if req._reasoning is not None:  # the thinking apart (--reasoning-parser)
                reasoning, text = split_reasoning(text, req._reasoning)
            if mode == "auto":  # the model's own calls, if it made any
                content, calls = auto_calls_of(text or "")
                if req.echoed:  # the continued message's text first, as streamed
                    content = req.echoed + (content or "")
                message = AssistantMessage(content=content, tool_calls=calls or None)
                finish = "tool_calls" if calls and finish == "stop" else finish
            else:
                calls = None if mode is None else tool_calls_of(mode, text)
                message = (AssistantMessage(content=(req.echoed or "") + text
                                            if text is not None else req.echoed)
                           if calls is None else AssistantMessage(content=None, tool_calls=calls))
            message.reasoning = message.reasoning_content = reasoning
            choices.append(ChatChoice(index=i, message=message, logprobs=logprobs,
                                      finish_reason=finish))
        return JSONResponse(ChatCompletionResponse(
            id=rid, created=created, model=self.model_name, choices=choices,
            usage=_usage(outs, len(outs)), prompt_logprobs=self.prompt_logprobs(outs[0], params)
        ).model_dump())

    def prompt_logprobs(self, out: RequestOutput, params: SamplingParams) -> list | None:
        """vLLM's `prompt_logprobs` of a response, if the request asked."""
        if params.prompt_logprobs is None or out.prompt_logprobs is None:
            return None
        return prompt_logprobs_json(self.token_texts, out.prompt_token_ids,
                                    out.prompt_logprobs, out.prompt_logprob_ranks,
                                    params.prompt_logprobs)

    async def tokenize(self, request: Request) -> Response:
        """vLLM's `POST /tokenize`: the token ids a prompt or chat would run as (images
        expanded), their count and the context length; the length is not checked."""
        self.check_auth(request)
        req = TokenizeRequest.model_validate(await self.read_json(request))
        self.check_model(req.model)
        if req.prompt is not None:
            self.check_prompt_chars(len(req.prompt))
            prompt: dict[str, Any] = {"prompt": req.prompt}
        else:
            prompt = await self.chat_prompt(req)
        tokens = await self.engine.tokenize(prompt, self.image_loader)
        strs = None
        if req.return_token_strs:
            strs = self.token_texts.tokenizer.convert_ids_to_tokens(tokens)
        return JSONResponse(TokenizeResponse(
            count=len(tokens), max_model_len=self.engine.max_model_len, tokens=tokens,
            token_strs=strs).model_dump())

    async def detokenize(self, request: Request) -> Response:
        """vLLM's `POST /detokenize`: token ids back to text (special tokens kept)."""
        self.check_auth(request)
        req = DetokenizeRequest.model_validate(await self.read_json(request))
        self.check_model(req.model)
        tokenizer = self.token_texts.tokenizer
        bad = [t for t in req.tokens if not 0 <= t < len(tokenizer)]
        if bad:
            raise ApiError(400, f"tokens: {bad[0]} is not a token id of this model's "
                           f"tokenizer (0 to {len(tokenizer) - 1})", "tokens")
        return JSONResponse(DetokenizeResponse(
            prompt=tokenizer.decode(req.tokens, skip_special_tokens=False)).model_dump())

    def encoded_prompt(self, req: CompletionRequest) -> dict[str, Any]:
        """A completion whose images an encoder server encoded (`multi_modal_embeddings`):
        the prompt with an `EncoderOutput` whose handles the preprocessing opens once."""
        if not isinstance(req.prompt, str):
            raise ApiError(400, "with multi_modal_embeddings, the prompt must be the text "
                           "the encoder server encoded", "prompt")
        try:
            wire = msgspec.json.decode(json.dumps(req.multi_modal_embeddings),
                                       type=EncoderOutputWire)
            output = output_from_wire(wire, self.accepted_handles)
        except (msgspec.ValidationError, ValueError) as e:
            raise ApiError(400, f"multi_modal_embeddings: {e}", "multi_modal_embeddings"
                           ) from None
        return {"prompt": req.prompt, "multi_modal_embeddings": output}

    async def completions(self, request: Request) -> Response:
        arrival = time.monotonic()
        self.check_auth(request)
        self.check_accepting()
        req = CompletionRequest.model_validate(await self.read_json(request))
        self.check_model(req.model)
        params = req.sampling_params(self.engine.sampling_defaults)
        self.check_logprobs(params, "logprobs")
        n = req.n or 1
        for p in req.prompts:
            if isinstance(p, str):
                self.check_prompt_chars(len(p))
        prompts: list[Any] = [p if isinstance(p, str) else {"prompt_token_ids": p}
                              for p in req.prompts]
        if req.multi_modal_embeddings is not None:
            if n > 1 or len(prompts) > 1:  # each choice would open the same handles
                raise ApiError(400, "with multi_modal_embeddings, give one prompt and n 1",
                               "n" if n > 1 else "prompt")
            prompts = [self.encoded_prompt(req)]
        rid, created = random_id("cmpl"), int(time.time())
        # a batch's prompts preprocessed side by side; one refused ends them all
        added = await asyncio.gather(*(self.engine.add_requests(
            prompt, params, rid if i == 0 else f"{rid}_{i}", n, arrival,
            default_max_tokens=self.default_max_tokens) for i, prompt in enumerate(prompts)),
            return_exceptions=True)
        failed = [e for e in added if isinstance(e, BaseException)]
        streams = [s for got in added if not isinstance(got, BaseException) for s in got]
        if failed:
            for stream in streams:
                stream.abort()
            raise failed[0]
        echoes = None
        if req.echo:  # each prompt's text, as given (token ids decoded), for its n choices
            echoes = [p if isinstance(p, str) else self.token_texts.tokenizer.decode(
                p, skip_special_tokens=False) for p in req.prompts for _ in range(n)]
        if req.stream:
            return event_stream(completion_events(streams, req, params, rid, created,
                                                  self.model_name, self.token_texts, echoes),
                                streams)
        outs = await self.last_outputs(streams, request)
        choices = []
        for i, out in enumerate(outs):
            c = out.outputs[0]
            echo = None if echoes is None else echoes[i]
            choices.append(CompletionChoice(
                index=i, text=c.text if echo is None else echo + c.text,
                logprobs=completion_choice_logprobs(self.token_texts, out, params, echo)[0],
                finish_reason=c.finish_reason,
                prompt_logprobs=self.prompt_logprobs(out, params) if req.prompt_logprobs
                is not None else None))
        return JSONResponse(CompletionResponse(
            id=rid, created=created, model=self.model_name, choices=choices,
            usage=_usage(outs, n)).model_dump())


def _usage(outs: list[RequestOutput], n: int) -> UsageInfo:
    """A request's usage: each prompt once (``n`` choices each, in order), the output tokens
    of all its choices."""
    return UsageInfo.of(sum(len(out.prompt_token_ids) for out in outs[::n]),
                        sum(len(out.outputs[0].token_ids) for out in outs))


def build_app(engine: AsyncLLM, args: Any = None) -> FastAPI:
    """The FastAPI app over a running `AsyncLLM`; `args` carries `ServerConfig`
    fields (an argparse namespace or a `ServerConfig`)."""
    cfg = args if isinstance(args, ServerConfig) else ServerConfig.from_args(args)
    names = cfg.served_model_names() or (getattr(args, "model", None) or engine.model_name,)
    serving = OpenAIServing(engine, cfg, names)
    metrics = ServerMetrics(engine)
    app = FastAPI(title="vlmserve", description="OpenAI-compatible vision-language server")
    app.state.engine, app.state.serving, app.state.metrics = engine, serving, metrics

    install_error_handlers(app)
    require_key(app, serving.api_key)  # /stats, /docs, /openapi.json

    @app.exception_handler(InvalidRequestError)
    async def _invalid(_: Request, e: InvalidRequestError) -> JSONResponse:
        param = code = None
        if isinstance(e, InvalidSamplingParamsError):
            param = str(e).split(" ", 1)[0]
        elif isinstance(e, PromptTooLongError):
            param, code = "messages", "context_length_exceeded"
        elif isinstance(e, InvalidImageError):
            param, code = "messages", "invalid_image"
        return error_response(400, str(e), param, code)

    @app.exception_handler(EngineDeadError)
    async def _dead(_: Request, e: EngineDeadError) -> JSONResponse:
        return error_response(503, str(e), type="server_error")

    @app.exception_handler(EncoderUnavailableError)
    async def _no_encoder(_: Request, e: EncoderUnavailableError) -> JSONResponse:
        return error_response(503, str(e), type="server_error")

    @app.exception_handler(RequestFailedError)
    async def _failed(_: Request, e: RequestFailedError) -> JSONResponse:
        return error_response(500, str(e), type="server_error")

    @app.get("/version")
    async def version() -> JSONResponse:
        return JSONResponse({"version": __version__})

    @app.get("/ping")  # SageMaker's health check (and vLLM's), as /health
    @app.post("/ping")
    @app.get("/health")
    async def health() -> Response:
        if not engine.is_running:
            return error_response(503, "the engine is not running", type="server_error")
        if serving.draining:
            return error_response(503, "the server is shutting down", type="server_error")
        limit = cfg.health_stall_timeout
        try:  # a round trip to the core: it answers between steps
            stalled = (await asyncio.wait_for(engine.get_stats(), limit))["stalled_s"]
        except TimeoutError:
            return error_response(503, f"the engine did not answer within {limit:g} s",
                                  type="server_error")
        if stalled > limit:
            return error_response(503, f"the engine has computed no token for {stalled:.0f} s "
                                       "while requests wait", type="server_error")
        return JSONResponse({"status": "ok"})

    @app.post("/reset_prefix_cache")
    async def reset_prefix_cache(request: Request) -> Response:
        serving.check_auth(request)
        await engine.reset_prefix_cache()
        return JSONResponse({"status": "ok"})

    @app.get("/stats")
    async def stats() -> JSONResponse:
        return JSONResponse(await engine.get_stats())

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(await metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models(request: Request) -> JSONResponse:
        serving.check_auth(request)
        cards = [ModelCard(id=name, max_model_len=engine.max_model_len) for name in names]
        return JSONResponse(ModelList(data=cards).model_dump())

    app.post("/v1/chat/completions")(serving.chat)
    app.post("/v1/completions")(serving.completions)
    app.post("/tokenize")(serving.tokenize)
    app.post("/detokenize")(serving.detokenize)
    app.openapi = functools.partial(openapi_schema, app, names)  # type: ignore[method-assign]
    return app
