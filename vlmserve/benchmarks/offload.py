"""Image-embedding offload: the same workload with offload off and on, in one process.

    python -m vlmserve.benchmarks.offload --model qwen2-vl-2b-random --num-requests 64 \\
        --images-per-request 4 --image-size 1344 --max-num-batched-tokens 2048 --output-len 64

Reports, per mode: peak device bytes held by image embeddings, total device memory peak,
output and total throughput, steps that waited for a prefetch, prefetch hit/miss rows.
"""

from __future__ import annotations

import argparse
import gc
import json
import time

import torch

from vlmserve.benchmarks import engine_options, parse_args, table, with_local_model
from vlmserve.benchmarks.datasets import random_mm
from vlmserve.flags import add_engine_options


def run_mode(reqs, warmup, offload: bool, args) -> dict:
    from vlmserve import LLM, SamplingParams

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    llm = LLM(**engine_options(args), max_num_seqs=args.num_requests,
              mm_embedding_offload=offload)
    params = SamplingParams(max_tokens=args.output_len, temperature=0.0, ignore_eos=True)
    llm.generate([r.prompt for r in warmup], params, use_tqdm=False)
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    base = llm.engine.get_stats()
    t0 = time.perf_counter()
    outs = llm.generate([r.prompt for r in reqs], params, use_tqdm=True)
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    elapsed = time.perf_counter() - t0
    s = llm.engine.get_stats()
    n_out = sum(len(o.outputs[0].token_ids) for o in outs)
    n_in = sum(len(o.prompt_token_ids) for o in outs)
    result = {
        "offload": offload,
        "elapsed_s": elapsed,
        "output_tokens_per_s": n_out / elapsed,
        "total_tokens_per_s": (n_in + n_out) / elapsed,
        "prompt_tokens": n_in,
        "embedding_peak_device_mib": s["mm_embedding_peak_bytes_device"] / 2**20,
        "embedding_host_mib_at_end": s["mm_embedding_bytes_host"] / 2**20,
        "device_memory_peak_gib": (torch.cuda.max_memory_allocated() / 2**30
                                   if torch.cuda.is_available() else None),
        "engine_steps": s["num_steps"] - base["num_steps"],
        "prefetch_waits": s["prefetch_waits"] - base["prefetch_waits"],
        "prefetch_hit_rows": s["prefetch_hit_rows"] - base["prefetch_hit_rows"],
        "prefetch_miss_rows": s["prefetch_miss_rows"] - base["prefetch_miss_rows"],
        "images_encoded": s["num_images_encoded"] - base["num_images_encoded"],
        "token_ids": [o.outputs[0].token_ids for o in outs],
    }
    del llm, outs
    return result


def summary_table(results: list[dict], summary: dict) -> str:
    """Offload off and on, to read on screen."""
    def mib(v) -> str:
        return "-" if v is None else f"{v:.1f}"

    rows = [["on" if r["offload"] else "off", f"{r['elapsed_s']:.2f}",
             f"{r['output_tokens_per_s']:.0f}", mib(r["embedding_peak_device_mib"]),
             mib(r["embedding_host_mib_at_end"]),
             "-" if r["device_memory_peak_gib"] is None else f"{r['device_memory_peak_gib']:.2f}",
             str(r["prefetch_waits"]), f"{r['prefetch_hit_rows']}/{r['prefetch_miss_rows']}"]
            for r in results]
    head = ["offload", "elapsed s", "output tok/s", "emb. device MiB", "emb. host MiB",
            "device peak GiB", "prefetch waits", "prefetch hit/miss rows"]
    return "\n".join([
        table(head, rows),
        f"throughput on vs off: {summary['throughput_ratio_on_vs_off']:.2f}x; greedy outputs "
        f"{'identical' if summary['greedy_outputs_identical'] else 'DIFFER'}"])


def add_args(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--num-requests", type=int, default=64,
                    help="requests (all admitted at once: max_num_seqs)")
    ap.add_argument("--images-per-request", type=int, default=4, help="images in each request")
    ap.add_argument("--image-size", type=int, default=1344, help="square image side in pixels")
    ap.add_argument("--prompt-len", type=int, default=50, help="text tokens of each prompt")
    ap.add_argument("--output-len", type=int, default=64,
                    help="output tokens of each request (fixed: ignore_eos)")
    ap.add_argument("--on-first", action="store_true",
                    help="run offload on before off (check that order does not matter)")
    ap.add_argument("--out", default=None, help="write the full results as JSON here")
    # the engine's own options; max_num_seqs is --num-requests and the offload each mode's
    add_engine_options(ap, skip=("max_num_seqs", "mm_embedding_offload"), defaults={
        "max_num_batched_tokens": (2048, "part of the workload: a 1344 px image's 2,304 rows "
                                   "span two steps, so the offloaded rows are prefetched; also "
                                   "the size of each ping-pong buffer")})


def main(args: argparse.Namespace | None = None) -> None:
    args = parse_args(args, add_args, __doc__)
    from vlmserve.models.loader import load_hf_config
    from vlmserve.models.registry import resolve_model_class

    args.model = with_local_model(engine_options(args))["model"]
    cfg = load_hf_config(args.model)
    tok = resolve_model_class(cfg).input_processor_cls(args.model, cfg).tokenizer
    reqs = random_mm(tok, num_requests=args.num_requests, image_sizes=[args.image_size],
                     images_per_request=args.images_per_request, prompt_len=args.prompt_len,
                     output_len=args.output_len)
    warmup = random_mm(tok, num_requests=2, image_sizes=[args.image_size],
                       images_per_request=args.images_per_request, prompt_len=args.prompt_len,
                       output_len=4, seed=1)  # other images: the measured run starts cold
    order = (True, False) if args.on_first else (False, True)
    runs = {mode: run_mode(reqs, warmup, mode, args) for mode in order}
    results = [runs[False], runs[True]]  # off, on
    same = results[0].pop("token_ids") == results[1].pop("token_ids")
    summary = {"greedy_outputs_identical": same,
               "throughput_ratio_on_vs_off": results[1]["output_tokens_per_s"]
               / results[0]["output_tokens_per_s"]}
    print(summary_table(results, summary))
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"args": vars(args), "results": results, "summary": summary}, f, indent=2)


if __name__ == "__main__":
    main()
