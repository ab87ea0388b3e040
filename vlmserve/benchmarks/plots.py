"""PNG plots of benchmark results (matplotlib, headless)."""

from __future__ import annotations

from pathlib import Path


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def latency_distributions(runs: list[dict], path: str | Path) -> Path:
    """Distributions of TTFT, time per output token and inter-token latency, one row per run:
    histograms for the first two; a CDF on a log scale for the inter-token latency, whose
    mass sits near one step time with a long tail of stalls a histogram would hide."""
    plt = _plt()
    keys = [("ttfts_ms", "TTFT (ms)"), ("tpots_ms", "time per output token (ms)"),
            ("itls_ms", "inter-token latency (ms)")]
    fig, axes = plt.subplots(len(runs), 3, figsize=(13, 3.2 * len(runs)), squeeze=False)
    for row, run in zip(axes, runs):
        for ax, (key, label) in zip(row, keys):
            xs = sorted(run[key] or [0.0])
            if key == "itls_ms":
                ax.plot([max(x, 1e-3) for x in xs], [(i + 1) / len(xs) for i in range(len(xs))])
                ax.set_xscale("log")
                ax.set_ylabel("share of gaps at most x")
                ax.grid(True, which="both", alpha=0.3)
            else:
                ax.hist(xs, bins=40)
                ax.set_ylabel("requests")
            ax.set_xlabel(label)
            ax.set_title(f"concurrency {run['concurrency']}, rate {run['request_rate']:g}/s")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return Path(path)


def throughput_vs_concurrency(runs: list[dict], path: str | Path) -> Path:
    plt = _plt()
    xs = [r["concurrency"] for r in runs]
    fig, ax1 = plt.subplots(figsize=(6.5, 4))
    # a wide pale line under a thin dashed one: where they cross, both stay visible
    ax1.plot(xs, [r["output_tokens_per_s"] for r in runs], "o-", lw=4, alpha=0.5, ms=9,
             label="output tokens/s")
    ax1.set_xlabel("max concurrency")
    ax1.set_ylabel("output tokens/s")
    ax2 = ax1.twinx()
    ax2.plot(xs, [r["median_ttft_ms"] for r in runs], "s--", color="tab:red",
             label="median TTFT")
    ax2.set_ylabel("median TTFT (ms)")
    ax1.set_xscale("log", base=2)
    fig.legend(loc="upper center", ncol=2, frameon=False)  # above the axes, not on the data
    fig.tight_layout(rect=(0, 0, 1, 0.92))
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return Path(path)
