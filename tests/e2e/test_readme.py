"""Every code block of the README and the docs pages (`docs/*.md`), run as written (ports and
file names aside), so they stay true: the Python blocks run, the openai client and curl
against a live server (one for both), the quick start's demo; command lines that need a GPU
or several hosts are parsed by our parser (and torchrun's). `text` blocks are diagrams.
A block no test knows how to run fails `test_every_block_is_run_or_parsed`."""

from __future__ import annotations

import ast
import dataclasses
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
from vlmserve.config import EngineConfig
from vlmserve.entrypoints.args import ServerConfig
from vlmserve.entrypoints.cli import make_parser
from vlmserve.flags import GROUPS

ROOT = Path(__file__).resolve().parents[2]
README_PATH = ROOT / "README.md"
README = README_PATH.read_text()
PAGES = {p: p.read_text() for p in [README_PATH, *sorted((ROOT / "docs").glob("*.md"))]}
# commands of GPU tools that a block may show but a CPU test cannot run
GPU_TOOLS = ("nvidia-cuda-mps-control", "echo quit | nvidia-cuda-mps-control")
# a Ray cluster's commands (docs/ray.md): `serve run` / `serve deploy` lines are built below
RAY = ('pip install "vlmserve[serve,ray]"', "ray start ", "serve run ", "serve deploy ")


def blocks(lang: str, text: str | None = None) -> list[str]:
    """The ``lang`` blocks of ``text`` (default: the README and every docs page)."""
    texts = [text] if text is not None else list(PAGES.values())
    return [b for t in texts for b in re.findall(rf"```{lang}\n(.*?)```", t, flags=re.S)]


def command_lines(block: str) -> list[str]:
    """A bash block's commands: continuation lines joined, comments and blanks left out."""
    lines = re.sub(r"\\\n\s*", " ", block).splitlines()
    return [c for c in (line.split(" #", 1)[0].strip() for line in lines)
            if c and not c.startswith("#")]


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
    """`vlmserve serve` with its defaults (on the CPU), for the docs' client examples."""
    srv = ServeProc()
    yield srv
    srv.kill()


def _curl_block() -> str:
    (block,) = [b for b in blocks("bash") if "cat > body.json <<EOF" in b]
    return block


def _quick_start() -> list[str]:
    return blocks("bash", README)[:2]


def _python_blocks() -> list[str]:
    return [b for b in blocks("python") if "from openai import OpenAI" not in b]


def test_every_block_is_run_or_parsed() -> None:
    """Each block is a diagram (`text`), Python (run below), the quick start, the curl block
    (run against a server), or command lines each parsed below."""
    known = {"text", "python", "bash"}
    for page, text in PAGES.items():
        for lang, _ in re.findall(r"```(\w*)\n(.*?)```", text, flags=re.S):
            assert lang in known, f"{page.name}: a ```{lang} block no test runs"
    for block in blocks("bash"):
        if block in _quick_start() or block == _curl_block():
            continue
        for line in command_lines(block):
            assert line.startswith(("vlmserve ", "python -m vlmserve", "torchrun ",
                                     "python -m vlmserve.benchmarks", *GPU_TOOLS, *RAY)), line
    assert len(_python_blocks()) >= 3


def test_python_blocks_run(vlmserve_cache, tmp_path: Path) -> None:
    photo(tmp_path, "photo.jpg")
    # a 32-frame 448x448 file: one encoder item of 4,096 rows, 16 times the example's step
    (tmp_path / "clip.mp4").write_bytes(make_smooth_mp4(32, 448, 448))
    for code in _python_blocks():
        if "llm.chat" in code and "clip.mp4" in code:  # offline.md's tour of the API
            out = run_python(code + "\nprint('OUTS', len(outs), "
                             "len(outs[0].outputs[0].token_ids))", tmp_path)
            assert "OUTS 1 32" in out
            # the logprobs example prints the first token's {token id: logprob}: the top 3
            # (greedy: the sampled token among them)
            (lps,) = [ast.literal_eval(line) for line in out.splitlines()
                      if line.startswith("{")]
            assert len(lps) == 3 and all(isinstance(t, int) and lp <= 0
                                         for t, lp in lps.items())
            assert list(lps.values()) == sorted(lps.values(), reverse=True)
        elif "SamplingParams(n=2" in code:  # two completions, each with its logprob sum
            out = run_python(code, tmp_path).splitlines()
            assert [line.split()[0] for line in out] == ["0", "1"]
            assert all(float(line.split()[-1]) < 0 for line in out)
        else:
            run_python(code, tmp_path)


def test_cpu_requirements_use_the_cpu_wheel_index() -> None:
    """PyPI's Linux torch wheel is the CUDA build: the CPU one comes from PyTorch's index."""
    lines = (ROOT / "requirements-cpu.txt").read_text().splitlines()
    assert "--extra-index-url https://download.pytorch.org/whl/cpu" in lines
    assert "torch==2.13.0" in lines
    ci = (ROOT / ".ci" / "run").read_text()
    for command in (*_quick_start(), ci):
        assert "pip install -r requirements-cpu.txt" in command.replace(" -q", "").replace(
            " --retries 0", "")


def test_openai_client_example(server: ServeProc, tmp_path: Path) -> None:
    (code,) = [b for b in blocks("python") if "from openai import OpenAI" in b]
    photo(tmp_path, "photo.png")
    out = run_python(code.replace("localhost:8000", f"127.0.0.1:{server.port}"), tmp_path)
    assert "completion_tokens=64" in out


def test_curl_example_with_a_512px_photo(server: ServeProc, tmp_path: Path) -> None:
    """The curl example, as written (the port aside), against a live server; its first line
    starts that server (parsed here: the fixture runs it)."""
    block = _curl_block()
    serve_line, *_ = command_lines(block)
    assert make_parser().parse_args(shlex.split(serve_line)[1:]).command == "serve"
    script = block[block.index("cat > body.json"):]
    rng = np.random.default_rng(0)
    Image.fromarray(rng.integers(0, 256, (512, 512, 3), dtype=np.uint8)).save(
        tmp_path / "photo.png")
    script = script.replace("localhost:8000", f"127.0.0.1:{server.port}")
    r = subprocess.run(["bash", "-c", script], cwd=tmp_path, capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, r.stderr
    body = json.loads(r.stdout)
    assert body["object"] == "chat.completion", body
    assert body["usage"]["completion_tokens"] >= 1 and body["usage"]["prompt_tokens"] > 100


def test_demo_of_the_quick_start_runs(vlmserve_cache) -> None:
    quick = _quick_start()[0]
    assert "python -m vlmserve.examples.demo" in quick
    r = subprocess.run([sys.executable, "-m", "vlmserve.examples.demo"], capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 0 and r.stdout.strip(), r.stderr[-3000:]


def test_test_command_of_the_quick_start_is_the_ci_command() -> None:
    quick = _quick_start()[1]
    ci = (ROOT / ".ci" / "run").read_text()
    assert quick.split("&& pytest", 1)[1].strip() in ci
    assert "mkdocs build --strict" in ci and ci.index("mkdocs build") < ci.index("pytest")


def test_vlmserve_command_lines_parse() -> None:
    """Every `vlmserve` command line of every block (GPU benchmarks, EPD, the README's
    serve line) parses: an unknown flag exits 2."""
    parser = make_parser()
    lines = [line for b in blocks("bash") if b not in _quick_start() and b != _curl_block()
             for line in command_lines(b) if line.startswith(("vlmserve ", "python -m "))]
    assert any(" bench throughput " in line for line in lines)
    assert any("--role encoder" in line for line in lines)
    for line in lines:
        words = shlex.split(line)
        args = words[3:] if words[0] == "python" else words[1:]
        if words[0] == "python" and words[2] != "vlmserve":  # a benchmark module of its own
            continue
        parser.parse_args(args)


def test_ray_serve_lines_build_the_application() -> None:
    """Each `serve run` / `serve deploy` line builds vlmserve's Ray application from its
    arguments (`key=value` after the import path, or a config file's `args`), as Serve would."""
    pytest.importorskip("ray.serve")
    import yaml

    from vlmserve.entrypoints.ray.app import build_app

    lines = [shlex.split(line) for b in blocks("bash") for line in command_lines(b)
             if line.startswith(("serve run ", "serve deploy "))]
    assert len(lines) >= 3
    for words in lines:
        target, args = words[2], words[3:]
        if target.endswith(".yaml"):
            (app,) = yaml.safe_load((ROOT / target).read_text())["applications"]
            target, kwargs = app["import_path"], app["args"]
        else:
            kwargs = dict(a.split("=", 1) for a in args)
        assert target == "vlmserve.entrypoints.ray.app:build_app"
        build_app(kwargs)


def test_torchrun_command_lines_parse() -> None:
    """The two-host commands: torchrun's part by torchrun's parser, vlmserve's by ours, and
    the tensor-parallel size is the number of ranks."""
    from torch.distributed.run import get_args_parser

    lines = [line for b in blocks("bash") for line in command_lines(b)
             if line.startswith("torchrun ")]
    assert len(lines) == 2
    for node, line in enumerate(lines):
        run = get_args_parser().parse_args(shlex.split(line)[1:])
        assert run.module and run.training_script == "vlmserve" and run.node_rank == node
        args = make_parser().parse_args(run.training_script_args)
        assert args.tensor_parallel_size == int(run.nnodes) * int(run.nproc_per_node)


def test_serving_page_lists_every_option_in_its_group() -> None:
    """docs/serving.md's "Options by group" is the code's grouping (`flags.GROUPS`, each
    field's metadata), flag for flag."""
    fields = [*EngineConfig.option_fields(), *dataclasses.fields(ServerConfig)]
    expected = [f"- {title[0].upper() + title[1:]}: " + ", ".join(
        f"`--{f.name.replace('_', '-')}`" for f in fields if f.metadata["group"] == key) + "."
        for key, title in GROUPS.items()]
    text = (ROOT / "docs" / "serving.md").read_text()
    section = text[text.index("## Options by group"):]
    listed = [line for line in section.splitlines() if line.startswith("- ")]
    assert listed == expected


def test_readme_is_short_and_links_into_the_docs() -> None:
    assert len(README.splitlines()) <= 150
    for link in re.findall(r"\]\((docs/[^)#]+)", README):
        assert (ROOT / link).is_file(), link
    assert not (ROOT / "docs" / "results").exists()
