"""Host time of an eager step's attention metadata (block table, slots): 181 requests, one
8,000-token prompt chunk beside 180 decodes with 300-1,400 tokens of context (CPU).

    python benchmarks/block_table_time.py [--repeats 50]
"""

from __future__ import annotations

import argparse
import random
import time

import torch

from vlmserve.layers.attention import build_attention_metadata


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=50)
    args = ap.parse_args()
    rng = random.Random(0)
    query = [8000] + [1] * 180
    seq = [8200] + [rng.randint(300, 1400) for _ in range(180)]
    blocks = [list(range(i * 100, i * 100 + -(-s // 16))) for i, s in enumerate(seq)]
    cpu = torch.device("cpu")
    for _ in range(3):
        build_attention_metadata(query, seq, blocks, 16, cpu)
    start = time.perf_counter()
    for _ in range(args.repeats):
        build_attention_metadata(query, seq, blocks, 16, cpu)
    print(f"build_attention_metadata: {1e3 * (time.perf_counter() - start) / args.repeats:.2f} "
          "ms per step")


if __name__ == "__main__":
    main()
