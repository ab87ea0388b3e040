"""Offline cost of structured outputs: the same requests (text prompts, ignore_eos, a fixed
number of output tokens) plain and held to a JSON schema / a regular expression; seconds and
output tokens per second of each. Usage: python benchmarks/structured_time.py MODEL
[--num-requests N] [--output-len N]"""

from __future__ import annotations

import argparse
import json
import time

from vlmserve import LLM, SamplingParams, StructuredOutputsParams

SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string"}, "age": {"type": "integer"},
    "tags": {"type": "array", "items": {"type": "string"}}}, "required": ["name", "age"]}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("--num-requests", type=int, default=256)
    ap.add_argument("--output-len", type=int, default=128)
    args = ap.parse_args()
    llm = LLM(args.model)
    prompts = [f"Request {i}: describe a person as JSON." for i in range(args.num_requests)]
    kinds = {"plain": None, "json_schema": StructuredOutputsParams(json=SCHEMA),
             "regex": StructuredOutputsParams(regex=r"[a-z ]{1,4000}")}
    for rnd in range(2):  # the first round compiles the grammars and warms up
        for name, so in kinds.items():
            params = SamplingParams(max_tokens=args.output_len, temperature=0.0,
                                    ignore_eos=True, structured_outputs=so)
            t = time.perf_counter()
            outs = llm.generate(prompts, params, use_tqdm=False)
            dt = time.perf_counter() - t
            n = sum(len(o.outputs[0].token_ids) for o in outs)
            if rnd:
                print(json.dumps({"kind": name, "requests": len(prompts), "seconds": round(dt, 3),
                                  "output_tokens_per_s": round(n / dt)}))


if __name__ == "__main__":
    main()
