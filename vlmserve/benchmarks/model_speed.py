"""Model-level speed against the hardware: decode step time vs the memory-bandwidth floor,
prefill + vision throughput vs the measured bf16 matrix rate (CUDA).

    python -m vlmserve.benchmarks.model_speed --model qwen2-vl-2b-random
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from vlmserve.benchmarks import parse_args
from vlmserve.benchmarks.datasets import random_mm


def device_ceilings(device: str = "cuda") -> dict:
    """Measured copy bandwidth (read + write bytes / s) and bf16 matmul rate (FLOP/s)."""
    from triton.testing import do_bench

    src = torch.randn(2**28, device=device, dtype=torch.bfloat16)  # 512 MiB
    dst = torch.empty_like(src)
    t = do_bench(lambda: dst.copy_(src), warmup=50, rep=200, return_mode="median") / 1e3
    bw = 2 * src.numel() * src.element_size() / t
    n = 8192
    a = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    t = do_bench(lambda: a @ b, warmup=50, rep=200, return_mode="median") / 1e3
    return {"copy_bandwidth_gbs": bw / 1e9, "bf16_matmul_tflops": 2 * n**3 / t / 1e12}


def _lm_params(model) -> int:
    return sum(p.numel() for n, p in model.named_parameters() if not n.startswith("visual."))


def decode_step(llm, prompt_len: int, ceilings: dict, batch: int = 1, steps: int = 128) -> dict:
    """Time per decode step for `batch` text requests, against weights + KV bytes / bandwidth."""
    from vlmserve import SamplingParams

    tok = llm.get_tokenizer()
    ids = tok.encode("hello " * prompt_len)[:prompt_len]
    prompts = [{"prompt_token_ids": ids} for _ in range(batch)]

    def run(n):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        llm.generate(prompts, SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True),
                     use_tqdm=False)
        torch.cuda.synchronize()
        return time.perf_counter() - t0

    run(8)
    step_s = (run(steps + 1) - run(1)) / steps
    model = llm.engine.executor.runner.model
    itemsize = llm.engine.executor.dtype.itemsize
    weight_bytes = _lm_params(model) * itemsize
    cache = llm.engine.executor.runner.kv_caches[0]
    kv_per_token = model.num_layers * 2 * cache.shape[-2] * cache.shape[-1] * itemsize
    kv_bytes = batch * kv_per_token * (prompt_len + steps / 2)
    floor_s = (weight_bytes + kv_bytes) / (ceilings["copy_bandwidth_gbs"] * 1e9 / 2)
    return {"batch": batch, "prompt_len": prompt_len, "step_ms": 1e3 * step_s,
            "floor_ms": 1e3 * floor_s, "ratio_to_floor": step_s / floor_s,
            "graph_steps": llm.engine.executor.runner.num_graph_steps}


def _vision_flops(vcfg, grid) -> float:
    t, h, w = grid
    n = t * h * w
    dim = getattr(vcfg, "embed_dim", None) or vcfg.hidden_size
    inter = getattr(vcfg, "intermediate_size", None)
    mlp = 3 * dim * inter if inter else 2 * dim * int(dim * vcfg.mlp_ratio)
    per_layer = 2 * n * (4 * dim * dim + mlp) + 4 * n * n * dim / t  # linears + attention
    patch = 2 * n * dim * vcfg.in_channels * vcfg.temporal_patch_size * vcfg.patch_size**2
    merge = 2 * (n // 4) * (4 * dim) * (4 * dim + vcfg.out_hidden_size
                                        if hasattr(vcfg, "out_hidden_size") else 4 * dim)
    return vcfg.depth * per_layer + patch + merge


def prefill_vision(llm, path: str, ceilings: dict, num_requests: int, sizes: list[int]) -> dict:
    """W1-like requests with one output token: achieved FLOP/s over the matmul rate."""
    from vlmserve import SamplingParams

    tok = llm.get_tokenizer()
    reqs = random_mm(tok, num_requests=num_requests, image_sizes=sizes, images_per_request=1,
                     prompt_len=50, output_len=1, seed=3)
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    llm.generate([r.prompt for r in reqs[:4]], params, use_tqdm=False)
    processed = [llm.engine.input_processor.process(r.prompt) for r in reqs]
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    llm.generate([r.prompt for r in reqs], params, use_tqdm=False)
    torch.cuda.synchronize()
    elapsed = time.perf_counter() - t0
    model = llm.engine.executor.runner.model
    cfg = llm.engine.hf_config
    tcfg = getattr(cfg, "text_config", cfg)
    lm = 2 * _lm_params(model)
    flops = 0.0
    for p in processed:
        n = len(p.prompt_token_ids)
        flops += lm * n + 2 * tcfg.num_hidden_layers * n * n * tcfg.hidden_size  # causal
        flops += sum(_vision_flops(cfg.vision_config, img.grid_thw) for img in p.images)
    rate = flops / elapsed
    return {"requests": num_requests, "elapsed_s": elapsed, "tflops": rate / 1e12,
            "fraction_of_matmul_rate": rate / (ceilings["bf16_matmul_tflops"] * 1e12)}


def add_args(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--model", default="qwen2-vl-2b-random")
    ap.add_argument("--num-requests", type=int, default=512)
    ap.add_argument("--image-sizes", default="448,672,896")
    ap.add_argument("--decode-batches", default="1,64")
    ap.add_argument("--attention-backend", default="auto")
    ap.add_argument("--enforce-eager", action="store_true")
    ap.add_argument("--compile-ops", action="store_true")
    ap.add_argument("--out", default=None)


def main(args: argparse.Namespace | None = None) -> None:
    args = parse_args(args, add_args, __doc__)
    from vlmserve import LLM
    from vlmserve.models.builtin import resolve_model

    path = str(resolve_model(args.model))
    ceilings = device_ceilings()
    print(json.dumps(ceilings))
    llm = LLM(path, dtype="bfloat16", max_num_seqs=256, max_num_batched_tokens=8192,
              attention_backend=args.attention_backend, enforce_eager=args.enforce_eager,
              compile_ops=args.compile_ops)
    results = {"ceilings": ceilings, "decode": [], "prefill_vision": None}
    for b in [int(x) for x in args.decode_batches.split(",")]:
        results["decode"].append(decode_step(llm, 512, ceilings, batch=b))
        print(json.dumps(results["decode"][-1]))
    results["prefill_vision"] = prefill_vision(
        llm, path, ceilings, args.num_requests, [int(s) for s in args.image_sizes.split(",")])
    print(json.dumps(results["prefill_vision"]))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
