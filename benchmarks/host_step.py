"""The host's share of an engine step at large batch (runs on CPU): `engine.step()` time minus
the model forward, split into schedule, read-back, output processing and input preparation,
with `batch` text requests all decoding.

    python benchmarks/host_step.py [--model tiny-qwen2-vl] [--batch 256] [--output-kind final_only]
"""

import argparse
import collections
import time

from vlmserve import LLM, SamplingParams
from vlmserve.worker.model_runner import StepResult


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="tiny-qwen2-vl")
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--output-kind", default="cumulative", choices=["cumulative", "final_only"])
    args = ap.parse_args()
    llm = LLM(args.model, max_num_seqs=args.batch, dtype="float32", device="cpu")
    engine = llm.engine
    runner = engine.executor.runner
    spent: collections.Counter = collections.Counter()

    def timed(owner, name: str, key: str) -> None:
        fn = getattr(owner, name)

        def wrapper(*a, **kw):
            t0 = time.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                spent[key] += time.perf_counter() - t0
        setattr(owner, name, wrapper)

    timed(engine.scheduler, "schedule", "schedule")
    timed(engine.scheduler, "update_from_output", "update")  # tokens into the requests
    timed(engine, "_outputs", "outputs")  # detokenization and outputs (front ends, served)
    timed(StepResult, "get", "read_back")
    timed(runner, "execute_model", "execute")
    timed(runner, "_forward_eager", "forward")
    params = SamplingParams(max_tokens=args.steps + 64, temperature=0.0, ignore_eos=True,
                            output_kind=args.output_kind)
    ids = [32 + (i * 7919) % 95 for i in range(64)]
    for _ in range(args.batch):
        engine.add_request({"prompt_token_ids": ids}, params)
    for _ in range(10):  # prefill and a few decodes
        engine.step()
    spent.clear()
    t0 = time.perf_counter()
    for _ in range(args.steps):
        engine.step()
    total = time.perf_counter() - t0
    per_step = {k: round(1e3 * v / args.steps, 3) for k, v in spent.items()}
    per_step["input_preparation"] = round(per_step.pop("execute") - per_step["forward"], 3)
    print({"batch": args.batch, "output_kind": args.output_kind,
           "host_ms_per_step": round(1e3 * (total - spent["forward"]) / args.steps, 3),
           **{f"{k}_ms": v for k, v in per_step.items() if k != "forward"}})


if __name__ == "__main__":
    main()
