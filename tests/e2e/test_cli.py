"""The `vlmserve` command: help text, option parsing, `generate`, `serve`, `bench throughput`."""

from __future__ import annotations

import dataclasses
import json
import os
import shlex
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import openai
import pytest

from tests import procs
from tests.engine.helpers import make_image
from vlmserve import LLM, SamplingParams
from vlmserve.config import EngineConfig
from vlmserve.entrypoints.args import ServerConfig, engine_kwargs
from vlmserve.entrypoints.cli import SERVE_EXAMPLES, main, make_parser
from vlmserve.flags import GROUPS

REPO = Path(__file__).resolve().parents[2]


def _env(cache: Path) -> dict[str, str]:
    return {**os.environ, "VLMSERVE_CACHE": str(cache), "PYTHONIOENCODING": "utf-8"}


def _flat(text: str) -> str:
    return "".join(text.split())  # argparse re-wraps help text


def test_console_script_help() -> None:
    exe = Path(sys.executable).with_name("vlmserve")  # installed by `pip install -e .`
    out = subprocess.run([str(exe), "--help"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    for command in ("serve", "generate", "bench"):
        assert command in out.stdout


def test_serve_help_documents_every_option(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["serve", "--help"])
    assert exit_info.value.code == 0
    text = _flat(capsys.readouterr().out)
    options = [*EngineConfig.option_fields(), *dataclasses.fields(ServerConfig)]
    for f in options:
        flag = "--" + f.name.replace("_", "-")
        assert flag in text, flag
        assert _flat(f.metadata["help"]) in text, flag
    bools = [f for f in options if f.type in ("bool", "bool | None")]
    assert bools and all("--no-" + f.name.replace("_", "-") in text for f in bools)


def test_serve_help_is_grouped_with_examples(capsys: pytest.CaptureFixture[str]) -> None:
    """`serve --help` lists every option in its section (vLLM's grouping, from each field's
    metadata), the sections in `GROUPS` order (kernels and expert options last), choices and
    defaults shown; its examples parse."""
    with pytest.raises(SystemExit):
        main(["serve", "--help"])
    text = capsys.readouterr().out
    titles = list(GROUPS.values())
    starts = [text.index("\n" + t + ":\n") for t in titles]
    assert starts == sorted(starts) and text.index("\nexamples:\n") > starts[-1]
    sections = dict(zip(GROUPS, [text[a:b] for a, b in zip(starts, [*starts[1:], len(text)])]))
    for f in [*EngineConfig.option_fields(), *dataclasses.fields(ServerConfig)]:
        assert f.metadata.get("group") in GROUPS, f.name
        flag = "\n  --" + f.name.replace("_", "-")
        assert [k for k, sec in sections.items() if flag in sec] == [f.metadata["group"]], flag
    assert "--dtype {auto,float32,bfloat16,float16,float,half}" in sections["model"]
    assert "--role {llm,encoder}" in sections["encoder"]
    assert "Port to listen on (0-65535). (default: 8000)" in " ".join(sections["frontend"].split())
    assert "--fused-ops" in sections["expert"] and "--max-num-seqs" in sections["scheduler"]
    examples = [line.strip() for line in SERVE_EXAMPLES.splitlines()
                if line.startswith("  vlmserve ")]
    assert len(examples) >= 4
    for line in examples:
        args = make_parser().parse_args(shlex.split(line)[1:])
        assert args.command == "serve"


def test_engine_options_parse_to_typed_kwargs() -> None:
    args = make_parser().parse_args([
        "serve", "some-model", "--max-num-seqs", "3", "--max-model-len", "100",
        "--no-enable-chunked-prefill", "--mm-embedding-offload", "--gpu-memory-utilization",
        "0.5", "--port", "9000", "--allow-remote-images",
        "--mm-processor-kwargs", '{"max_pixels": 3136}'])
    assert engine_kwargs(args) == {
        "max_num_seqs": 3, "max_model_len": 100, "enable_chunked_prefill": False,
        "mm_embedding_offload": True, "gpu_memory_utilization": 0.5,
        "mm_processor_kwargs": {"max_pixels": 3136}}
    config = EngineConfig.from_kwargs(model="some-model", **engine_kwargs(args))
    assert config.scheduler_config.max_num_seqs == 3 and config.model_config.max_model_len == 100
    server = ServerConfig.from_args(args)
    assert server.port == 9000 and server.allow_remote_images and server.limit_mm_per_prompt == 8
    for flags in (["--max-num-seqs", "many"], ["--mm-processor-kwargs", "{max_pixels: 1}"],
                  ["--mm-processor-kwargs", "[1]"]):
        with pytest.raises(SystemExit):
            make_parser().parse_args(["serve", *flags])


def test_generate_prints_the_answer(vlmserve_cache: Path, tmp_path: Path) -> None:
    image = tmp_path / "x.png"
    make_image(84, 56, 3).save(image)
    out = subprocess.run(
        [sys.executable, "-m", "vlmserve", "generate", "--image", str(image), "What is this?",
         "--max-tokens", "5", "--dtype", "float32", "--device", "cpu"],
        cwd=REPO, env=_env(vlmserve_cache), capture_output=True, timeout=300)
    assert out.returncode == 0, out.stderr.decode()
    llm = LLM("tiny-qwen2-vl", dtype="float32", device="cpu")
    messages = [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": str(image)}},
        {"type": "text", "text": "What is this?"}]}]
    expected = llm.chat(messages, SamplingParams(max_tokens=5, temperature=0.0),
                        use_tqdm=False)[0].outputs[0].text
    assert out.stdout.decode() == expected + "\n"


def test_serve_subprocess(vlmserve_cache: Path) -> None:
    """A server started with vLLM's flags honours them: several served names (the first
    reported), --max-logprobs and --limit-mm-per-prompt's JSON form (400s naming them),
    --uvicorn-log-level apart from --log-level, --disable-log-requests (no access log)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = procs.start(  # its process group killed with the test, however it ends
        [sys.executable, "-m", "vlmserve", "serve", "--port", str(port), "--dtype", "float32",
         "--device", "cpu", "--served-model-name", "tiny", "other", "--log-level", "warning",
         "--uvicorn-log-level", "info", "--disable-log-requests", "--max-logprobs", "2",
         "--limit-mm-per-prompt", '{"image": 1, "video": 0}', "-tp", "1",
         "--kv-cache-dtype", "auto", "--host", "127.0.0.1"],
        cwd=REPO, env=_env(vlmserve_cache), stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and proc.poll() is None:
            try:
                if httpx.get(url + "/health").status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(0.2)
        assert proc.poll() is None, proc.stdout.read().decode() if proc.stdout else ""
        client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
        assert [m.id for m in client.models.list().data] == ["tiny", "other"]
        resp = client.chat.completions.create(
            model="other", messages=[{"role": "user", "content": "Hello!"}], max_tokens=4,
            temperature=0, extra_body={"ignore_eos": True})
        assert resp.usage.completion_tokens == 4 and resp.choices[0].finish_reason == "length"
        assert resp.model == "tiny"
        with pytest.raises(openai.BadRequestError, match=r"top_logprobs=3 .*--max-logprobs"):
            client.chat.completions.create(
                model="tiny", messages=[{"role": "user", "content": "Hi"}], max_tokens=1,
                logprobs=True, top_logprobs=3)
        image = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}
        with pytest.raises(openai.BadRequestError, match="2 images .*--limit-mm-per-prompt"):
            client.chat.completions.create(
                model="tiny", messages=[{"role": "user", "content": [image, image]}],
                max_tokens=1)
    finally:
        proc.terminate()
        proc.wait(30)
    assert proc.returncode in (0, -signal.SIGTERM)  # uvicorn re-raises SIGTERM once shut down
    log = proc.stdout.read().decode() if proc.stdout else ""
    assert "Application startup complete" in log, log  # uvicorn at info, ours at warning
    assert "/v1/chat/completions" not in log, log  # no access log


def test_bench_throughput_is_wired(vlmserve_cache: Path, tmp_path: Path) -> None:
    out = tmp_path / "bench.json"
    main(["bench", "throughput", "--num-requests", "2", "--output-len", "3",
          "--image-sizes", "56", "--prompt-len", "8", "--out", str(out)])
    result = json.loads(out.read_text())
    assert result["args"]["num_requests"] == 2
    assert result["results"][0]["backend"] == "vlmserve"
    assert result["results"][0]["total_output_tokens"] == 6


@pytest.mark.parametrize("argv, words", [
    (["generate", "--model", "/nonexistent/model", "hi"], "neither an existing path"),
    (["generate", "--model", "{tmp}", "hi"], "no config.json"),
    (["generate", "--image", "/nonexistent.png", "--dtype", "float32", "hi"],
     "image file not found"),
    (["generate", "--image", "{tmp}", "--dtype", "float32", "hi"],
     "image 1 of the request: '{tmp}' is a directory"),
    (["generate", "--max-tokens", "0", "--dtype", "float32", "hi"], "max_tokens must be"),
    (["generate", "--max-tokens", "-3", "--dtype", "float32", "hi"], "max_tokens must be"),
    (["generate", "--device", "cuda", "hi"], "no CUDA GPU"),
    (["generate", "--no-enable-chunked-prefill", "--max-num-prefill-tokens-while-decoding",
      "64", "hi"], "needs chunked prefill"),
    (["generate", "--mm-processor-kwargs", '{"max_pixel": 1}', "--dtype", "float32", "hi"],
     "unknown option(s) ['max_pixel']"),
])
def test_cli_mistakes_are_one_line_and_exit_nonzero(vlmserve_cache, tmp_path, capsys, argv,
                                                    words) -> None:
    import torch

    if "cuda" in argv and torch.cuda.is_available():
        pytest.skip("a GPU is here")
    argv = [a.replace("{tmp}", str(tmp_path)) for a in argv]
    words = words.replace("{tmp}", str(tmp_path))
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    err = capsys.readouterr().err.strip()
    assert exit_.value.code == 1
    errors = [line for line in err.splitlines() if line.startswith("vlmserve: error:")]
    assert len(errors) == 1 and words in errors[0] and "Traceback" not in err
    # --debug shows the traceback instead (the exception itself)
    if "cuda" not in argv:
        with pytest.raises(Exception, match=words.split("'")[0][:12]):
            main(["--debug", *argv])


@pytest.mark.parametrize("flags, words", [
    (["--chat-template", "/nonexistent/template.jinja"], "no such file"),
    (["--chat-template", "{% for m in messages %}"], "does not parse"),
    (["--enable-auto-tool-choice"], "needs --tool-call-parser"),
    (["--tool-call-parser", "nope"], "must be one of hermes"),
    (["--reasoning-parser", "nope"], "must be one of qwen3, deepseek_r1"),
])
def test_serve_option_mistakes_exit_before_loading(flags, words, capsys) -> None:
    with pytest.raises(SystemExit) as exit_:
        main(["serve", "/nonexistent/model", *flags])
    err = capsys.readouterr().err
    assert exit_.value.code == 1 and err.startswith("vlmserve: error: ") and words in err
    assert len(err.strip().splitlines()) == 1, err


def test_copied_vllm_command_lines_parse() -> None:
    """vLLM's forms of the flags it shares with us, and its default host."""
    args = make_parser().parse_args([
        "serve", "org/model", "--limit-mm-per-prompt", '{"image":2,"video":1}',
        "--served-model-name", "a", "b", "-tp", "2", "--max-logprobs", "5",
        "--disable-log-requests", "--uvicorn-log-level", "warning", "--kv-cache-dtype", "fp8",
        "--trust-remote-code", "--tokenizer", "org/tok", "--revision", "r1",
        "--download-dir", "/tmp/hf"])
    server = ServerConfig.from_args(args)
    assert server.limit_mm_per_prompt == {"image": 2, "video": 1}
    assert (server.mm_limit("image"), server.mm_limit("video")) == (2, 1)
    assert server.served_model_names() == ("a", "b") and server.max_logprobs == 5
    assert server.disable_log_requests and server.uvicorn_log_level == "warning"
    assert server.host == "0.0.0.0"
    assert engine_kwargs(args) == {
        "tensor_parallel_size": 2, "kv_cache_dtype": "fp8", "trust_remote_code": True,
        "tokenizer": "org/tok", "revision": "r1", "download_dir": "/tmp/hf"}
    one = ServerConfig.from_args(make_parser().parse_args(
        ["serve", "--limit-mm-per-prompt", "3", "--served-model-name", "x"]))
    assert (one.limit_mm_per_prompt, one.mm_limit("video")) == (3, 3)
    assert one.served_model_names() == ("x",)


@pytest.mark.parametrize("argv, words", [
    (["serve", "--port", "abc"], "argument --port: not a port number: 'abc'"),
    (["serve", "--port", "99999"], "argument --port: a port is in 0-65535"),
    (["serve", "--dtype", "float64"], "argument --dtype: must be one of auto, float32"),
    (["generate", "--dtype", "fp16", "hi"], "argument --dtype: must be one of auto"),
    (["serve", "--attention-backend", "nope"], "argument --attention-backend: must be one of"),
    (["serve", "--kv-cache-dtype", "int8"],
     "argument --kv-cache-dtype: must be one of auto, fp8, fp8_e4m3, not 'int8'"),
    (["serve", "--limit-mm-per-prompt", "{image: 2}"], "argument --limit-mm-per-prompt: "),
    (["serve", "--max-logprobs", "21"], "argument --max-logprobs: must be in 0-20"),
    (["serve", "--no-such-flag"], "unrecognized arguments: --no-such-flag"),
    (["generate"], "the following arguments are required: prompt"),
])
def test_command_line_mistakes_are_one_line_with_a_hint(argv, words, capsys) -> None:
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and len(err.strip().splitlines()) == 1, err
    assert err.startswith(f"vlmserve: error: {words}"), err
    assert err.rstrip().endswith("--help` lists the options)"), err


@pytest.mark.parametrize("flags, words", [
    (["--device", "cuda"], "torch sees no CUDA GPU"),
    (["--max-model-len", "100000"], "max_model_len=100000 is more than the model's context "
     "length of 32768"),
])
def test_serve_engine_mistakes_exit_before_loading(vlmserve_cache, monkeypatch, capsys, flags,
                                                   words) -> None:
    import torch

    from vlmserve.entrypoints.openai import launch

    if "cuda" in flags and torch.cuda.is_available():
        pytest.skip("a GPU is here")

    def loads(*args, **kwargs):
        raise AssertionError("the model was loaded")

    monkeypatch.setattr(launch, "serve_frontend", loads)
    with pytest.raises(SystemExit) as exit_:
        main(["serve", "--port", "0", "--device", "cpu", *flags])
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if line.startswith("vlmserve: error: ")]
    assert exit_.value.code == 1 and len(errors) == 1 and words in errors[0], err
    assert "Traceback" not in err, err


def test_version_and_no_abbreviated_flags(capsys) -> None:
    from importlib.metadata import version

    with pytest.raises(SystemExit) as exit_:
        main(["--version"])
    assert exit_.value.code == 0 and capsys.readouterr().out.strip() == (
        f"vlmserve {version('vlmserve')}")
    with pytest.raises(SystemExit) as exit_:
        main(["serve", "--max-num-seq", "4"])  # a prefix of --max-num-seqs is no flag
    assert exit_.value.code == 2 and "--max-num-seq" in capsys.readouterr().err


@pytest.mark.parametrize("name", ["throughput", "serve", "kernels", "attention", "offload"])
def test_every_bench_flag_has_help_and_shows_its_default(name, capsys) -> None:
    import argparse
    import importlib

    from vlmserve.entrypoints.cli import _BENCHMARKS

    with pytest.raises(SystemExit) as exit_:
        main(["bench", name, "--help"])
    text = _flat(capsys.readouterr().out)
    assert exit_.value.code == 0
    ap = argparse.ArgumentParser()
    importlib.import_module(f"vlmserve.benchmarks.{_BENCHMARKS[name][0]}").add_args(ap)
    for action in ap._actions[1:]:  # after -h
        flag = action.option_strings[0]
        assert action.help, f"{flag} has no help"
        assert _flat(action.help.split(" (default")[0]) in text, flag
        if action.default is argparse.SUPPRESS:  # an engine option: the engine's default
            assert "default" in action.help, flag
        elif not any(action.default is v for v in (None, False)):
            assert (_flat(f"(default: {action.default})") in text  # the benchmark's own
                    or _flat(f"Default here: {action.default} (") in text), flag
    prefix = ap._actions[-1].option_strings[0][:-1]  # e.g. --ou for --out
    with pytest.raises(SystemExit) as exit_:  # no abbreviated flags in benchmarks either
        main(["bench", name, prefix, "x.json"])
    assert exit_.value.code == 2 and prefix in capsys.readouterr().err


def test_help_of_llm_lists_every_engine_option() -> None:
    import pydoc

    text = pydoc.render_doc(LLM, renderer=pydoc.plaintext)
    for f in EngineConfig.option_fields():
        assert f"{f.name} (default {f.default!r})" in text, f.name


def test_help_and_import_need_no_torch() -> None:
    """`vlmserve --help` (and `serve --help`, `generate --help`, `import vlmserve`) load
    neither torch nor transformers: they answer at once."""
    code = """
import sys
import vlmserve
from vlmserve.entrypoints.cli import main
for argv in (["--help"], ["serve", "--help"], ["generate", "--help"], ["--version"]):
    try:
        main(argv)
    except SystemExit:
        pass
print("HEAVY", sorted(m for m in ("torch", "transformers") if m in sys.modules))
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120)
    assert "HEAVY []" in out.stdout, out.stdout[-500:] + out.stderr[-2000:]
    assert "bench" in out.stdout and "--max-num-seqs" in out.stdout


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="the CPU's answer")
@pytest.mark.parametrize("name", ["kernels", "attention"])
def test_gpu_benchmarks_without_a_gpu_say_so_in_one_line(name) -> None:
    r = subprocess.run([sys.executable, "-m", "vlmserve", "bench", name], capture_output=True,
                       text=True, timeout=120)
    assert r.returncode != 0
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "need a CUDA device" in lines[0], r.stderr[-2000:]


def test_benchmarks_take_the_engine_flags_with_the_engines_defaults() -> None:
    """Each benchmark's engine flags are the engine's own options (`flags.add_engine_options`):
    unset, they keep the engine's defaults, except those a benchmark's workload fixes (shown
    in its help); a workload flag of the same name (throughput's --seed draws its requests)
    or an option the workload sets (offload's max_num_seqs) is left out."""
    import argparse
    import importlib

    from vlmserve.benchmarks import engine_options
    from vlmserve.config import EngineConfig

    def parsed(module: str, argv: list[str]) -> argparse.Namespace:
        ap = argparse.ArgumentParser()
        importlib.import_module(f"vlmserve.benchmarks.{module}").add_args(ap)
        return ap.parse_args(argv)

    every = {f.name for f in EngineConfig.option_fields()}
    for module, left_out in (("throughput", set()), ("kernels", set()),
                             ("offload", {"max_num_seqs", "mm_embedding_offload"}),
                             ("encoder_ipc", set())):
        ap = argparse.ArgumentParser()
        importlib.import_module(f"vlmserve.benchmarks.{module}").add_args(ap)
        assert every - {a.dest for a in ap._actions} == left_out, module
    assert engine_options(parsed("throughput", []), skip=("seed",)) == {"model": "tiny-qwen2-vl"}
    # --seed is the workload's (the same name as the engine's seed, which is left out)
    args = parsed("throughput", ["--seed", "5", "--max-num-seqs", "3", "--enforce-eager"])
    assert args.seed == 5 and engine_options(args, skip=("seed",)) == {
        "model": "tiny-qwen2-vl", "max_num_seqs": 3, "enforce_eager": True}
    assert engine_options(parsed("kernels", [])) == {
        "model": "qwen2-vl-2b-random", "dtype": "bfloat16", "max_num_seqs": 256,
        "max_num_batched_tokens": 8192}
    assert engine_options(parsed("offload", ["--num-kv-blocks", "40"])) == {
        "model": "tiny-qwen2-vl", "max_num_batched_tokens": 2048, "num_kv_blocks": 40}
    assert engine_options(parsed("encoder_ipc", ["--device", "cpu"])) == {
        "model": "tiny-qwen2-vl", "device": "cpu"}
