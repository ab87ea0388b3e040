"""Multi-turn chat benchmark against any OpenAI-compatible server (vlmserve or vLLM): many
conversations at once, each a few turns long, the first turn with images, every later turn
adding the assistant's reply and a new question. What prefix caching is for: turns 2 and up
share all but their new text with the turn before.

    python -m vlmserve.benchmarks.multiturn --base-url http://127.0.0.1:8000 \\
        --conversations 64 --turns 4 --images 2 --output-len 64

Prints one JSON line: mean / p50 / p99 TTFT of turn 1 and of turns 2 and up, per-turn means,
total tokens per second and requests per second.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from pathlib import Path

import aiohttp
import numpy as np

from vlmserve.benchmarks.client import (
    chat_body,
    first_model,
    image_data_url,
    open_session,
    stream_chat,
)

WORDS = ("the quick brown fox jumps over a lazy dog while seven wise owls watch from old oak "
         "trees near the quiet river that flows past green hills and small stone houses under "
         "a bright summer sky full of white clouds drifting slowly toward distant blue "
         "mountains").split()


def question(rng: np.random.Generator, words: int) -> str:
    return " ".join(rng.choice(WORDS, words)) + "?"


async def converse(session: aiohttp.ClientSession, model: str, first: list[dict], turns: int,
                   words: int, output_len: int, rng: np.random.Generator) -> list[dict]:
    """One conversation, turn after turn: per turn its TTFT, prompt and output tokens."""
    messages = [{"role": "user", "content": first}]
    results = []
    for turn in range(turns):
        if turn:
            messages.append({"role": "user", "content": question(rng, words)})
        res = await stream_chat(session, chat_body(model, messages, output_len))
        if res.error is not None:
            raise RuntimeError(f"turn {turn + 1}: {res.error}")
        messages.append({"role": "assistant", "content": "".join(res.text)})
        results.append({"turn": turn + 1, "ttft": res.ttft, "latency": res.e2e,
                        "prompt_tokens": res.prompt_tokens,
                        "completion_tokens": res.completion_tokens})
    return results


def _stats(xs: list[float]) -> dict[str, float]:
    a = np.asarray(xs) * 1000
    return {"mean_ms": float(a.mean()), "p50_ms": float(np.percentile(a, 50)),
            "p99_ms": float(np.percentile(a, 99))}


async def run(args: argparse.Namespace) -> dict:
    rng = np.random.default_rng(args.seed)
    sides = [int(s) for s in args.image_sizes.split(",")]
    firsts = [[{"type": "image_url",
                "image_url": {"url": image_data_url(sides[j % len(sides)], rng)}}
               for j in range(args.images)] + [{"type": "text", "text": question(rng, args.words)}]
              for _ in range(args.conversations + 1)]
    async with open_session(args.base_url) as session:
        model = args.model or await first_model(session)
        # a warm-up conversation (its own images): not counted
        await converse(session, model, firsts[-1], 1, args.words, args.output_len, rng)
        start = time.perf_counter()
        convs = await asyncio.gather(*(
            converse(session, model, firsts[i], args.turns, args.words, args.output_len,
                     np.random.default_rng(args.seed + 1 + i))
            for i in range(args.conversations)))
        duration = time.perf_counter() - start
    turns = [t for conv in convs for t in conv]
    later = [t["ttft"] for t in turns if t["turn"] > 1]
    tokens = sum(t["prompt_tokens"] + t["completion_tokens"] for t in turns)
    return {
        "conversations": args.conversations, "turns": args.turns, "duration_s": duration,
        "requests_per_s": len(turns) / duration,
        "output_tokens_per_s": sum(t["completion_tokens"] for t in turns) / duration,
        "total_tokens_per_s": tokens / duration,
        "ttft_turn1": _stats([t["ttft"] for t in turns if t["turn"] == 1]),
        "ttft_turns_2_up": _stats(later) if later else None,
        "mean_ttft_ms_by_turn": [float(np.mean([t["ttft"] for t in turns if t["turn"] == k])
                                       * 1000) for k in range(1, args.turns + 1)],
        "mean_prompt_tokens_by_turn": [float(np.mean([t["prompt_tokens"] for t in turns
                                                      if t["turn"] == k]))
                                       for k in range(1, args.turns + 1)],
    }


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    ap.add_argument("--base-url", default="http://127.0.0.1:8000")
    ap.add_argument("--model", default=None, help="served model name (default: the first)")
    ap.add_argument("--conversations", type=int, default=64)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--images", type=int, default=2, help="images in each first turn")
    ap.add_argument("--image-sizes", default="448,672", help="square sides, cycled")
    ap.add_argument("--words", type=int, default=45, help="words of each question")
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=None, help="also write the JSON here")
    args = ap.parse_args(argv)
    result = asyncio.run(run(args))
    print(json.dumps(result))
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main()
