"""Offline throughput: our engine and (optionally) transformers `generate` on the same requests.

    python -m vlmserve.benchmarks.throughput --model qwen2-vl-2b-random --num-requests 64

Our engine takes every engine option, with the engine's defaults (batch limits sized to the
device, as `LLM(...)`); the JSON records the limits it ran with (`engine_limits`).
"""

from __future__ import annotations

import argparse
import functools
import gc
import json
import statistics
import time
from collections import defaultdict

import torch
from tqdm.auto import tqdm

from vlmserve.benchmarks import engine_options, parse_args, table, with_local_model
from vlmserve.benchmarks.datasets import BenchRequest, jsonl, random_mm
from vlmserve.flags import add_engine_options


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


class _StepTimes:
    """Wall time of each engine step call by kind: decode-only (every request one token) or
    with prefill. With async scheduling a call's time is that of the step before it on the
    device, or of the host work when that is longer."""

    def __init__(self, engine) -> None:
        self.reset()
        schedule, step = engine.scheduler.schedule, engine.step
        self._kind = "prefill"

        def traced_schedule():
            so = schedule()
            self._kind = ("decode_only" if so.total_num_scheduled_tokens
                          == len(so.num_scheduled_tokens) else "prefill")
            self._batch = len(so.num_scheduled_tokens)
            return so

        def traced_step(*args):
            t0 = time.perf_counter()
            try:
                return step(*args)
            finally:
                row = self.rows[self._kind]
                row[0] += 1
                row[1] += time.perf_counter() - t0
                row[2] += self._batch

        engine.scheduler.schedule, engine.step = traced_schedule, traced_step

    def reset(self) -> None:
        self.rows: dict[str, list[float]] = {"decode_only": [0, 0.0, 0], "prefill": [0, 0.0, 0]}

    def summary(self, elapsed: float) -> dict:
        """Per kind, and the time outside step calls (preprocessing while nothing waits)."""
        out: dict = {k: {"steps": n, "seconds": t, "mean_ms": 1e3 * t / max(n, 1),
                         "mean_requests": b / max(n, 1)} for k, (n, t, b) in self.rows.items()}
        out["outside_steps_s"] = elapsed - sum(t for _, t, _ in self.rows.values())
        return out


_ALLOC_EVENTS = ("num_device_alloc", "num_device_free", "num_alloc_retries", "num_ooms")
_HOST_EVENTS = ("num_host_alloc", "num_host_free", "host_alloc_time.total",
                "host_free_time.total")


def _alloc_counts() -> dict:
    """Counters of the device and pinned-host caching allocators (CUDA; empty elsewhere)."""
    if not torch.cuda.is_available():
        return {}
    dev, host = torch.cuda.memory_stats(), torch.cuda.host_memory_stats()
    return {**{k: dev.get(k, 0) for k in _ALLOC_EVENTS},
            **{k: host.get(k, 0) for k in _HOST_EVENTS}}


def _pass_account(llm, steps: _StepTimes, fn) -> tuple[dict, list]:
    """Runs one pass `fn()` and accounts for it: wall time, engine step times by kind, the
    device's busy / idle seconds, and, on CUDA, the caching allocator's device allocations,
    frees and retries (a retry frees every cached block and synchronizes), and the pinned
    host allocations. Returns the account and `fn`'s outputs."""
    timeline = llm.engine.executor.runner.timeline
    if timeline is not None:
        timeline.restart_idle()  # from the pass's first step
    before = llm.engine.get_stats()
    mem0 = _alloc_counts()
    steps.reset()
    _sync()
    t0 = time.perf_counter()
    out = fn()
    _sync()
    elapsed = time.perf_counter() - t0
    after = llm.engine.get_stats()
    acct = {"elapsed_s": elapsed, "engine_steps": after["num_steps"] - before["num_steps"],
            "step_times": steps.summary(elapsed)}
    if after["device_busy_s"] is not None:  # CUDA: the device's own account of the pass
        for key in ("device_busy_s", "device_idle_s"):
            acct["step_times"][key] = after[key] - before[key]
    if mem0:
        mem1 = _alloc_counts()
        acct["allocator"] = {k: mem1[k] - mem0[k] for k in mem0}
        acct["allocator"]["reserved_gib"] = torch.cuda.memory_reserved() / 2**30
    return acct, out


def run_vlmserve(reqs: list[BenchRequest], warm: list[BenchRequest], engine_kwargs: dict,
                 more_passes: list[list[BenchRequest]] = (),
                 profiled: list[BenchRequest] | None = None,
                 device_profiled: list[BenchRequest] | None = None) -> dict:
    """The timed pass over `reqs` after a warm-up pass; then, timed too, each of
    `more_passes` (requests like `reqs` with other images), for the spread of a warm
    process; then, untimed, a pass over `profiled` under cProfile (where the host's time
    goes) and one over `device_profiled` under the torch profiler (the kernels)."""
    from vlmserve import LLM, SamplingParams

    llm = LLM(**engine_kwargs)

    def generate(rs, use_tqdm=False):
        params = [SamplingParams(max_tokens=r.output_len, temperature=0.0, ignore_eos=True)
                  for r in rs]
        return functools.partial(llm.generate, [r.prompt for r in rs], params,
                                 use_tqdm=use_tqdm)

    generate(warm)()
    sc = llm.engine.config.scheduler_config  # as resolved for this device
    limits = {"max_num_seqs": sc.max_num_seqs,
              "max_num_batched_tokens": sc.max_num_batched_tokens,
              "max_num_encoder_tokens": sc.max_num_encoder_tokens}
    steps = _StepTimes(llm.engine)
    first, outs = _pass_account(llm, steps, generate(reqs, use_tqdm=True))
    result = _summary("vlmserve", reqs, [len(o.prompt_token_ids) for o in outs],
                      [len(o.outputs[0].token_ids) for o in outs], first["elapsed_s"])
    result.update({k: v for k, v in first.items() if k != "elapsed_s"})
    result["engine_limits"] = limits
    if more_passes:
        passes = [first] + [_pass_account(llm, steps, generate(more))[0]
                            for more in more_passes]
        result["passes"] = passes
        result["passes_elapsed_s"] = [p["elapsed_s"] for p in passes]
        result["median_output_tokens_per_s"] = (result["total_output_tokens"] / statistics
                                                .median(result["passes_elapsed_s"]))
    if profiled:
        from vlmserve.benchmarks.kernels import host_profile

        result["host_profile"] = host_profile(generate(profiled))
    if device_profiled:
        from vlmserve.benchmarks.kernels import kernel_table

        result["device_profile"] = kernel_table(generate(device_profiled), top=40)
    if torch.cuda.is_available():
        result["peak_gpu_memory_gib"] = torch.cuda.max_memory_allocated() / 2**30
    # the floor counts a native model's FLOPs (the transformers backend's are the same model's)
    if torch.cuda.is_available() and hasattr(llm.engine.executor.runner.model, "language_model"):
        result["compute_floor"] = compute_floor(llm, reqs, first["elapsed_s"],
                                                result["total_output_tokens"])
    llm = outs = None  # free the engine before transformers loads (the closure holds llm)
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return result


def compute_floor(llm, reqs: list[BenchRequest], elapsed: float, output_tokens: int) -> dict:
    """The workload's FLOPs (vision, prefill, every decode pass) over the bf16 matmul rate
    measured now: a lower bound on the time of any engine on this GPU, and so an upper bound
    on its output tokens/s."""
    from vlmserve.benchmarks.attention_kernels import measure_roofline
    from vlmserve.benchmarks.kernels import request_flops

    engine = llm.engine
    model = engine.executor.runner.model
    flops = sum(request_flops(model, engine.hf_config, engine.input_processor.process(r.prompt),
                              r.output_len) for r in reqs)
    rate = measure_roofline()["matmul_bf16_tflops"] * 1e12
    return {"tflop": flops / 1e12, "matmul_bf16_tflops": rate / 1e12,
            "floor_s": flops / rate, "fraction_of_matmul_rate": flops / elapsed / rate,
            "ideal_output_tokens_per_s": output_tokens * rate / flops}


def _hf_batches(reqs: list[BenchRequest], batch_size: int) -> list[list[BenchRequest]]:
    """Static batches grouped by image sizes and lengths, so that a batch needs no padding."""
    groups = defaultdict(list)
    for r in reqs:
        groups[(tuple(r.image_sizes), len(r.prompt["prompt_token_ids"]), r.output_len)].append(r)
    return [g[i:i + batch_size] for g in groups.values() for i in range(0, len(g), batch_size)]


def run_hf(reqs: list[BenchRequest], warm: list[BenchRequest], model_path: str,
           batch_size: int, dtype: torch.dtype, processor) -> dict:
    """Static batches of `batch_size`, grouped by image sizes so that a batch needs no
    padding; the HF image processor's preprocessing is timed too, as a transformers user
    pays it (the expanded token ids come from our processor beforehand, untimed).
    Warm-up: the first batch of each shape group of `warm`."""
    import transformers
    from transformers import AutoConfig, GenerationConfig

    cfg = AutoConfig.from_pretrained(model_path)
    cls = getattr(transformers, cfg.architectures[0])
    model = cls.from_pretrained(model_path, dtype=dtype).to("cuda" if torch.cuda.is_available()
                                                            else "cpu").eval()
    device = next(model.parameters()).device
    model.generation_config.eos_token_id = None  # fixed output lengths, like ignore_eos
    batches = _hf_batches(reqs, batch_size)

    def expand(r: BenchRequest) -> tuple[list[int], list[tuple[int, int]]]:
        """Prompt ids with each image placeholder expanded, and the image runs."""
        p = processor.process(None, r.prompt["prompt_token_ids"],
                              r.prompt["multi_modal_data"]["image"])
        return p.prompt_token_ids, [(img.offset, img.length) for img in p.images]

    def gen(batch, expanded):
        ids = torch.tensor([ids for ids, _ in expanded], device=device)
        mm = torch.zeros_like(ids)
        for row, (_, runs) in enumerate(expanded):
            for offset, length in runs:
                mm[row, offset:offset + length] = 1
        hf_in = processor.image_processor(  # transformers' own preprocessing, timed
            images=[im for r in batch for im in r.prompt["multi_modal_data"]["image"]],
            return_tensors="pt")
        pixels = hf_in["pixel_values"].to(device)
        grid = hf_in["image_grid_thw"].to(device)
        n = batch[0].output_len
        gcfg = GenerationConfig(max_new_tokens=n, do_sample=False, eos_token_id=None,
                                pad_token_id=0)
        with torch.inference_mode():
            out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids),
                                 pixel_values=pixels, image_grid_thw=grid,
                                 mm_token_type_ids=mm, generation_config=gcfg)
        return ids.shape[1], out.shape[1] - ids.shape[1]

    seen = set()
    for batch in _hf_batches(warm, batch_size):  # a group's batches follow each other
        key = (tuple(batch[0].image_sizes), len(batch[0].prompt["prompt_token_ids"]))
        if key not in seen:
            seen.add(key)
            gen(batch, [expand(r) for r in batch])
    expanded = [[expand(r) for r in batch] for batch in batches]
    _sync()
    t0 = time.perf_counter()
    prompt_lens, out_lens = [], []
    for batch, batch_expanded in zip(tqdm(batches, desc="HF batches"), expanded, strict=True):
        p, o = gen(batch, batch_expanded)
        prompt_lens += [p] * len(batch)
        out_lens += [o] * len(batch)
    _sync()
    elapsed = time.perf_counter() - t0
    return _summary("hf", reqs, prompt_lens, out_lens, elapsed)


def _summary(backend, reqs, prompt_lens, out_lens, elapsed) -> dict:
    n_img = sum(len(r.image_sizes) for r in reqs)
    return {
        "backend": backend, "requests": len(reqs), "elapsed_s": elapsed,
        "requests_per_s": len(reqs) / elapsed,
        "input_tokens_per_s": sum(prompt_lens) / elapsed,
        "output_tokens_per_s": sum(out_lens) / elapsed,
        "images_per_s": n_img / elapsed,
        "total_output_tokens": sum(out_lens),
    }


_COLUMNS = (("elapsed s", "elapsed_s", "{:.2f}"), ("requests/s", "requests_per_s", "{:.2f}"),
            ("input tok/s", "input_tokens_per_s", "{:.0f}"),
            ("output tok/s", "output_tokens_per_s", "{:.0f}"),
            ("images/s", "images_per_s", "{:.2f}"))


def summary(results: list[dict]) -> str:
    """The backends' results to read on screen: a table, then the speed-up vs transformers,
    the median of repeated passes and the compute floor where measured."""
    rows = [[r["backend"], str(r["requests"]), *(f.format(r[k]) for _, k, f in _COLUMNS)]
            for r in results]
    lines = [table(["backend", "requests", *(c for c, _, _ in _COLUMNS)], rows)]
    ours = results[0] if results and results[0]["backend"] == "vlmserve" else None
    if ours is not None and len(ours.get("passes_elapsed_s", ())) > 1:
        lines.append(f"vlmserve over {len(ours['passes_elapsed_s'])} passes: median "
                     f"{ours['median_output_tokens_per_s']:.0f} output tok/s")
    if ours is not None and "speedup_vs_hf_output_tokens" in ours:
        lines.append(f"speed-up vs transformers: {ours['speedup_vs_hf_output_tokens']:.2f}x "
                     "output tokens/s")
    floor = (ours or {}).get("compute_floor")
    if floor is not None:
        ideal = floor.get("ideal_speedup_vs_hf")
        lines.append(f"compute floor: {floor['floor_s']:.2f} s at {floor['matmul_bf16_tflops']:.0f}"
                     f" TFLOP/s; the run used {100 * floor['fraction_of_matmul_rate']:.1f}% of "
                     "that rate" + (f"; no engine beats {ideal:.1f}x vs transformers here"
                                    if ideal is not None else ""))
    return "\n".join(lines)


# engine options left out: --seed draws the requests (greedy: the engine's seed is unused)
_NOT_ENGINE = ("seed",)


def add_args(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--dataset", default="random-mm", help="random-mm or a .jsonl file")
    ap.add_argument("--num-requests", type=int, default=64, help="requests (random-mm)")
    ap.add_argument("--image-sizes", default="448,672,896",
                    help="square image sides in pixels, comma-separated, drawn per image")
    ap.add_argument("--images-per-request", type=int, default=1, help="images in each request")
    ap.add_argument("--prompt-len", type=int, default=50, help="text tokens of each prompt")
    ap.add_argument("--output-len", type=int, default=128,
                    help="output tokens of each request (fixed: ignore_eos)")
    ap.add_argument("--seed", type=int, default=0, help="seed of the random requests")
    ap.add_argument("--warmup", choices=["full", "short"], default="full",
                    help="untimed warm-up before each backend's run. full (random-mm): as "
                         "many requests of the same kind with other images, so that per-shape "
                         "kernel plans are built; transformers runs one batch of each shape "
                         "group of them. short, or a JSONL dataset: the first 4 requests (2 "
                         "for transformers)")
    ap.add_argument("--backend", choices=["vlmserve", "hf", "both"], default="vlmserve",
                    help="ours, transformers generate, or both (then the speed-up is shown)")
    ap.add_argument("--hf-batch-size", type=int, default=64,
                    help="requests per transformers generate call")
    ap.add_argument("--host-profile", action="store_true",
                    help="after the timed passes, one more (random-mm, new images) under "
                         "cProfile; its top functions by own time go to the JSON")
    ap.add_argument("--device-profile", action="store_true",
                    help="after the timed passes, one more over half as many requests (random-mm, "
                         "new images) under the torch profiler; its costliest kernels go to "
                         "the JSON")
    ap.add_argument("--repeats", type=int, default=1,
                    help="timed passes of ours (random-mm; each with new images); the first "
                         "is compared with transformers, all are reported with their median")
    ap.add_argument("--out", default=None,
                    help="write the full results (every counter, profiles) as JSON here")
    ap.add_argument("--preprocess-workers", type=int, default=0,
                    help="processes preprocessing the prompts ahead of the engine (the LLM's "
                         "preprocess_workers); 0: on the engine's thread")
    # the engine's own options and defaults (--model and --dtype also for transformers)
    add_engine_options(ap, skip=_NOT_ENGINE)


def main(args: argparse.Namespace | None = None) -> list[dict]:
    args = parse_args(args, add_args, __doc__)
    from vlmserve.frontend.llm_engine import LLMEngine  # noqa: F401  (fail early on bad install)
    from vlmserve.models.loader import load_hf_config
    from vlmserve.models.registry import resolve_model_class

    engine = with_local_model(engine_options(args, skip=_NOT_ENGINE))
    path = engine["model"]
    hf_config = load_hf_config(path)
    processor = resolve_model_class(hf_config).input_processor_cls(path, hf_config)
    if args.repeats < 1 or (args.repeats > 1 and args.dataset != "random-mm"):
        raise SystemExit("--repeats must be >= 1, and above 1 only with random-mm (new images "
                         "per pass, so that the encoder cache serves none of them)")

    def like_reqs(seed: int) -> list[BenchRequest]:
        return random_mm(processor.tokenizer, num_requests=args.num_requests,
                         image_sizes=[int(s) for s in args.image_sizes.split(",")],
                         images_per_request=args.images_per_request,
                         prompt_len=args.prompt_len, output_len=args.output_len, seed=seed)

    synthetic = args.dataset == "random-mm"
    reqs = like_reqs(args.seed) if synthetic else jsonl(args.dataset, args.output_len)
    warm = reqs[:4]  # a JSONL file's own images would then be in the encoder cache
    if args.warmup == "full" and synthetic:
        warm = like_reqs(args.seed + 1)
    more = [like_reqs(args.seed + 2 + i) for i in range(args.repeats - 1)]
    if args.host_profile and not synthetic:
        raise SystemExit("--host-profile needs random-mm (new images for the profiled pass)")
    profiled = like_reqs(args.seed + 1000) if args.host_profile else None
    if args.device_profile and not (synthetic and torch.cuda.is_available()):
        raise SystemExit("--device-profile needs random-mm and a CUDA device")
    device_profiled = (like_reqs(args.seed + 2000)[:max(args.num_requests // 2, 1)]
                       if args.device_profile else None)
    results = []

    def report(row: dict) -> None:  # printed and saved as each backend finishes
        results.append(row)
        if len(results) == 2:
            hf = results[1]["output_tokens_per_s"]
            results[0]["speedup_vs_hf_output_tokens"] = results[0]["output_tokens_per_s"] / hf
            if "compute_floor" in results[0]:  # no engine can beat this ratio on this GPU
                results[0]["compute_floor"]["ideal_speedup_vs_hf"] = (
                    results[0]["compute_floor"]["ideal_output_tokens_per_s"] / hf)
        print(f"{row['backend']}: {row['output_tokens_per_s']:.0f} output tok/s, "
              f"{row['elapsed_s']:.2f} s", flush=True)
        if args.out:
            with open(args.out, "w") as f:
                json.dump({"args": vars(args), "results": results}, f, indent=2)

    if args.backend in ("vlmserve", "both"):
        report(run_vlmserve(reqs, warm, {**engine, "preprocess_workers": args.preprocess_workers},
                            more, profiled, device_profiled))
    if args.backend in ("hf", "both"):
        name = engine.get("dtype", "auto")
        dtype = torch.bfloat16 if torch.cuda.is_available() and name == "auto" else (
            torch.float32 if name in ("auto", "float32") else getattr(torch, name))
        report(run_hf(reqs, warm if args.warmup == "full" else warm[:2], path,
                      args.hf_batch_size, dtype, processor))
    print()
    print(summary(results))
    print(f"full results as JSON: {args.out}" if args.out
          else "(--out FILE writes the full results as JSON)")
    return results


if __name__ == "__main__":
    main()
