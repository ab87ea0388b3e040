"""The model against the hardware (CUDA): engine decode step time vs the memory-bandwidth floor
(weight + KV bytes over the measured copy bandwidth), one-token projections (our GEMV vs
cuBLAS, weights cold), prefill chunk, vision-tower batch and the
W1 prefill + vision workload vs the measured bf16 matrix rate.

    vlmserve bench kernels --model qwen2-vl-2b-random [--profile]
    python -m vlmserve.benchmarks.kernels --model qwen2-vl-2b-random
"""

from __future__ import annotations

import argparse
import json
import time

import torch
from tqdm.auto import tqdm

from vlmserve.benchmarks import engine_options, parse_args, with_local_model
from vlmserve.benchmarks.attention_kernels import measure_roofline
from vlmserve.benchmarks.datasets import random_mm
from vlmserve.flags import add_engine_options
from vlmserve.multimodal.inputs import pixel_values


def lm_weights(model, nbytes: bool = False) -> tuple[int, int]:
    """(parameters of the language model's layers and final norm, parameters of lm_head),
    or with `nbytes` their bytes (FP8 weights and their scales as they are held). The token
    embedding is neither: a step reads one row of it per token, unless it is tied to lm_head
    (then it counts once, as lm_head)."""
    def size(p: torch.Tensor) -> int:
        return p.numel() * (p.element_size() if nbytes else 1)

    named = dict(model.named_parameters())  # a tied weight appears once
    total = sum(size(p) for n, p in named.items() if not n.startswith("visual."))
    head = size(model.lm_head.weight)
    embed = size(model.language_model.embed_tokens.weight)
    return total - embed - (0 if model.tie_word_embeddings else head), head


def idle_experts(model, tokens: float, nbytes: bool = False) -> float:
    """Parameters (or bytes) of the sparse layers' experts that a pass over `tokens` tokens
    is expected not to touch, the routing taken as uniform: each expert of a layer of E,
    k a token, is picked by none of them with probability (1 - k / E) ** tokens. One token:
    all but its k experts (what its FLOPs leave out); a decode step of B: the experts it
    need not read."""
    from vlmserve.layers.moe import SparseMoE

    idle = 0.0
    for layer in model.modules():
        if isinstance(layer, SparseMoE):
            size = sum(p.numel() * (p.element_size() if nbytes else 1)
                       for p in layer.experts.parameters())
            idle += size * (1 - layer.top_k / layer.num_experts) ** tokens
    return idle


def decode_step(llm, prompt_len: int, ceilings: dict, batch: int = 1, steps: int = 128,
                profile: bool = False) -> dict:
    """Engine step time with `batch` text requests all decoding (steady state, timed over
    `steps` steps), against weights + KV bytes over the memory bandwidth."""
    from vlmserve import SamplingParams

    engine = llm.engine
    params = SamplingParams(max_tokens=steps + 64, temperature=0.0, ignore_eos=True)
    ids = [32 + (i * 7919) % 95 for i in range(prompt_len)]  # byte-level printable chars
    rids = [engine.add_request({"prompt_token_ids": ids}, params) for _ in range(batch)]
    reqs = [engine.scheduler.requests[r] for r in rids]
    while any(r.num_computed_tokens < r.num_prompt_tokens for r in reqs):
        engine.step()
    for _ in range(8):
        engine.step()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(steps):
        engine.step()
    torch.cuda.synchronize()
    step_s = (time.perf_counter() - t0) / steps
    host = host_profile(lambda: [engine.step() for _ in range(32)]) if profile else None
    engine.abort_request(rids)
    runner = llm.engine.executor.runner
    model = runner.model
    # every layer and lm_head (of a sparse layer, the experts the batch's tokens pick)
    weight_bytes = sum(lm_weights(model, nbytes=True)) - idle_experts(model, batch, True)
    cache = runner.kv_caches[0]  # in the KV cache's dtype (FP8: one byte a value)
    kv_per_token = (model.num_layers * 2 * cache.shape[-2] * cache.shape[-1]
                    * cache.element_size())
    kv_bytes = batch * kv_per_token * (prompt_len + steps / 2)
    # reading the weights and KV once is that many bytes of memory traffic; the copy rate
    # counts read + write traffic, so it is the rate of traffic the memory sustains
    floor_s = (weight_bytes + kv_bytes) / (ceilings["copy_gbps"] * 1e9)
    row = {"batch": batch, "prompt_len": prompt_len, "step_ms": 1e3 * step_s,
           "floor_ms": 1e3 * floor_s, "ratio_to_floor": step_s / floor_s,
           "graph_steps": runner.num_graph_steps}
    if runner.graphs is not None:  # the GPU's share of a step: the captured graph alone
        graph = runner.graphs.graphs[next(s for s in runner.graphs.sizes if s >= batch)][0]
        row["graph_replay_ms"] = _time_cuda(graph.replay)
        if profile:
            row["graph_kernels"] = kernel_table(graph.replay)
    if host:
        row["host_profile"] = host
    return row


def _graph_us(calls, reps: int = 20) -> float:
    """Microseconds per call of `calls` captured in one CUDA graph, replayed."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up (compiles) off the capture
        for call in calls:
            call()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for call in calls:
            call()
    return 1e3 * _time_cuda(graph.replay, iters=reps) / len(calls)


def projections(llm, ceilings: dict) -> list[dict]:
    """Each one-token projection shape of the language model, weights cold as in a decode
    step (one copy per layer, replayed in a CUDA graph, more bytes than the L2 holds): our
    GEMV (`ops.linear`, Triton) against cuBLAS (`F.linear`), microseconds and TB/s."""
    import torch.nn.functional as F

    from vlmserve.layers import triton_ops
    from vlmserve.layers.linear import Linear

    model = llm.engine.executor.runner.model
    shapes = {}
    for name, mod in model.language_model.named_modules():
        if isinstance(mod, Linear):
            shapes.setdefault((*mod.weight.shape, mod.bias is not None), name.split(".")[-1])
    dt, dev = model.lm_head.weight.dtype, model.lm_head.weight.device
    rows = []
    for (n, k, has_bias), name in shapes.items():
        copies = max(8, int(200e6 // (n * k * dt.itemsize)))  # > the 50 MB L2, 4x over
        ws = [torch.randn(n, k, dtype=dt, device=dev) * k**-0.5 for _ in range(copies)]
        b = torch.randn(n, dtype=dt, device=dev) if has_bias else None
        x = torch.randn(1, k, dtype=dt, device=dev)
        row = {"name": name, "out": n, "in": k, "copies": copies}
        for impl, fn in (("cublas", F.linear), ("gemv", triton_ops.linear)):
            us = _graph_us([lambda w=w, fn=fn, x=x, b=b: fn(x, w, b) for w in ws])
            row[f"{impl}_us"] = us
            row[f"{impl}_tbps"] = n * k * dt.itemsize / us / 1e6
        rows.append(row)
        del ws
    return rows


def host_profile(fn, top: int = 30) -> list[str]:
    """cProfile of `fn()`: the host functions with the most own time (a blocking device
    sync shows as a C call with a large own time)."""
    import cProfile
    import io
    import pstats

    prof = cProfile.Profile()
    prof.enable()
    fn()
    prof.disable()
    buf = io.StringIO()
    pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(top)
    return buf.getvalue().splitlines()


def _time_cuda(fn, iters: int = 50) -> float:
    """Milliseconds per call of `fn` measured with CUDA events."""
    fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters


def kernel_table(fn, top: int = 25) -> dict:
    """Kernels launched by one call of `fn`: count, total GPU time, the costliest ones."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    kernels = [e for e in prof.events() if e.device_type.name == "CUDA"]
    by_name: dict[str, list[float]] = {}
    for e in kernels:
        by_name.setdefault(e.name[:90], []).append(e.device_time)
    rows = sorted(((sum(t), len(t), n) for n, t in by_name.items()), reverse=True)[:top]
    return {"num_kernels": len(kernels), "total_us": sum(e.device_time for e in kernels),
            "top": [{"name": n, "calls": c, "total_us": round(t, 1)} for t, c, n in rows]}


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


def request_flops(model, cfg, processed, output_len: int = 1) -> float:
    """FLOPs of a request: its images' vision tower; the LM's layer linears and causal
    attention for every prompt token and lm_head for the first sampled token; then one decode
    pass (linears, lm_head, attention to its context) for each further output token."""
    tcfg = getattr(cfg, "text_config", cfg)
    n = len(processed.prompt_token_ids)
    body, head = lm_weights(model)
    body -= idle_experts(model, 1)  # a token's FLOPs: its k experts of a sparse layer
    per_key = 2 * tcfg.num_hidden_layers * tcfg.hidden_size  # QK^T and PV, per layer
    lm = 2 * body * n + 2 * head + per_key * n * n
    extra = max(output_len - 1, 0)  # decoded tokens at contexts n + 1 .. n + extra
    lm += extra * (2 * body + 2 * head) + 2 * per_key * (extra * n + extra * (extra + 1) // 2)
    return lm + sum(_vision_flops(cfg.vision_config, img.encoder_meta) for img in processed.images)


def device_idle_during(engine, fn):
    """(fn(), the device's idle seconds between the steps it ran): the gap before its first
    step (the caller preparing it) is not counted. CUDA only."""
    engine.executor.runner.timeline.restart_idle()
    before = engine.get_stats()["device_idle_s"]
    result = fn()
    return result, engine.get_stats()["device_idle_s"] - before


def _run_processed(llm, reqs) -> float:
    """Seconds for the engine to finish already-processed requests (no preprocessing)."""
    engine = llm.engine
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for r in reqs:
        engine.add_processed_request(r)
    while engine.has_unfinished_requests():
        engine.step()
    torch.cuda.synchronize()
    return time.perf_counter() - t0


def prefill_vision(llm, ceilings: dict, num_requests: int, sizes: list[int]) -> dict:
    """W1 requests with one output token: achieved FLOP/s (vision + LM) over the matmul rate,
    end to end (`LLM.generate`, preprocessing included) and engine only (preprocessed
    beforehand), with the device's idle seconds in each."""
    from vlmserve import SamplingParams

    tok = llm.get_tokenizer()
    reqs = random_mm(tok, num_requests=num_requests, image_sizes=sizes, images_per_request=1,
                     prompt_len=50, output_len=1, seed=3)
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    # steady state: the same workload once untimed, other image content, so that per-shape
    # library work (cuDNN attention plans, Triton specializations) is done before timing
    warm = random_mm(tok, num_requests=num_requests, image_sizes=sizes, images_per_request=1,
                     prompt_len=50, output_len=1, seed=2)
    llm.generate([r.prompt for r in warm], params, use_tqdm=False)
    model, cfg = llm.engine.executor.runner.model, llm.engine.hf_config
    t0 = time.perf_counter()
    processed = [llm.engine.process_request(r.prompt, params) for r in reqs]
    preprocess_s = time.perf_counter() - t0
    flops = sum(request_flops(model, cfg, p) for p in processed)
    engine_s, engine_idle = device_idle_during(llm.engine, lambda: _run_processed(llm, processed))
    # end to end, with new image content so that the encoder cache cannot serve it
    reqs = random_mm(tok, num_requests=num_requests, image_sizes=sizes, images_per_request=1,
                     prompt_len=50, output_len=1, seed=4)

    def end_to_end() -> float:
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        llm.generate([r.prompt for r in reqs], params, use_tqdm=False)
        torch.cuda.synchronize()
        return time.perf_counter() - t0

    e2e_s, e2e_idle = device_idle_during(llm.engine, end_to_end)
    peak = ceilings["matmul_bf16_tflops"] * 1e12
    return {"requests": num_requests, "tflop": flops / 1e12,
            "serial_preprocess_s": preprocess_s, "engine_s": engine_s, "end_to_end_s": e2e_s,
            "engine_device_idle_s": engine_idle, "end_to_end_device_idle_s": e2e_idle,
            "engine_tflops": flops / engine_s / 1e12,
            "engine_fraction_of_matmul_rate": flops / engine_s / peak,
            "end_to_end_fraction_of_matmul_rate": flops / e2e_s / peak}


def prefill_chunk(llm, ceilings: dict, tokens: int = 8192, profile: bool = False) -> dict:
    """One text prompt of `tokens` tokens prefilled in one chunk (max_tokens=1)."""
    from vlmserve import SamplingParams

    engine = llm.engine
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    ids = [32 + (i * 7919) % 95 for i in range(tokens)]  # byte-level ids of printable chars
    _run_processed(llm, [engine.process_request({"prompt_token_ids": ids}, params)])
    times = [_run_processed(llm, [engine.process_request({"prompt_token_ids": ids}, params)])
             for _ in range(3)]
    req = engine.process_request({"prompt_token_ids": ids}, params)
    flops = request_flops(engine.executor.runner.model, engine.hf_config, req)
    t = min(times)
    row = {"tokens": tokens, "ms": 1e3 * t, "tflops": flops / t / 1e12,
           "fraction_of_matmul_rate": flops / t / (ceilings["matmul_bf16_tflops"] * 1e12)}
    if profile:
        row["kernels"] = kernel_table(lambda: _run_processed(
            llm, [engine.process_request({"prompt_token_ids": ids}, params)]))
    return row


def vision_batch(llm, ceilings: dict, num_images: int = 16, size: int = 896,
                 profile: bool = False) -> dict:
    """The vision tower alone on `num_images` images of size x size in one forward."""
    engine = llm.engine
    req = random_mm(llm.get_tokenizer(), num_requests=1, image_sizes=[size],
                    images_per_request=num_images, prompt_len=10, output_len=1, seed=5)[0]
    images = engine.input_processor.process(req.prompt).images
    runner = engine.executor.runner
    pixels = pixel_values(images, [img.pixels.to(runner.device) for img in images],
                          runner.dtype)
    meta = [img.encoder_meta for img in images]  # Qwen2-VL's patch grids

    def encode():
        with torch.inference_mode():
            runner.model.encode_images(pixels, meta)

    ms = _time_cuda(encode, iters=5)
    flops = sum(_vision_flops(engine.hf_config.vision_config, img.encoder_meta) for img in images)
    rate = flops / (ms / 1e3)
    row = {"images": num_images, "size": size, "ms": ms, "tflops": rate / 1e12,
           "fraction_of_matmul_rate": rate / (ceilings["matmul_bf16_tflops"] * 1e12)}
    if profile:
        row["kernels"] = kernel_table(encode)
    return row


def add_args(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--num-requests", type=int, default=512,
                    help="requests of the prefill workload")
    ap.add_argument("--image-sizes", default="448,672,896",
                    help="square image sides in pixels, comma-separated, drawn per image")
    ap.add_argument("--decode-batches", default="1,64",
                    help="decode batch sizes to time, comma-separated")
    ap.add_argument("--decode-only", action="store_true", help="skip prefill and vision")
    ap.add_argument("--profile", action="store_true", 
                    help="kernel tables of decode graphs and the vision batch")
    ap.add_argument("--out", default=None, help="write the results as JSON here")
    # the engine's own options; these defaults are the workload the figures were taken with
    add_engine_options(ap, defaults={
        "model": ("qwen2-vl-2b-random", "the shapes measured: Qwen2-VL-2B's"),
        "dtype": ("bfloat16", "the ceilings it is compared with are bf16 matmul rates"),
        "max_num_seqs": (256, "the largest decode batch measured; CUDA graphs captured up to "
                         "it"),
        "max_num_batched_tokens": (8192, "the prefill chunk measured, 8,192 tokens")})


def main(args: argparse.Namespace | None = None) -> None:
    args = parse_args(args, add_args, __doc__)
    if not torch.cuda.is_available():
        raise SystemExit("kernel benchmarks need a CUDA device (they time the GPU's kernels "
                         "against its bandwidth and matmul ceilings)")
    from vlmserve import LLM

    options = with_local_model(engine_options(args))
    ceilings = measure_roofline()
    print(json.dumps(ceilings))
    llm = LLM(**options)
    results: dict = {"model": args.model, "ceilings": ceilings, "decode": []}

    def report(key, row):
        print(json.dumps({key: row}))
        if isinstance(results.get(key), list):
            results[key].append(row)
        else:
            results[key] = row
        if args.out:
            with open(args.out, "w") as f:
                json.dump(results, f, indent=2)

    sizes = [int(x) for x in args.image_sizes.split(",")]
    cases = [("projections", lambda: projections(llm, ceilings))]
    cases += [("decode", lambda b=b: decode_step(llm, 512, ceilings, batch=b,
                                                 profile=args.profile))
             for b in [int(x) for x in args.decode_batches.split(",")]]
    if not args.decode_only:
        cases += [
            ("vision_16x896", lambda: vision_batch(llm, ceilings, profile=args.profile)),
            ("prefill_8192", lambda: prefill_chunk(llm, ceilings,
                                                   min(8192, args.max_num_batched_tokens),
                                                   profile=args.profile)),
            ("prefill_vision", lambda: prefill_vision(llm, ceilings, args.num_requests, sizes)),
        ]
    for key, run in tqdm(cases, desc="Cases", unit="case"):
        report(key, run())

if __name__ == "__main__":
    main()
