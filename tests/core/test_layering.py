"""The package layout holds: top-level packages import only the ones below them (no cycle), and
the processes that must stay light (an HTTP front end, a preprocessing process, the encoder
server's front end) load no engine-core module."""

from __future__ import annotations

import subprocess
import sys

import grimp
import pytest

# every top-level package or module of vlmserve, highest first: each may import only those after
# it (`docs/architecture.md` draws the same picture)
LAYERS = (
    "__main__", "examples", "entrypoints", "benchmarks", "llm",
    "frontend",   # front ends of an engine core: AsyncLLM, LLMEngine, preprocessing, output
    "encoder",    # the encoder service (its client too, for the front ends)
    "engine",     # the engine core and its process; the messages front ends exchange with it
    "executor", "worker",
    "inputs",     # a prompt read as the model reads it (both the engine and encoders use it)
    "models", "layers", "distributed",
    "transfer",   # embedding handles, their wire form and ledgers
    "core",       # scheduler, caches: plain Python
    "request", "multimodal", "outputs",
    "flags",      # command-line flags of option dataclasses (the CLI's and the benchmarks')
    "config", "sampling_params", "errors",
    "process",    # the skeleton of a core process (engine core, encoder core)
    "utils",
    "vlmserve",  # the package's __init__: __version__, and the public names loaded on use
)

# what a process that must stay light may not load: the device-side engine
HEAVY = ("vlmserve.worker", "vlmserve.executor", "vlmserve.core.scheduler",
         "vlmserve.worker.cuda_graphs", "vlmserve.engine.core", "vlmserve.engine.core_proc")


def _top(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else parts[0]


def test_every_top_level_package_has_a_layer() -> None:
    graph = grimp.build_graph("vlmserve")
    assert {_top(m) for m in graph.modules} == set(LAYERS)


def test_no_import_runs_back_up_the_layers() -> None:
    graph = grimp.build_graph("vlmserve")
    rank = {name: i for i, name in enumerate(LAYERS)}
    upward = []
    for module in graph.modules:
        for imported in graph.find_modules_directly_imported_by(module):
            a, b = _top(module), _top(imported)
            if a != b and rank[a] > rank[b]:
                lines = graph.get_import_details(importer=module, imported=imported)
                upward.append(f"{module} -> {imported} (line "
                              f"{lines[0]['line_number'] if lines else '?'})")
    assert not upward, "imports running up the layers:\n" + "\n".join(sorted(upward))


def test_import_graph_finds_an_upward_import(tmp_path) -> None:
    """The check above sees imports inside functions and under TYPE_CHECKING too."""
    pkg = tmp_path / "layered"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "low.py").write_text("def f():\n    from layered import high\n")
    (pkg / "high.py").write_text("from layered import low\n")
    sys.path.insert(0, str(tmp_path))
    try:
        graph = grimp.build_graph("layered", cache_dir=None)
        assert "layered.high" in graph.find_modules_directly_imported_by("layered.low")
    finally:
        sys.path.remove(str(tmp_path))


@pytest.mark.parametrize("entry", [
    "vlmserve.frontend.async_llm",           # an HTTP front end's engine client
    "vlmserve.entrypoints.openai.server",    # the HTTP app
    "vlmserve.entrypoints.openai.launch",    # `vlmserve serve`'s processes
    "vlmserve.frontend.preprocess",          # a preprocessing process
    "vlmserve.entrypoints.openai.encoder_server",  # the encoder server's front end
])
def test_light_processes_load_no_engine_core_module(entry: str) -> None:
    code = (f"import sys, {entry}\n"
            f"heavy = sorted(m for m in sys.modules if m.startswith({HEAVY!r}))\n"
            "print(' '.join(heavy))\n")
    out = subprocess.run([sys.executable, "-c", code], check=True, timeout=120,
                         capture_output=True, text=True).stdout.split()
    assert not out, f"{entry} loads {out}"
