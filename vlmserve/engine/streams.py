"""What a caller of the front end holds per request: its stream of outputs and its timing."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from vlmserve.outputs import RequestOutput

if TYPE_CHECKING:
    from vlmserve.engine.async_llm import AsyncLLM


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


class RequestStream:
    """Async iterator over one request's cumulative `RequestOutput`s.

    Leaving the iteration early (`aclose()`, `abort()`, cancellation, or dropping the stream)
    aborts the request in the engine core, which frees its KV blocks and encoder cache
    references.
    """

    def __init__(self, engine: AsyncLLM, request_id: str, loop: asyncio.AbstractEventLoop,
                 timing: RequestTiming) -> None:
        self.engine = engine
        self.request_id = request_id
        self.timing = timing
        self._loop = loop
        self._queue: asyncio.Queue[Any] = asyncio.Queue()
        self.finished = False

    def _put(self, item: Any) -> None:  # on the event loop
        self._queue.put_nowait(item)

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> RequestOutput:
        if self.finished:
            raise StopAsyncIteration
        try:
            item = await self._queue.get()
        except BaseException:  # cancelled while waiting: the consumer is gone
            self.abort()
            raise
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
