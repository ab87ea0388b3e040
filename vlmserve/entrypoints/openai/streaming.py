"""Server-sent events of streamed completions: a chunk per engine output with new tokens
(from a per-stream template, not a pydantic model per token), stop-string hold-back, and an
error event plus `[DONE]` when the engine fails mid-stream."""

from __future__ import annotations

import asyncio
import functools
import json
import logging
from collections.abc import AsyncIterator

from fastapi.responses import StreamingResponse
from pydantic import BaseModel

from vlmserve.entrypoints.openai.logprobs import (
    TokenTexts,
    chat_logprobs,
    completion_choice_logprobs,
)
from vlmserve.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    ErrorInfo,
    ErrorResponse,
)
from vlmserve.entrypoints.openai.reasoning import ReasoningSplitter
from vlmserve.entrypoints.openai.responses import (
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatLogprobs,
    CompletionChoice,
    CompletionResponse,
    DeltaMessage,
    UsageInfo,
)
from vlmserve.entrypoints.openai.tool_calls import HermesCalls, RequiredCalls, call_id
from vlmserve.errors import InvalidRequestError
from vlmserve.frontend.streams import EngineDeadError, RequestFailedError, RequestStream
from vlmserve.outputs import CompletionOutput, RequestOutput
from vlmserve.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


class _TextChunk:
    """A stream's token chunks from one template: the event of a sample chunk whose text is
    `MARK`, split around it. The same bytes as building the pydantic chunk each time, at a
    fraction of the cost: a stream sends one per token, from the event loop that serves
    every stream."""

    MARK = "\x00vlmserve-text\x00"

    def __init__(self, sample: str) -> None:
        self.head, self.tail = sample.split(json.dumps(self.MARK))

    def __call__(self, text: str) -> str:
        return self.head + json.dumps(text) + self.tail


def _chat_chunk(rid: str, created: int, model: str, include_usage: bool,
                delta: DeltaMessage | None, finish: str | None = None,
                usage: UsageInfo | None = None, logprobs: ChatLogprobs | None = None,
                index: int = 0) -> str:
    """One `chat.completion.chunk` event (of choice ``index``)."""
    choices = [] if delta is None else [ChatChunkChoice(index=index, delta=delta,
                                                        finish_reason=finish,
                                                        logprobs=logprobs)]
    data = ChatCompletionChunk(id=rid, created=created, model=model, choices=choices,
                               usage=usage).model_dump()
    if delta is not None:  # OpenAI leaves unset delta fields out
        data["choices"][0]["delta"] = delta.model_dump(exclude_none=True)
    if not include_usage:
        data.pop("usage")
    return _sse(data)


def _sse(payload: BaseModel | dict | str) -> str:
    if isinstance(payload, BaseModel):
        payload = payload.model_dump()
    return f"data: {payload if isinstance(payload, str) else json.dumps(payload)}\n\n"


async def chat_events(streams: list[RequestStream], req: ChatCompletionRequest,
                      params: SamplingParams, rid: str, created: int, model: str,
                      token_texts: TokenTexts) -> AsyncIterator[str]:
    """A chat completion's SSE events: per choice (a stream each, ``n`` of them, their
    chunks as they come), a chunk per output with tokens (the role on the first; with tool
    calls, their ids, names and argument deltas instead of content) and the finish reason;
    then usage if asked (all choices' tokens), `[DONE]`."""
    chunk = functools.partial(_chat_chunk, rid, created, model, req.include_usage)
    counts: list[tuple[int, int]] = []  # (prompt tokens, output tokens) of each choice done

    mode = req.tool_call_mode

    def delta(text: str, first: bool, cid: str) -> DeltaMessage:
        """The new text: content, or the named function's arguments (its id and name on
        the first chunk)."""
        role = "assistant" if first else None
        if mode is None:  # with echo, the continued message's text first
            return DeltaMessage(role=role, content=(req.echoed or "") + text if first else text)
        call = {"index": 0, "function": {"arguments": text}}
        if first:
            call = {"index": 0, "id": cid, "type": "function",
                    "function": {"name": mode.name, "arguments": text}}
        return DeltaMessage(role=role, tool_calls=[call])

    async def choice(index: int, stream: RequestStream) -> AsyncIterator[str]:
        if mode == "required":  # calls read from the growing text
            async for event in _required_calls(index, stream):
                yield event
            return
        if mode == "auto" or req._reasoning is not None:  # thinking, content, own calls
            async for event in _parsed(index, stream):
                yield event
            return
        first = True  # the role rides on the first token's chunk
        cid = call_id()
        token_chunk = _TextChunk(chunk(delta(_TextChunk.MARK, False, cid), index=index))
        async for out, c, num_tokens in _deltas(stream):
            if c.token_ids and params.logprobs is not None:  # the new tokens' logprobs too
                yield chunk(delta(c.text, first, cid),
                            logprobs=chat_logprobs(token_texts, c.token_ids, c.logprobs,
                                                   params.logprobs), index=index)
                first = False
            elif c.token_ids:  # a chunk per output with tokens, even if no text is due yet
                yield (chunk(delta(c.text, True, cid), index=index)
                       if first else token_chunk(c.text))
                first = False
            if out.finished:
                yield chunk(DeltaMessage(), finish=c.finish_reason, index=index)
                counts.append((len(out.prompt_token_ids), num_tokens))

    async def _required_calls(index: int, stream: RequestStream) -> AsyncIterator[str]:
        calls = RequiredCalls()
        first = True
        async for out, c, num_tokens in _deltas(stream):
            deltas = calls.feed(c.text)
            if deltas:
                yield chunk(DeltaMessage(role="assistant" if first else None, tool_calls=deltas),
                            index=index)
                first = False
            if out.finished:
                if not calls.begun:  # cut before a call began: the text as it is
                    yield chunk(DeltaMessage(role="assistant", content=calls.text), index=index)
                yield chunk(DeltaMessage(), finish=c.finish_reason, index=index)
                counts.append((len(out.prompt_token_ids), num_tokens))

    async def _parsed(index: int, stream: RequestStream) -> AsyncIterator[str]:
        """The text read as it grows: the thinking apart (--reasoning-parser), and in "auto"
        mode the model's own calls out of the rest as they close."""
        split = None if req._reasoning is None else ReasoningSplitter(req._reasoning)
        calls = HermesCalls() if mode == "auto" else None
        first = True
        async for out, c, num_tokens in _deltas(stream):
            thought, content = (("", c.text) if split is None
                                else split.feed(c.text, final=out.finished))
            deltas = None
            if calls is not None:
                content, deltas = calls.feed(content, final=out.finished)
            if first and req.echoed:  # the continued message's text first
                content = req.echoed + content
            if thought or content or deltas or (c.token_ids and (
                    first or params.logprobs is not None)):  # no token's logprobs lost
                logprobs = None if params.logprobs is None or not c.token_ids else (
                    chat_logprobs(token_texts, c.token_ids, c.logprobs, params.logprobs))
                yield chunk(DeltaMessage(role="assistant" if first else None,
                                         content=content or None, tool_calls=deltas or None,
                                         reasoning=thought or None,
                                         reasoning_content=thought or None),
                            logprobs=logprobs, index=index)
                first = False
            if out.finished:
                finish = c.finish_reason
                yield chunk(DeltaMessage(), index=index, finish="tool_calls"
                            if calls is not None and calls.count and finish == "stop"
                            else finish)
                counts.append((len(out.prompt_token_ids), num_tokens))

    async for event in _merged([choice(i, s) for i, s in enumerate(streams)]):
        yield event
    if req.include_usage and counts:
        yield chunk(None, usage=UsageInfo.of(counts[0][0], sum(n for _, n in counts)))
    yield _sse("[DONE]")


async def completion_events(streams: list[RequestStream], req: CompletionRequest,
                            params: SamplingParams, rid: str, created: int, model: str,
                            token_texts: TokenTexts, echoes: list[str] | None = None
                            ) -> AsyncIterator[str]:
    """A completion's SSE events, as `chat_events` (legacy logprobs lists; a batch's
    prompts' choices in order, ``n`` each); with ``echoes`` (each choice's prompt text) each
    choice's first chunk starts with it (and its logprobs)."""

    def chunk(choices: list[CompletionChoice], usage: UsageInfo | None = None) -> str:
        data = CompletionResponse(id=rid, created=created, model=model,
                                  choices=choices, usage=usage).model_dump()
        if not req.include_usage:
            data.pop("usage")
        return _sse(data)

    counts: dict[int, tuple[int, int]] = {}  # by choice: (prompt tokens, output tokens)

    async def choice(index: int, stream: RequestStream) -> AsyncIterator[str]:
        token_chunk = _TextChunk(chunk([CompletionChoice(index=index, text=_TextChunk.MARK)]))
        offset = 0  # of the next token's text (in the tokens' texts so far)
        prefix = None if echoes is None else echoes[index]
        async for out, c, num_tokens in _deltas(stream):
            if c.token_ids and (params.logprobs is not None or prefix is not None):
                logprobs, offset = completion_choice_logprobs(token_texts, out, params,
                                                              prefix, offset)
                yield chunk([CompletionChoice(index=index, text=(prefix or "") + c.text,
                                              logprobs=logprobs)])
                prefix = None
            elif c.token_ids:
                yield token_chunk(c.text)
            if out.finished:
                yield chunk([CompletionChoice(index=index, text="",
                                              finish_reason=c.finish_reason)])
                counts[index] = (len(out.prompt_token_ids), num_tokens)

    async for event in _merged([choice(i, s) for i, s in enumerate(streams)]):
        yield event
    if req.include_usage and counts:
        n = req.n or 1  # each prompt counted once
        yield chunk([], UsageInfo.of(sum(p for i, (p, _) in counts.items() if i % n == 0),
                                     sum(t for _, t in counts.values())))
    yield _sse("[DONE]")


async def _merged(sources: list[AsyncIterator[str]]) -> AsyncIterator[str]:
    """The events of every source as they come, each source's in its order (the choices
    of a request with ``n`` > 1); an error in any ends them all."""
    if len(sources) == 1:
        async for event in sources[0]:
            yield event
        return
    pending = {asyncio.ensure_future(anext(src)): src for src in sources}
    try:
        while pending:
            done, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            for fut in done:
                src = pending.pop(fut)
                try:
                    event = fut.result()
                except StopAsyncIteration:
                    continue
                yield event
                pending[asyncio.ensure_future(anext(src))] = src
    finally:
        for fut in pending:
            fut.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
        for src in sources:
            await src.aclose()


async def _deltas(stream: RequestStream
                  ) -> AsyncIterator[tuple[RequestOutput, CompletionOutput, int]]:
    """(output, its completion, tokens so far) per engine output, each only what is new
    (`output_kind="delta"`: the output processor holds back text a stop string may still
    cut). A stream sends a chunk for every output with new tokens, as vLLM does, even when
    they add no text yet (an incomplete UTF-8 sequence, text held back for a stop string,
    tokens that decode to nothing): a client then sees each token arrive, or, when it reads
    slower than the engine makes them, every token that came meanwhile in one chunk."""
    num_tokens = 0
    try:
        async for out in stream:
            c = out.outputs[0]
            num_tokens += len(c.token_ids)
            yield out, c, num_tokens
    finally:
        stream.abort()


def event_stream(events: AsyncIterator[str], streams: list[RequestStream]
                 ) -> StreamingResponse:
    """SSE response; a client that disconnects cancels the iteration, which aborts the
    requests at once."""

    async def guarded() -> AsyncIterator[str]:
        try:
            async for event in events:
                yield event
        except (EngineDeadError, RequestFailedError) as e:
            yield _sse(ErrorResponse(error=ErrorInfo(message=str(e), type="server_error")))
            yield _sse("[DONE]")
        except InvalidRequestError as e:  # found once running: a grammar refused compiling
            yield _sse(ErrorResponse(error=ErrorInfo(message=str(e),
                                                     type="invalid_request_error")))
            yield _sse("[DONE]")
        except Exception as e:  # noqa: BLE001 - whatever failed, the stream ends properly
            logger.exception("a stream failed")
            yield _sse(ErrorResponse(error=ErrorInfo(
                message=f"internal server error: {type(e).__name__}", type="server_error")))
            yield _sse("[DONE]")
        finally:
            for stream in streams:
                stream.abort()

    return StreamingResponse(guarded(), media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache"})
