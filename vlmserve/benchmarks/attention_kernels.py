"""Kernel microbenchmarks (CUDA only): our Triton attention vs the torch references.

    vlmserve bench attention [--json rows.json]

Decode cases report achieved bandwidth (bytes of K/V read / time) against the device's measured
copy bandwidth; prefill and vision cases report achieved TFLOP/s (causal FLOPs actually needed,
real head_dim) against a measured bf16 matmul rate. Times are ``triton.testing.do_bench``
medians (launch included); ``graph_us`` is the same call replayed from a CUDA graph (kernel
time only, as the engine's graphed decode sees it).
"""

from __future__ import annotations

import argparse
import json
import random
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from vlmserve.benchmarks import parse_args

Fn = Callable[[], object]


@dataclass
class Case:
    """One benchmark shape: two callables computing the same thing, and the work it does."""

    name: str
    kind: str  # "decode" (bandwidth-bound) | "prefill" | "vision" (compute-bound)
    ours: Fn
    ref: Fn
    bytes: float = 0.0  # K/V bytes read (decode)
    flops: float = 0.0  # attention FLOPs (prefill / vision)
    info: dict = field(default_factory=dict)


def measure_roofline(device: torch.device | None = None) -> dict:
    """Measured device copy bandwidth (read + write bytes) and bf16 matmul rate."""
    from triton.testing import do_bench

    device = device or torch.device("cuda")
    src = torch.empty(1 << 30, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    copy_ms = do_bench(lambda: dst.copy_(src), return_mode="median")
    n = 8192
    a = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    mm_ms = do_bench(lambda: torch.matmul(a, b), return_mode="median")
    return {
        "device": torch.cuda.get_device_name(device),
        "copy_gbps": 2 * (1 << 30) / copy_ms / 1e6,
        "matmul_bf16_tflops": 2 * n**3 / mm_ms / 1e9,
    }


def paged_case(
    name: str,
    query_lens: list[int],
    seq_lens: list[int],
    heads: int,
    kv_heads: int,
    head_dim: int,
    block_size: int = 16,
    dtype: torch.dtype = torch.bfloat16,
    seed: int = 0,
    device: str = "cuda",
) -> Case:
    """A paged-attention step over a randomly scattered KV cache."""
    from vlmserve.layers.attention import build_attention_metadata, paged_attention_reference
    from vlmserve.layers.triton_attention import default_num_splits, paged_attention_triton

    counts = [-(-s // block_size) for s in seq_lens]
    perm = torch.randperm(sum(counts), generator=torch.Generator().manual_seed(seed)).tolist()
    block_ids, used = [], 0
    for n in counts:
        block_ids.append(perm[used : used + n])
        used += n
    meta = build_attention_metadata(query_lens, seq_lens, block_ids, block_size, device)
    kv = torch.randn(2, sum(counts), block_size, kv_heads, head_dim, device=device, dtype=dtype)
    q = torch.randn(sum(query_lens), heads, head_dim, device=device, dtype=dtype)
    scale = head_dim**-0.5
    kv_bytes = 2 * sum(seq_lens) * kv_heads * head_dim * kv.element_size()
    # Causal score count: query j of a chunk of q tokens ending at s sees s - q + j + 1 keys.
    scores = sum(q_len * (s - q_len) + q_len * (q_len + 1) // 2
                 for q_len, s in zip(query_lens, seq_lens))
    decode = max(query_lens) == 1
    info = {"batch": len(query_lens), "tokens": sum(query_lens), "max_ctx": max(seq_lens),
            "heads": heads, "kv_heads": kv_heads, "head_dim": head_dim}
    if decode:
        info["splits"] = default_num_splits(
            len(seq_lens), kv_heads, max(seq_lens), torch.device(device))
    return Case(
        name, "decode" if decode else "prefill",
        ours=lambda **kw: paged_attention_triton(q, kv, meta, scale, **kw),
        ref=lambda: paged_attention_reference(q, kv, meta, scale),
        bytes=kv_bytes, flops=4.0 * scores * heads * head_dim, info=info,
    )


def varlen_case(
    name: str, lengths: list[int], heads: int, head_dim: int,
    dtype: torch.dtype = torch.bfloat16, device: str = "cuda",
) -> Case:
    """Packed non-causal segments (vision tower); the reference gets a prebuilt plan."""
    from vlmserve.layers.triton_attention import varlen_attention_triton
    from vlmserve.layers.vision_attention import build_varlen_plan, varlen_attention

    total = sum(lengths)
    cu = torch.tensor([0] + lengths).cumsum(0).to(torch.int32)
    plan = build_varlen_plan(cu, device=device)
    cu_dev = cu.to(device)
    q, k, v = (torch.randn(total, heads, head_dim, device=device, dtype=dtype) for _ in range(3))
    max_len = max(lengths)
    return Case(
        name, "vision",
        ours=lambda: varlen_attention_triton(q, k, v, cu_dev, max_len),
        ref=lambda: varlen_attention(q, k, v, cu_dev, max_len, plan=plan),
        flops=4.0 * sum(n * n for n in lengths) * heads * head_dim,
        info={"segments": len(lengths), "tokens": total, "heads": heads, "head_dim": head_dim},
    )


def attention_cases() -> list[Callable[[], Case]]:
    """Representative shapes (built lazily, one at a time, to bound memory)."""
    rng = random.Random(0)
    cases: list[Callable[[], Case]] = []
    qwen2vl_2b = (12, 2, 128)  # heads, kv_heads, head_dim
    for batch in (1, 64):
        for ctx in (1024, 4096, 8192):
            cases.append(lambda b=batch, c=ctx: paged_case(
                f"2B decode B={b} ctx={c}", [1] * b, [c] * b, *qwen2vl_2b))
    mixed_ctx = [rng.randint(512, 4096) for _ in range(63)]
    cases.append(lambda: paged_case(
        "2B decode B=64 ctx~U(512,4k)", [1] * 64, mixed_ctx + [4096], *qwen2vl_2b))
    cases.append(lambda: paged_case(
        "7B decode B=64 ctx=4096", [1] * 64, [4096] * 64, 28, 4, 128))
    cases.append(lambda: paged_case(
        "2B prefill 2048 after 6k", [2048], [2048 + 6144], *qwen2vl_2b))
    cases.append(lambda: paged_case(
        "2B mixed 2048@6k + 63 dec", [2048] + [1] * 63, [8192] + mixed_ctx, *qwen2vl_2b))
    cases.append(lambda: varlen_case("vision 16 x 4096 (896px)", [4096] * 16, 16, 80))
    cases.append(lambda: varlen_case("windows 1024 x 64", [64] * 1024, 16, 80))
    # a served step's mix (W1's three sizes, 13 images in the order the encoder takes them)
    cases.append(lambda: varlen_case("vision mix 4x896+4x672+5x448",
                                     [4096] * 4 + [2304] * 4 + [1024] * 5, 16, 80))
    return cases


def run_case(case: Case, roofline: dict) -> dict:
    """Time one case; JSON-serialisable row."""
    from triton.testing import do_bench, do_bench_cudagraph

    ours_ms = do_bench(case.ours, return_mode="median")
    ref_ms = do_bench(case.ref, return_mode="median")
    row: dict = {"case": case.name, "kind": case.kind, **case.info,
                 "ours_us": ours_ms * 1e3, "ref_us": ref_ms * 1e3, "speedup": ref_ms / ours_ms}
    try:
        row["graph_us"] = do_bench_cudagraph(case.ours, return_mode="median") * 1e3
    except Exception as exc:  # reported in the row, not fatal
        row["graph_us"] = None
        row["graph_error"] = f"{type(exc).__name__}: {exc}"[:200]
    if case.kind == "decode":
        row["gbps"] = case.bytes / ours_ms / 1e6
        row["ref_gbps"] = case.bytes / ref_ms / 1e6
        row["pct_peak"] = 100 * row["gbps"] / roofline["copy_gbps"]
    else:
        row["tflops"] = case.flops / ours_ms / 1e9
        row["ref_tflops"] = case.flops / ref_ms / 1e9
        row["pct_peak"] = 100 * row["tflops"] / roofline["matmul_bf16_tflops"]
    return row


def check_case(case: Case) -> float:
    """Relative error of ours vs the reference on the benchmark inputs."""
    out, ref = case.ours(), case.ref()
    return ((out.float() - ref.float()).norm() / ref.float().norm()).item()


def bench_attention_kernels(roofline: dict | None = None) -> list[dict]:
    roofline = roofline or measure_roofline()
    rows = []
    for make in attention_cases():
        case = make()
        row = run_case(case, roofline)
        row["rel_err"] = check_case(case)
        rows.append(row)
        del case
        torch.cuda.empty_cache()
    return rows


def format_table(rows: list[dict], roofline: dict) -> str:
    lines = [
        f"{roofline['device']}: copy {roofline['copy_gbps']:.0f} GB/s, "
        f"bf16 matmul {roofline['matmul_bf16_tflops']:.0f} TFLOP/s",
        f"{'case':32} {'ours us':>9} {'graph us':>9} {'ref us':>9} {'x ref':>6} "
        f"{'achieved':>14} {'%peak':>6} {'err':>8}",
    ]
    for r in rows:
        rate = (f"{r['gbps']:.0f} GB/s" if r["kind"] == "decode"
                else f"{r['tflops']:.1f} TFLOP/s")
        graph = f"{r['graph_us']:.1f}" if r.get("graph_us") is not None else "-"
        lines.append(
            f"{r['case']:32} {r['ours_us']:9.1f} {graph:>9} {r['ref_us']:9.1f} "
            f"{r['speedup']:6.2f} {rate:>14} {r['pct_peak']:6.1f} {r.get('rel_err', 0):8.1e}")
    return "\n".join(lines)


def add_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", help="also write the rows (and roofline) to this file")


def main(args: argparse.Namespace | None = None) -> list[dict]:
    args = parse_args(args, add_args, __doc__)
    if not torch.cuda.is_available():
        raise SystemExit("kernel benchmarks need a CUDA device")
    roofline = measure_roofline()
    rows = bench_attention_kernels(roofline)
    print(format_table(rows, roofline))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"roofline": roofline, "attention": rows}, f, indent=1)
    return rows


if __name__ == "__main__":
    main()
