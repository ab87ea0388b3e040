"""Sweep the decode tile of the Triton paged attention (CUDA): BLOCK_N x warps x stages, and
the flash-decoding split count (including the one a decode CUDA graph captures), at the decode
shapes of the 2B and 7B models. Kernel time from a CUDA graph (as the engine's decode graphs
run it); bandwidth against the measured copy rate.

    python benchmarks/sweep_decode_attention.py [--out sweep.jsonl]
"""

import argparse
import dataclasses
import functools
import json

import torch
from triton.testing import do_bench_cudagraph

from vlmserve.benchmarks.attention_kernels import check_case, measure_roofline, paged_case
from vlmserve.layers import triton_attention as ta

SHAPES = [  # name, batch, context, heads, kv_heads
    ("2B b1 ctx512", 1, 512, 12, 2), ("2B b1 ctx4096", 1, 4096, 12, 2),
    ("2B b64 ctx512", 64, 512, 12, 2), ("2B b256 ctx512", 256, 512, 12, 2),
    ("2B b256 ctx800", 256, 800, 12, 2), ("7B b1 ctx512", 1, 512, 28, 4),
]
# (BLOCK_N, warps, stages): the engine's two decode tiles, their neighbours in warps and
# stages, and the tile used before them; a first, wider sweep (BLOCK_N 32-128, 2-8 warps,
# 2-4 stages) found its best tiles among these at the shapes it finished
TILES = [(64, 2, 2), (64, 4, 2), (64, 4, 3), (128, 2, 2), (128, 4, 2), (128, 4, 3)]
GRAPH_MAX_LEN = 32768  # a decode graph fixes its split count for the longest context


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", help="append the rows here (JSON lines)")
    args = ap.parse_args()
    roof = measure_roofline()
    for name, b, ctx, h, hkv in SHAPES:
        case = paged_case(name, [1] * b, [ctx] * b, h, hkv, 128)
        auto, ours = case.info["splits"], case.ours
        graph = ta.default_num_splits(b, hkv, GRAPH_MAX_LEN, torch.device("cuda"))
        best = None
        for bn, warps, stages in TILES:
            ta.DECODE_TILE = (bn, warps, stages)
            for splits in sorted({auto, graph, 1, 2, 4, 8} if b <= 64 else {auto}):
                variant = dataclasses.replace(case, ours=functools.partial(ours, num_splits=splits))
                try:
                    err = check_case(variant)
                    us = do_bench_cudagraph(variant.ours, return_mode="median") * 1e3
                except Exception as exc:  # a tile that does not fit in shared memory
                    print(name, bn, warps, stages, splits, "failed:", str(exc)[:80])
                    continue
                row = {"shape": name, "block_n": bn, "warps": warps, "stages": stages,
                       "splits": splits, "auto_splits": auto, "graph_splits": graph,
                       "us": us, "rel_err": err,
                       "pct_copy": 100 * case.bytes / (us * 1e-6) / (roof["copy_gbps"] * 1e9)}
                if args.out:  # as it goes: a sweep cut short keeps what it measured
                    with open(args.out, "a") as f:
                        f.write(json.dumps(row) + "\n")
                if best is None or us < best["us"]:
                    best = row
        print(json.dumps({"shape": name, "best": best}), flush=True)
        del case
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
