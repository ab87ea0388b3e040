"""Put on PYTHONPATH of a test server: with VLMSERVE_POISON_SEED set, the engine core's
sampler raises for any batch holding a request with that seed (a fault inside a step, for
the containment tests). Every process of the server runs this at start-up."""

import os
import runpy
from pathlib import Path

# this file shadows the test environment's own start-up hook: run it first
runpy.run_path(str(Path(__file__).parents[2] / "site" / "sitecustomize.py"))


def _install() -> None:
    """The faults the environment asks for, patched in."""
    if os.environ.get("VLMSERVE_POISON_SEED"):
        import vlmserve.worker.model_runner as _runner

        _poison = int(os.environ["VLMSERVE_POISON_SEED"])
        _real = _runner.sample

        def _sample(logits, params, *rest):
            if any(p.seed == _poison for p in params):
                raise RuntimeError("injected sampler fault")
            return _real(logits, params, *rest)

        _runner.sample = _sample

    if os.environ.get("VLMSERVE_STALL_SEED"):
        # requests with this seed are never scheduled: the engine holds them and makes no
        # progress on them (for the health check's stall detection)
        import vlmserve.core.scheduler as _scheduler

        _stall = int(os.environ["VLMSERVE_STALL_SEED"])
        _plan = _scheduler.plan_chunk

        def _plan_chunk(req, *args, **kwargs):
            if req.sampling_params.seed == _stall:
                return 0, [], 0
            return _plan(req, *args, **kwargs)

        _scheduler.plan_chunk = _plan_chunk

    if os.environ.get("VLMSERVE_PERTURB_RANK"):
        # the sampler of that tensor-parallel rank sees different logits (reversed): greedy
        # sampling there picks other tokens unless every rank takes rank 0's
        import vlmserve.worker.model_runner as _runner

        _rank = int(os.environ["VLMSERVE_PERTURB_RANK"])
        _real_sample, _real_init = _runner.sample, _runner.ModelRunner.__init__
        _runners = []  # this process's model runners (a rank has one)

        def _init(self, *args, **kwargs):
            _real_init(self, *args, **kwargs)
            _runners.append(self)

        def _perturbed(logits, params, *rest):
            if any(r.tp is not None and r.tp.rank == _rank for r in _runners):
                logits = logits.flip(-1)
            return _real_sample(logits, params, *rest)

        _runner.ModelRunner.__init__ = _init
        _runner.sample = _perturbed

    if os.environ.get("VLMSERVE_GRAMMAR_HANG"):
        # in a grammar compile process: a grammar whose text holds this marker compiles for ever
        # (the compile deadline, cancellation and ordering tests)
        import vlmserve.layers.grammar_processes as _grammar_processes

        _marker = os.environ["VLMSERVE_GRAMMAR_HANG"]
        _real_compile_spec = _grammar_processes.compile_spec

        def _compile_spec(compiler, spec):
            if _marker in spec[1]:
                import time

                time.sleep(3600)
            return _real_compile_spec(compiler, spec)

        _grammar_processes.compile_spec = _compile_spec


try:
    _install()
except BaseException:  # a hook that no longer fits the code: the process must not run without it
    import traceback

    traceback.print_exc()
    os._exit(70)
