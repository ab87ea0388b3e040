"""PNG plots of benchmark results (matplotlib, headless)."""

from __future__ import annotations

from pathlib import Path


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def latency_distributions(runs: list[dict], path: str | Path) -> Path:
    """Histograms of TTFT, time per output token and inter-token latency, one row per run."""
    plt = _plt()
    keys = [("ttfts_ms", "TTFT (ms)"), ("tpots_ms", "time per output token (ms)"),
            ("itls_ms", "inter-token latency (ms)")]
    fig, axes = plt.subplots(len(runs), 3, figsize=(13, 3.2 * len(runs)), squeeze=False)
    for row, run in zip(axes, runs):
        for ax, (key, label) in zip(row, keys):
            ax.hist(run[key] or [0], bins=40)
            ax.set_xlabel(label)
            ax.set_title(f"concurrency {run['concurrency']}, rate {run['request_rate']}")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return Path(path)


def throughput_vs_concurrency(runs: list[dict], path: str | Path) -> Path:
    plt = _plt()
    xs = [r["concurrency"] for r in runs]
    fig, ax1 = plt.subplots(figsize=(6.5, 4))
    ax1.plot(xs, [r["output_tokens_per_s"] for r in runs], "o-", label="output tokens/s")
    ax1.set_xlabel("max concurrency")
    ax1.set_ylabel("output tokens/s")
    ax2 = ax1.twinx()
    ax2.plot(xs, [r["median_ttft_ms"] for r in runs], "s--", color="tab:red",
             label="median TTFT")
    ax2.set_ylabel("median TTFT (ms)")
    ax1.set_xscale("log", base=2)
    fig.legend(loc="upper left")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return Path(path)
