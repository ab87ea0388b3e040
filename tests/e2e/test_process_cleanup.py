"""Every process a test starts in a session of its own (servers, torchrun jobs: `tests/procs.py`)
dies with its test: Ctrl-C while a server starts, a test that fails with its server up, and an
interpreter that exits with one still registered leave nothing running. Real pytest runs and
real servers, in subprocesses."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

from tests.procs import group_alive, group_size
from tests.wait import wait_until

REPO = Path(__file__).resolve().parents[2]
CONFTEST = "from tests.procs import pytest_fixture_setup, pytest_runtest_call  # noqa: F401\n"


def _pids_with(marker: str) -> list[int]:
    """Processes whose command line holds ``marker``."""
    pids = []
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            if marker.encode() in cmdline.read_bytes():
                pids.append(int(cmdline.parent.name))
        except (FileNotFoundError, ProcessLookupError, PermissionError):
            pass
    return [p for p in pids if p != os.getpid()]


def _inner_pytest(folder: Path, test: str) -> subprocess.Popen:
    (folder / "conftest.py").write_text(CONFTEST)
    (folder / "test_inner.py").write_text(textwrap.dedent(test))
    # the repository first, the test processes' path kept (tests/site: transformers' image
    # processors import torchvision, which loads there only through its shim)
    path = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
    env = {**os.environ, "PYTHONPATH": path}
    # Ctrl-C's default action in the run, even where this test run ignores SIGINT (a job
    # started in the background by a shell without job control inherits SIG_IGN)
    return subprocess.Popen(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--rootdir",
         str(folder), str(folder / "test_inner.py")], cwd=folder, env=env,
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))


def test_ctrl_c_while_a_server_starts_leaves_nothing_running(vlmserve_cache: Path,
                                                           tmp_path: Path) -> None:
    marker = f"cleanup-{os.getpid()}-interrupted"
    run = _inner_pytest(tmp_path, f"""
        from tests.e2e.test_server_procs import ServeProc

        def test_start():
            ServeProc("--served-model-name", "{marker}", "--preprocess-workers", "1")
        """)
    try:
        # the server runs and has started a process of its own (its engine core, which then
        # loads the model: seconds before the server answers): its start is under way. (Its
        # port, bound once the core is up, came too close to the server's readiness to
        # interrupt in between.)
        def started() -> bool:
            pids = _pids_with(marker)
            return len(pids) == 1 and group_size(pids[0]) >= 2
        assert wait_until(started, 120)
        (server,) = _pids_with(marker)
        pgid = os.getpgid(server)
        assert pgid == server != os.getpgid(run.pid)  # a session of its own: Ctrl-C misses it
        run.send_signal(signal.SIGINT)  # what Ctrl-C sends the test run
        out, _ = run.communicate(timeout=60)
    finally:
        if run.poll() is None:
            run.kill()
    assert "KeyboardInterrupt" in out, out
    # SIGKILLed: each of its processes is gone once the kernel has run its exit
    assert wait_until(lambda: not group_alive(pgid), 10), (
        "the server's process group outlived the interrupted test")


def test_a_failing_test_kills_its_processes_before_the_next_test(tmp_path: Path) -> None:
    """A test body that fails with its process up: the process's group is gone when the next
    test runs (not only at exit); a fixture's process lives on until its teardown."""
    marker = f"cleanup-{os.getpid()}-failing"
    run = _inner_pytest(tmp_path, f"""
        import sys
        import pytest
        from tests import procs
        from tests.wait import wait_until

        SLEEPER = [sys.executable, "-c", "import time; time.sleep(600)", "{marker}"]
        started = []

        @pytest.fixture(scope="module")
        def kept():
            proc = procs.start(SLEEPER)
            yield proc
            procs.kill_group(proc)

        def test_fails_with_its_process_up(kept):
            started.append(procs.start(SLEEPER).pid)
            assert False, "the test fails"

        def test_next_test_finds_it_gone(kept):
            assert started and wait_until(lambda: not procs.group_alive(started[0]), 10)
            assert kept.poll() is None  # the module's fixture: still up
        """)
    out, _ = run.communicate(timeout=300)
    assert "1 failed, 1 passed" in out, out
    assert wait_until(lambda: not _pids_with(marker), 10)


def test_a_process_still_registered_at_exit_is_killed_with_its_children(
        tmp_path: Path) -> None:
    marker = f"cleanup-{os.getpid()}-atexit"
    ready = tmp_path / "ready"
    # a process in its own session that starts a child of its own, then waits
    sleeper = (f"import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', "
               f"'import time; time.sleep(600)', '{marker}']); open({str(ready)!r}, 'w'); "
               f"time.sleep(600)")
    script = textwrap.dedent(f"""
        import sys
        from tests import procs
        proc = procs.start([sys.executable, "-c", {sleeper!r}, "{marker}"])
        print(proc.pid, flush=True)
        """)
    r = subprocess.run([sys.executable, "-c", script + textwrap.dedent(f"""
        from tests.wait import wait_until
        import os
        assert wait_until(lambda: os.path.exists({str(ready)!r}), 60)
        """)], cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)}, capture_output=True,
        text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    pgid = int(r.stdout.split()[0])
    assert wait_until(lambda: not group_alive(pgid), 10)
    assert wait_until(lambda: not _pids_with(marker), 10)
