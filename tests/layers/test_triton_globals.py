"""Triton kernels read no plain module-level number and call no plain Python function:
compiled for a GPU they may read only globals made `tl.constexpr` and call only @triton.jit
functions (an error at the first launch otherwise), while Triton's interpreter, which the CPU
tests run, takes either. A top-p kernel's int constants once
passed every interpreter test and failed its first compile on an H100."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

LAYERS = Path(__file__).resolve().parents[2] / "vlmserve" / "layers"


def _numeric(node: ast.AST) -> bool:
    if isinstance(node, ast.Constant):
        return isinstance(node.value, (int, float))
    if isinstance(node, ast.UnaryOp):
        return _numeric(node.operand)
    if isinstance(node, ast.BinOp):
        return _numeric(node.left) and _numeric(node.right)
    return False


def _jit(fn: ast.FunctionDef) -> bool:
    return any((d.attr if isinstance(d, ast.Attribute) else getattr(d, "id", "")) == "jit"
               for d in (dec.func if isinstance(dec, ast.Call) else dec
                         for dec in fn.decorator_list))


def plain_globals_read_by_kernels(source: str) -> list[tuple[str, str]]:
    """(kernel, name) for each module-level plain number a @triton.jit function reads, and
    each module-level function it calls that is not @triton.jit itself (the interpreter
    runs either as Python; the compiler refuses both)."""
    tree = ast.parse(source)
    plain = {t.id for node in tree.body if isinstance(node, ast.Assign) and _numeric(node.value)
             for t in node.targets if isinstance(t, ast.Name)}
    plain |= {fn.name for fn in tree.body if isinstance(fn, ast.FunctionDef) and not _jit(fn)}
    return sorted({(fn.name, n.id) for fn in tree.body
                   if isinstance(fn, ast.FunctionDef) and _jit(fn)
                   for n in ast.walk(fn) if isinstance(n, ast.Name) and n.id in plain})


@pytest.mark.parametrize("path", sorted(LAYERS.glob("*.py")), ids=lambda p: p.name)
def test_kernels_read_only_constexpr_globals(path: Path) -> None:
    assert plain_globals_read_by_kernels(path.read_text()) == []


def test_the_check_finds_a_plain_global_and_a_host_function() -> None:
    source = ("import triton\nimport triton.language as tl\nLIMIT = -(2**31)\n"
              "OK = tl.constexpr(3)\n\ndef host(x):\n    return x\n\n@triton.jit\n"
              "def helper(x):\n    return x\n\n@triton.jit\n"
              "def k(x):\n    return helper(host(x)) + LIMIT + OK\n")
    assert plain_globals_read_by_kernels(source) == [("k", "LIMIT"), ("k", "host")]
