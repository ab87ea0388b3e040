"""The offline benchmarks run end to end on the tiny model (CPU) and write their results."""

from __future__ import annotations

import argparse
import json

import pytest

from vlmserve.entrypoints.cli import main


def test_bench_throughput_both_backends(vlmserve_cache, tmp_path, capsys):
    out = tmp_path / "tp.json"
    main(["bench", "throughput", "--model", "tiny-qwen2-vl", "--num-requests", "6",
          "--image-sizes", "56,84", "--prompt-len", "8", "--output-len", "4",
          "--backend", "both", "--hf-batch-size", "4", "--repeats", "2", "--host-profile",
          "--out", str(out)])
    ours, hf = json.loads(out.read_text())["results"]
    # on screen: a table to read and the speed-up, no JSON (that is in --out)
    screen = capsys.readouterr().out.splitlines()
    head = next(i for i, line in enumerate(screen) if line.split()[:2] == ["backend", "requests"])
    assert "output tok/s" in screen[head] and set(screen[head + 1]) <= {"-", " "}
    assert screen[head + 2].split()[:2] == ["vlmserve", "6"]
    assert screen[head + 3].split()[:2] == ["hf", "6"]
    assert f"{ours['output_tokens_per_s']:.0f}" in screen[head + 2].split()
    speedup = f"speed-up vs transformers: {ours['speedup_vs_hf_output_tokens']:.2f}x"
    assert any(line.startswith(speedup) for line in screen)
    assert any("median" in line for line in screen) and str(out) in screen[-1]
    assert not any(line.lstrip().startswith("{") for line in screen)
    assert ours["backend"] == "vlmserve" and hf["backend"] == "hf"
    assert ours["total_output_tokens"] == hf["total_output_tokens"] == 24
    assert ours["speedup_vs_hf_output_tokens"] > 0
    steps = ours["step_times"]  # the timed pass only, not the warm-up before it
    assert steps["prefill"]["steps"] >= 1 and steps["decode_only"]["steps"] >= 3
    assert len(ours["passes_elapsed_s"]) == 2 and ours["passes_elapsed_s"][0] == ours["elapsed_s"]
    for p in ours["passes"]:  # every pass accounted alike: its steps, no more
        st = p["step_times"]
        assert st["prefill"]["steps"] + st["decode_only"]["steps"] == p["engine_steps"]
        assert 0 <= st["outside_steps_s"] < p["elapsed_s"]
    assert ours["median_output_tokens_per_s"] > 0
    assert any("function calls" in line for line in ours["host_profile"])


def test_bench_offload_reports_both_modes(vlmserve_cache, tmp_path, capsys):
    out = tmp_path / "offload.json"
    main(["bench", "offload", "--model", "tiny-qwen2-vl", "--num-requests", "4",
          "--images-per-request", "2", "--image-size", "112", "--max-num-batched-tokens", "32",
          "--output-len", "4", "--out", str(out)])
    data = json.loads(out.read_text())
    screen = capsys.readouterr().out.splitlines()
    head = next(i for i, line in enumerate(screen) if line.split()[:1] == ["offload"])
    assert [screen[head + 2].split()[0], screen[head + 3].split()[0]] == ["off", "on"]
    assert screen[head + 4] == (f"throughput on vs off: "
                                f"{data['summary']['throughput_ratio_on_vs_off']:.2f}x; greedy "
                                "outputs identical")
    off, on = data["results"]
    assert data["summary"]["greedy_outputs_identical"]
    assert not off["offload"] and on["offload"]
    assert on["prefetch_hit_rows"] > 0 and on["embedding_host_mib_at_end"] > 0


@pytest.mark.parametrize("model", ["tiny-qwen2-vl", "tiny-qwen2.5-vl"])  # tied, untied
def test_kernels_bench_counts_the_weights_a_decode_step_reads(vlmserve_cache, model):
    """The decode floor and prefill FLOPs count layers + lm_head, never the embedding table
    (read one row per token) unless it is lm_head itself."""
    from vlmserve import LLM
    from vlmserve.benchmarks.kernels import lm_weights

    m = LLM(model, dtype="float32", device="cpu").engine.executor.runner.model
    lm = m.language_model
    body = sum(p.numel() for layer in lm.layers for p in layer.parameters())
    assert lm_weights(m) == (body + lm.norm.weight.numel(), m.lm_head.weight.numel())
    assert m.tie_word_embeddings == (model == "tiny-qwen2-vl")


def test_kernels_bench_counts_a_tokens_experts_only(vlmserve_cache):
    """Qwen3-VL-MoE (8 experts, 2 a token, two sparse layers): a token's FLOPs count 2 of
    each sparse layer's 8 experts; a decode step's floor the experts its batch is expected
    to pick (uniform routing), all of them for a large batch, none for no token."""
    from vlmserve import LLM
    from vlmserve.benchmarks.kernels import idle_experts

    m = LLM("tiny-qwen3-vl-moe", dtype="float32", device="cpu").engine.executor.runner.model
    experts = sum(p.numel() for layer in m.language_model.layers if hasattr(layer.mlp, "experts")
                  for p in layer.mlp.experts.parameters())
    assert experts == 2 * 8 * 3 * 64 * 48
    assert idle_experts(m, 1) == pytest.approx(experts * 6 / 8)
    assert idle_experts(m, 0) == experts and idle_experts(m, 1000) < 1e-6 * experts
    assert idle_experts(m, 1, nbytes=True) == pytest.approx(4 * experts * 6 / 8)  # float32


def test_bench_serve_prints_a_table_to_read() -> None:
    from vlmserve.benchmarks.serve import summary_table

    run = dict(request_rate=float("inf"), concurrency=16, completed=9, failed=1,
               requests_per_s=13.1, output_tokens_per_s=1677.2, goodput_requests_per_s=12.0,
               mean_ttft_ms=631.6, p99_ttft_ms=1010.6, mean_tpot_ms=3.21, p99_tpot_ms=5.3,
               median_itl_ms=2.9, p99_itl_ms=65.6, client_loop_lag_p99_ms=1.2)
    lines = summary_table([run, {**run, "request_rate": 8.0, "concurrency": 1000}]).splitlines()
    assert len(lines) == 4 and "TTFT mean" in lines[0] and set(lines[1]) <= {"-", " "}
    assert lines[2].split()[:3] == ["inf/s", "@", "16"] and "632" in lines[2]
    assert lines[3].split()[:3] == ["8/s", "@", "1000"]
    assert len({len(ln) for ln in lines}) == 1  # aligned columns


def test_bench_serve_runs_draw_requests_of_their_own() -> None:
    """Each run of `bench serve` sends requests of its own (a replay would find them in the
    server's prefix and image caches), the same ones for every server benchmarked;
    `--reuse-requests` replays the first run's."""
    from vlmserve.benchmarks.serve import add_args, run_messages

    ap = argparse.ArgumentParser()
    add_args(ap)
    args = ap.parse_args(["--num-requests", "3", "--image-sizes", "28"])
    first, second, third = (run_messages(args, i) for i in range(3))
    assert first != second != third != first
    assert run_messages(args, 1) == second  # deterministic: every server gets these
    replay = ap.parse_args(["--num-requests", "3", "--image-sizes", "28", "--reuse-requests"])
    assert run_messages(replay, 2) == run_messages(replay, 0) == first


def test_bench_serve_extra_body_goes_into_every_request() -> None:
    """`--extra-body JSON` (e.g. a response_format, to measure structured outputs served)
    is merged into each request's body."""
    import json

    from vlmserve.benchmarks.client import chat_body
    from vlmserve.benchmarks.serve import add_args

    ap = argparse.ArgumentParser()
    add_args(ap)
    args = ap.parse_args(["--extra-body", '{"response_format": {"type": "json_object"}}'])
    body = json.loads(chat_body("m", [{"role": "user", "content": "hi"}], 8, args.extra_body))
    assert body["response_format"] == {"type": "json_object"} and body["max_tokens"] == 8
    assert "response_format" not in json.loads(chat_body("m", [], 8))
