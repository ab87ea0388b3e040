"""Time of the output processor per token, by output kind and position in the output (CPU).

    python benchmarks/detok_time.py [--streams 64] [--tokens 2048]

`OutputProcessor.process` (incremental detokenization and the output built) for `--streams`
requests of the tiny model's tokenizer, one random token each per step, as a front end's I/O
thread runs it; prints microseconds per token over the first 128 tokens, tokens 128-1,023
and the rest, for cumulative and delta outputs. A cost that grows along the output is one
a long stream pays on every token."""

from __future__ import annotations

import argparse
import random
import time

from transformers import AutoTokenizer

from vlmserve.frontend.output import OutputProcessor
from vlmserve.models.builtin import resolve_model
from vlmserve.multimodal.inputs import ProcessedPrompt
from vlmserve.request import Request
from vlmserve.sampling_params import SamplingParams


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--streams", type=int, default=64)
    ap.add_argument("--tokens", type=int, default=2048)
    args = ap.parse_args()
    tokenizer = AutoTokenizer.from_pretrained(resolve_model("tiny-qwen2-vl"))
    bounds = [b for b in (128, 1024, args.tokens) if b <= args.tokens]
    for kind in ("cumulative", "delta"):
        op, rng = OutputProcessor(tokenizer), random.Random(0)
        reqs = []
        for i in range(args.streams):
            reqs.append(Request(f"r{i}", ProcessedPrompt(None, [1], []),
                                SamplingParams(max_tokens=args.tokens, output_kind=kind)))
            op.add(f"r{i}")
        cells, start, t0 = [], 0, time.perf_counter()
        for step in range(args.tokens):
            for req in reqs:
                req.output_token_ids.append(rng.randrange(200, 5000))
                op.process(req, lambda r: None)
            if step + 1 in bounds:
                t1 = time.perf_counter()
                us = (t1 - t0) / ((step + 1 - start) * args.streams) * 1e6
                cells.append(f"tokens {start}-{step}: {us:.2f} us")
                start, t0 = step + 1, t1
        print(f"{kind:>10}: " + ", ".join(cells))


if __name__ == "__main__":
    main()
