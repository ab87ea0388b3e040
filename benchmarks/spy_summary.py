"""Summarize a py-spy raw profile of the server (`SPY=SECONDS bash benchmarks/run_h200.sh
serveours` writes one): samples per process, and for the busiest process (the engine core,
or `--pid`) the frames with the most samples, inclusive and self.

    python benchmarks/spy_summary.py spy.txt [--pid PID] [--top 30]
"""

from __future__ import annotations

import argparse
import collections
import re


def read(path: str) -> list[tuple[str, list[str], int]]:
    """(process, frames outermost first, samples) per line of py-spy's raw output."""
    rows = []
    with open(path) as f:
        for line in f:
            stack, _, n = line.rstrip("\n").rpartition(" ")
            if not stack:
                continue
            frames = stack.split(";")
            procs = [i for i, fr in enumerate(frames) if fr.startswith("process ")]
            if not procs:
                continue
            rows.append((frames[procs[-1]], frames[procs[-1] + 1:], int(n)))
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("profile")
    ap.add_argument("--pid", type=int, default=None)
    ap.add_argument("--top", type=int, default=30)
    args = ap.parse_args()
    rows = read(args.profile)
    per_proc = collections.Counter()
    for proc, _, n in rows:
        per_proc[proc] += n
    print("samples per process:")
    for proc, n in per_proc.most_common():
        print(f"{n:8d}  {proc[:110]}")
    if args.pid is None:
        target = per_proc.most_common(1)[0][0]
    else:
        target = next(p for p in per_proc if re.match(rf"process {args.pid}\b", p))
    inclusive, own = collections.Counter(), collections.Counter()
    for proc, frames, n in rows:
        if proc != target or not frames:
            continue
        for fr in set(frames):
            inclusive[fr] += n
        own[frames[-1]] += n
    total = per_proc[target]
    for title, counter in (("inclusive", inclusive), ("self", own)):
        print(f"\n{title} ({target[:60]}, {total} samples):")
        for fr, n in counter.most_common(args.top):
            print(f"{n:8d} {100 * n / total:5.1f}%  {fr[:120]}")


if __name__ == "__main__":
    main()
