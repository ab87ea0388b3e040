"""A multi-turn, multi-image chat workload against an OpenAI-compatible server, and what its
follow-up turns found in the servers' prefix caches (data-parallel and Ray tests)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import openai

from tests.e2e.test_server import data_url, user
from tests.engine.helpers import make_image


def conversations(count: int, images: int = 3, size: int = 224) -> list[list[dict]]:
    """`count` chats' first turns: each its own `images` random images, then a question."""
    return [user(f"Chat {c}: what do these pictures show?",
                 *(data_url(make_image(size, size, 1000 * c + i)) for i in range(images)))
            for c in range(count)]


async def _answer(stream) -> str:
    return "".join([chunk.choices[0].delta.content or "" async for chunk in stream
                    if chunk.choices])


async def run_chats(base_url: str, model: str, chats: list[list[dict]], turns: int,
                    stats: Callable[[], dict], max_tokens: int = 4) -> float:
    """Run every chat for `turns` turns (all chats' turn t at once, then turn t + 1, each
    re-sending the chat so far with the answers); the prefix cache's hit rate over the turns
    after the first (the ones whose prefix could be cached), read from `stats()` (the server's
    /stats: prefix_cache_hit_tokens and prefix_cache_queried_tokens). Each turn's requests
    are sent in the chats' order, each once the one before has been routed (its response
    began), so that a seeded random routing decides alike in every run."""
    client = openai.AsyncOpenAI(base_url=base_url + "/v1", api_key="none", max_retries=0)
    before = None
    try:
        for turn in range(turns):
            if turn == 1:
                before = stats()
            pending = []
            for chat in chats:
                stream = await client.chat.completions.create(
                    model=model, messages=chat, max_tokens=max_tokens, temperature=0.0,
                    stream=True)
                pending.append(asyncio.ensure_future(_answer(stream)))
            answers = await asyncio.gather(*pending)
            for c, (chat, answer) in enumerate(zip(chats, answers, strict=True)):
                chat.append({"role": "assistant", "content": answer})
                chat.extend(user(f"Turn {turn + 2} of chat {c}: and then?"))
    finally:
        await client.close()
    after = stats()
    assert before is not None
    queried = after["prefix_cache_queried_tokens"] - before["prefix_cache_queried_tokens"]
    return (after["prefix_cache_hit_tokens"] - before["prefix_cache_hit_tokens"]) / queried
