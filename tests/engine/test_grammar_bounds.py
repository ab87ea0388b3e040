"""Bounded grammar compiles: limits on what a request may ask for (bytes, nesting, choices),
refused before anything compiles and naming the option that raises them; compiles in
processes of their own, each under a deadline and a memory limit, ended when their requests
are gone, a large compile never taking the last free worker (through a server:
tests/e2e/test_server_hardening.py).

A test hook (tests/e2e/fault_injection/sitecustomize.py on the compile processes' path) makes
a grammar whose text holds `HANG` compile for ever."""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from vlmserve.config import StructuredOutputsConfig
from vlmserve.errors import InvalidSamplingParamsError
from vlmserve.sampling_params import StructuredOutputsParams as SO
from vlmserve.utils import pid_alive

pytest.importorskip("xgrammar")

from vlmserve.layers.grammar import check_grammar_limits  # noqa: E402
from vlmserve.layers.grammar_compile import (  # noqa: E402
    LARGE_GRAMMAR_BYTES,
    GrammarCompileError,
    GrammarCompiler,
)

FAULTS = str(Path(__file__).parents[1] / "e2e" / "fault_injection")
HANG = "HANGS-FOR-EVER"


def wait_for(condition: Callable[[], Any], what: str, timeout: float = 60.0) -> Any:
    """`condition()`'s first truthy value (polled; `timeout` only bounds a broken test)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(0.02)
    raise AssertionError(f"timed out waiting for {what}")


@pytest.fixture(scope="module")
def hang_hook() -> Iterator[None]:
    """Compile processes started from now on load the test hook."""
    saved = {k: os.environ.get(k) for k in ("PYTHONPATH", "VLMSERVE_GRAMMAR_HANG")}
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (FAULTS, saved["PYTHONPATH"]) if p)
    os.environ["VLMSERVE_GRAMMAR_HANG"] = HANG
    yield
    for k, v in saved.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


@pytest.fixture(scope="module")
def tokenizer(vlmserve_cache: Path):
    from transformers import AutoTokenizer

    from vlmserve.models.builtin import resolve_model

    return AutoTokenizer.from_pretrained(resolve_model("tiny-qwen2-vl"))


@pytest.fixture
def compiler_with(tokenizer) -> Iterator[Callable[..., GrammarCompiler]]:
    made: list[GrammarCompiler] = []

    def make(**options: Any) -> GrammarCompiler:
        made.append(GrammarCompiler(tokenizer, len(tokenizer), (tokenizer.eos_token_id,),
                                    StructuredOutputsConfig(**options)))
        return made[-1]

    yield make
    for c in made:
        c.shutdown()


def _nested(depth: int) -> dict:
    """A schema whose JSON nests `depth` containers deep."""
    schema: dict = {"type": "string"}
    for _ in range(depth - 1):
        schema = {"type": "array", "items": schema}
    return schema


def test_limits_refuse_a_grammar_before_it_compiles_naming_the_option() -> None:
    cfg = StructuredOutputsConfig()
    deep, fits = _nested(cfg.max_grammar_nesting + 1), _nested(cfg.max_grammar_nesting)
    props = {f"p{i}": {"type": "string"} for i in range(cfg.max_grammar_bytes // 20)}
    for so, option in [
        (SO(choice=[f"c{i}" for i in range(cfg.max_grammar_choices + 1)]),
         "--max-grammar-choices"),
        (SO(choice=["x" * 1000] * (cfg.max_grammar_bytes // 1000 + 1)), "--max-grammar-bytes"),
        (SO(regex="a" * (cfg.max_grammar_bytes + 1)), "--max-grammar-bytes"),
        (SO(grammar='root ::= "' + "a" * cfg.max_grammar_bytes + '"'), "--max-grammar-bytes"),
        (SO(json={"type": "object", "properties": props}), "--max-grammar-bytes"),
        (SO(json=json.dumps({"type": "object", "properties": props})), "--max-grammar-bytes"),
        (SO(json=deep), "--max-grammar-nesting"),
        # as text, nested past what Python's JSON reader can recurse: still a plain refusal
        (SO(json='{"a": ' * 5000 + "1" + "}" * 5000), "--max-grammar-nesting"),
        (SO(json="[" * 100_000), "--max-grammar-nesting"),
    ]:
        with pytest.raises(InvalidSamplingParamsError, match=option):
            check_grammar_limits(so, cfg)
    for so in [SO(choice=[f"c{i}" for i in range(cfg.max_grammar_choices)]), SO(json=fits),
               SO(json=json.dumps(fits)), SO(regex="a" * 1000), SO(json_object=True),
               SO(json='{"description": "[[[[[[{{{{ \\" ]]]"}')]:
        check_grammar_limits(so, cfg)


def test_a_compile_past_its_deadline_is_refused_and_the_next_one_compiles(
        hang_hook, compiler_with) -> None:
    compiler = compiler_with(grammar_compile_timeout=1.0)
    hung = compiler.start(SO(regex=HANG), "hung")
    with pytest.raises(GrammarCompileError,
                       match=r"within 1 s \(--grammar-compile-timeout\)"):
        hung.result(timeout=120)
    assert compiler.start(SO(choice=["ok"]), "next").result(timeout=120) is not None


def test_a_compile_over_its_memory_limit_is_refused(compiler_with) -> None:
    compiler = compiler_with(grammar_compile_memory_gb=0.05, max_grammar_choices=200_000,
                             max_grammar_bytes=4 << 20)
    big = compiler.start(SO(choice=[f"w{i}" for i in range(100_000)]), "big")
    with pytest.raises(GrammarCompileError, match=r"--grammar-compile-memory-gb"):
        big.result(timeout=120)
    assert compiler.start(SO(choice=["ok"]), "next").result(timeout=120) is not None


def test_a_compile_ends_once_every_request_that_asked_is_gone(
        hang_hook, compiler_with) -> None:
    compiler = compiler_with(grammar_compile_timeout=600)
    hung = compiler.start(SO(regex=HANG), "a")
    assert compiler.start(SO(regex=HANG), "b") is hung  # one compile for both
    pid = wait_for(lambda: next((p for p, rids in compiler.busy().items()
                                 if rids == ["a", "b"]), None), "the compile to run")
    compiler.forget("a")
    assert not hung.done() and pid_alive(pid)  # b still waits for it
    compiler.forget("b")
    wait_for(lambda: not pid_alive(pid), "the compile process to end")
    assert hung.cancelled() and compiler.busy() == {}
    assert compiler.start(SO(choice=["ok"]), "next").result(timeout=120) is not None


def test_large_compiles_leave_a_worker_for_small_ones(hang_hook, compiler_with) -> None:
    compiler = compiler_with(grammar_compile_timeout=600, grammar_compile_workers=2)
    large = [compiler.start(SO(regex=HANG + "x" * LARGE_GRAMMAR_BYTES + str(i)), f"large{i}")
             for i in range(2)]
    small = compiler.start(SO(choice=["ok"]), "small")
    assert small.result(timeout=120) is not None
    assert not any(f.done() for f in large)
    running = compiler.busy()
    assert len(running) == 1 and list(running.values())[0][0].startswith("large")
