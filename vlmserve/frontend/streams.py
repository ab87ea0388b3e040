"""What a caller of the front end holds per request: its stream of outputs and its timing."""

from __future__ import annotations

import asyncio
from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from vlmserve.outputs import RequestOutput

if TYPE_CHECKING:
    from vlmserve.frontend.async_llm import AsyncLLM


class EngineDeadError(RuntimeError):
    """The engine core stopped (shut down, crashed or killed)."""


class RequestFailedError(RuntimeError):
    """A request failed inside the engine (a step that ran it raised); the engine serves on."""


@dataclass
class RequestTiming:
    """Per-request timing (`time.monotonic()` seconds) and token counts, for metrics."""

    arrival_time: float
    num_prompt_tokens: int = 0
    sent_time: float | None = None  # handed to the engine core (front-end work done)
    token_times: list[float] = field(default_factory=list)  # when each output token came out
    finished_time: float | None = None
    finish_reason: str | None = None  # "stop", "length", "abort" once finished

    @property
    def frontend_time(self) -> float | None:
        return None if self.sent_time is None else self.sent_time - self.arrival_time

    @property
    def first_token_time(self) -> float | None:
        return self.token_times[0] if self.token_times else None

    @property
    def ttft(self) -> float | None:
        first = self.first_token_time
        return None if first is None else first - self.arrival_time

    @property
    def inter_token_latencies(self) -> list[float]:
        return [b - a for a, b in zip(self.token_times, self.token_times[1:])]

    @property
    def e2e_latency(self) -> float | None:
        return None if self.finished_time is None else self.finished_time - self.arrival_time


def put_all(items: list[tuple[RequestStream, Any]]) -> None:  # on the event loop
    for stream, item in items:
        stream._put(item)


def _joined(run: list[RequestOutput]) -> RequestOutput:
    """Successive delta outputs of a request as one (the last, extended; in one pass, so a
    reader that comes back after many steps costs time linear in what it missed)."""
    parts = [o.outputs[0] for o in run]
    last = parts[-1]
    last.text = "".join(c.text for c in parts)
    last.token_ids = [t for c in parts for t in c.token_ids]
    if last.logprobs is not None:
        last.logprobs = [lp for c in parts for lp in c.logprobs]
    first = run[0]  # the prompt's logprobs ride on a request's first output only
    if first.prompt_logprobs is not None:
        run[-1].prompt_logprobs = first.prompt_logprobs
        run[-1].prompt_logprob_ranks = first.prompt_logprob_ranks
    return run[-1]


class RequestStream:
    """Async iterator over one request's `RequestOutput`s (cumulative or, with `delta`,
    each only what is new): one per step, or, when the consumer falls behind the engine,
    those waiting as one (the newest cumulative one, or the deltas joined): one chunk then
    carries all their tokens, less work per token for a loaded front end and its clients,
    as vLLM's output collector merges.

    Leaving the iteration early (`aclose()`, `abort()`, cancellation, or dropping the stream)
    aborts the request in the engine core, which frees its KV blocks and encoder cache
    references.
    """

    def __init__(self, engine: AsyncLLM, request_id: str, loop: asyncio.AbstractEventLoop,
                 timing: RequestTiming, delta: bool = False) -> None:
        self.engine = engine
        self.delta = delta
        self.request_id = request_id
        self.timing = timing
        self._loop = loop
        self._items: deque[Any] = deque()  # outputs not yet taken, then an exception
        self._ready = asyncio.Event()
        self.finished = False

    def _put(self, item: Any) -> None:  # on the event loop
        self._items.append(item)
        self._ready.set()

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> RequestOutput:
        if self.finished:
            raise StopAsyncIteration
        while not self._items:
            self._ready.clear()
            try:
                await self._ready.wait()
            except BaseException:  # cancelled while waiting: the consumer is gone
                self.abort()
                raise
        item = self._items.popleft()
        # a consumer that fell behind takes the outputs waiting as one (an error is never
        # merged or skipped)
        if self._items and not isinstance(item, BaseException):
            run = [item]
            while self._items and not isinstance(self._items[0], BaseException):
                run.append(self._items.popleft())
            item = _joined(run) if self.delta else run[-1]
        if isinstance(item, BaseException):
            self.finished = True
            raise item
        if item.finished:
            self.finished = True
        return item

    def abort(self) -> None:
        """Stop the request now (no-op once finished)."""
        if not self.finished:
            self.finished = True
            self.engine.abort(self.request_id)

    async def aclose(self) -> None:
        self.abort()

    def __del__(self) -> None:
        if not self.finished:
            self.engine.abort(self.request_id)
