"""The README's examples, run as written (ports and file names aside), so they stay true:
the Python API, the openai client and curl against a live server (one for both), the demo,
and the benchmark command lines (parsed: they need a GPU to run)."""

from __future__ import annotations

import ast
import json
import re
import shlex
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from tests.e2e.test_server_procs import ServeProc
from tests.engine.helpers import make_smooth_mp4
from vlmserve.entrypoints.cli import make_parser

README_PATH = Path(__file__).resolve().parents[2] / "README.md"
README = README_PATH.read_text()


def blocks(lang: str) -> list[str]:
    return re.findall(rf"```{lang}\n(.*?)```", README, flags=re.S)


def photo(folder: Path, name: str) -> None:
    rng = np.random.default_rng(0)
    Image.fromarray(rng.integers(0, 256, (256, 320, 3), dtype=np.uint8)).save(folder / name)


def run_python(code: str, cwd: Path) -> str:
    r = subprocess.run([sys.executable, "-c", code], cwd=cwd, capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    return r.stdout


@pytest.fixture(scope="module")
def server(vlmserve_cache: Path) -> Iterator[ServeProc]:
    """`vlmserve serve` with its defaults (on the CPU), for the README's client examples."""
    srv = ServeProc()
    yield srv
    srv.kill()


def test_python_api_example(vlmserve_cache, tmp_path: Path) -> None:
    (code,) = [b for b in blocks("python") if "from vlmserve import LLM" in b]
    photo(tmp_path, "photo.jpg")
    # a 32-frame 448x448 file: one encoder item of 4,096 rows, 16 times the example's step
    (tmp_path / "clip.mp4").write_bytes(make_smooth_mp4(32, 448, 448))
    out = run_python(code + "\nprint('OUTS', len(outs), len(outs[0].outputs[0].token_ids))",
                     tmp_path)
    assert "OUTS 1 32" in out
    # the logprobs example prints the first token's {token id: logprob}: the top 3 (greedy:
    # the sampled token among them)
    (lps,) = [ast.literal_eval(line) for line in out.splitlines() if line.startswith("{")]
    assert len(lps) == 3 and all(isinstance(t, int) and lp <= 0 for t, lp in lps.items())
    assert list(lps.values()) == sorted(lps.values(), reverse=True)


def test_cpu_requirements_use_the_cpu_wheel_index() -> None:
    """PyPI's Linux torch wheel is the CUDA build: the CPU one comes from PyTorch's index."""
    lines = (README_PATH.parent / "requirements-cpu.txt").read_text().splitlines()
    assert "--extra-index-url https://download.pytorch.org/whl/cpu" in lines
    assert "torch==2.13.0" in lines
    ci = (README_PATH.parent / ".ci" / "run").read_text()
    for command in (blocks("bash")[0], blocks("bash")[1], ci):
        assert "pip install -r requirements-cpu.txt" in command.replace(" -q", "")


def test_openai_client_example(server: ServeProc, tmp_path: Path) -> None:
    (code,) = [b for b in blocks("python") if "from openai import OpenAI" in b]
    photo(tmp_path, "photo.png")
    out = run_python(code.replace("localhost:8000", f"127.0.0.1:{server.port}"), tmp_path)
    assert "completion_tokens=64" in out


def test_readme_curl_example_with_a_512px_photo(server: ServeProc, tmp_path: Path) -> None:
    """The README's curl example, as written there (the port aside), against a live server."""
    start = README.index("cat > body.json <<EOF")
    block = README[start:README.index("```", start)]
    srv = server
    rng = np.random.default_rng(0)
    Image.fromarray(rng.integers(0, 256, (512, 512, 3), dtype=np.uint8)).save(
        tmp_path / "photo.png")
    script = block.replace("localhost:8000", f"127.0.0.1:{srv.port}")
    r = subprocess.run(["bash", "-c", script], cwd=tmp_path, capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, r.stderr
    body = json.loads(r.stdout)
    assert body["object"] == "chat.completion", body
    assert body["usage"]["completion_tokens"] >= 1 and body["usage"]["prompt_tokens"] > 100


def test_demo_of_the_quick_start_runs(vlmserve_cache) -> None:
    quick = blocks("bash")[0]
    assert "python -m vlmserve.examples.demo" in quick
    r = subprocess.run([sys.executable, "-m", "vlmserve.examples.demo"], capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 0 and r.stdout.strip(), r.stderr[-3000:]


def test_test_command_of_the_quick_start_is_the_ci_command() -> None:
    quick = blocks("bash")[1]
    ci = (Path(__file__).resolve().parents[2] / ".ci" / "run").read_text()
    assert quick.split("&& pytest", 1)[1].strip() in ci


def test_benchmark_command_lines_parse() -> None:
    (block,) = [b for b in blocks("bash") if "vlmserve bench throughput" in b]
    commands = re.sub(r"\\\n\s*", " ", block).splitlines()
    parser = make_parser()
    for line in commands:
        line = line.split("#", 1)[0].strip()
        if line.startswith("vlmserve "):
            parser.parse_args(shlex.split(line)[1:])  # exits 2 on an unknown flag


def test_torchrun_command_lines_parse() -> None:
    """The two-host commands: torchrun's part by torchrun's parser, vlmserve's by ours, and
    the tensor-parallel size is the number of ranks."""
    from torch.distributed.run import get_args_parser

    (block,) = [b for b in blocks("bash") if "torchrun" in b]
    lines = [line for line in re.sub(r"\\\n\s*", " ", block).splitlines()
             if line.startswith("torchrun ")]
    assert len(lines) == 2
    for node, line in enumerate(lines):
        run = get_args_parser().parse_args(shlex.split(line)[1:])
        assert run.module and run.training_script == "vlmserve" and run.node_rank == node
        args = make_parser().parse_args(run.training_script_args)
        assert args.tensor_parallel_size == int(run.nnodes) * int(run.nproc_per_node)
