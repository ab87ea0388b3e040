"""Shared fixtures: the built-in tiny checkpoints, created once per session in a temp cache;
Triton's interpreter switched on where there is no GPU; torchvision made importable where its
build's C++ ops cannot load (tests/site/sitecustomize.py)."""

from __future__ import annotations

import os
import runpy
from collections.abc import Iterator
from pathlib import Path

# torchvision's missing C++ ops declared where its build cannot load them (tests/site): in this
# process, and in every process the tests start (PYTHONPATH)
_SITE = Path(__file__).parent / "site"
runpy.run_path(str(_SITE / "sitecustomize.py"))
os.environ["PYTHONPATH"] = os.pathsep.join(
    p for p in (str(_SITE), os.environ.get("PYTHONPATH")) if p)

import pytest  # noqa: E402
import torch  # noqa: E402

# Without a GPU the Triton kernels run (tests/gpu) through Triton's interpreter: `triton.jit`
# reads this when a kernel is defined, so it is set before any vlmserve module is imported.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# Under pytest-xdist (`-n N`, CI's command) each worker is one of N processes sharing the cores:
# one torch thread each, or their thread pools oversubscribe the machine.
if os.environ.get("PYTEST_XDIST_WORKER") and "OMP_NUM_THREADS" not in os.environ:
    torch.set_num_threads(1)

from tests.procs import pytest_fixture_setup, pytest_runtest_call  # noqa: E402, F401
from vlmserve.models.builtin import resolve_model  # noqa: E402


@pytest.fixture(scope="session")
def vlmserve_cache(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """A fresh ``$VLMSERVE_CACHE`` for the whole session (restored afterwards)."""
    root = tmp_path_factory.mktemp("vlmserve_cache")
    old = os.environ.get("VLMSERVE_CACHE")
    os.environ["VLMSERVE_CACHE"] = str(root)
    yield root
    if old is None:
        os.environ.pop("VLMSERVE_CACHE", None)
    else:
        os.environ["VLMSERVE_CACHE"] = old


@pytest.fixture(scope="session")
def tiny_qwen2_vl_path(vlmserve_cache: Path) -> Path:
    """Checkpoint folder of the built-in ``tiny-qwen2-vl``."""
    return resolve_model("tiny-qwen2-vl")


@pytest.fixture(scope="session")
def tiny_qwen25_vl_path(vlmserve_cache: Path) -> Path:
    """Checkpoint folder of the built-in ``tiny-qwen2.5-vl``."""
    return resolve_model("tiny-qwen2.5-vl")


@pytest.fixture(scope="session")
def tiny_qwen3_vl_path(vlmserve_cache: Path) -> Path:
    """Checkpoint folder of the built-in ``tiny-qwen3-vl``."""
    return resolve_model("tiny-qwen3-vl")


@pytest.fixture(scope="session")
def tiny_qwen3_vl_moe_path(vlmserve_cache: Path) -> Path:
    """Checkpoint folder of the built-in ``tiny-qwen3-vl-moe``."""
    return resolve_model("tiny-qwen3-vl-moe")


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    """How many inputs the fuzz tests tried (they `record_property("fuzz_inputs", n)`), shown
    by `pytest -q` too."""
    counts = [(r.nodeid, value) for reports in terminalreporter.stats.values()
              for r in reports if getattr(r, "when", None) == "call"
              for name, value in r.user_properties if name == "fuzz_inputs"]
    if counts:
        total = sum(n for _, n in counts)
        terminalreporter.write_sep("-", f"fuzz: {total} inputs tried")
        for nodeid, n in counts:
            terminalreporter.write_line(f"{n:7d}  {nodeid}")


# the folders and files whose tests start servers, engine-core processes, process groups or
# tensor-parallel ranks: `slow` (`pytest -m "not slow"`, the quick subset, leaves them out)
_SLOW = ("e2e", "distributed", "encoder", "engine/test_async_llm.py")


def pytest_configure(config: pytest.Config) -> None:
    # xdist's `--dist loadfile` hands out files in collection order once its own reorder (by
    # number of tests, which puts the few long tests of process-starting files last) is off
    if hasattr(config.option, "loadscopereorder"):
        config.option.loadscopereorder = False


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """`slow` on the tests of the _SLOW files, and those files first (the longest work first,
    the many short files last: parallel workers end together)."""
    root = Path(__file__).parent
    for item in items:
        path = Path(str(item.fspath)).relative_to(root)
        if path.parts[0] in _SLOW or path.as_posix() in _SLOW:
            item.add_marker(pytest.mark.slow)
    items.sort(key=lambda item: item.get_closest_marker("slow") is None)  # stable
