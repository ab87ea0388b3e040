"""Benchmarks: each module has `add_args(parser)` and `main(args=None)` (see `vlmserve bench`)."""

from __future__ import annotations

import argparse
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from vlmserve.config import ModelConfig
from vlmserve.flags import engine_kwargs


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """The module docstring as written; each option's help ends with its default (unless it
    names it already, or the option has none: None, or a flag that is off)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if (not action.option_strings or "(default" in text
                or any(action.default is v for v in (None, False, argparse.SUPPRESS))):
            return text
        return f"{text} (default: %(default)s)"


def parse_args(args: argparse.Namespace | None, add_args: Callable, doc: str | None
               ) -> argparse.Namespace:
    """`args` as given (from the `vlmserve bench` CLI), or parsed from the command line."""
    if args is not None:
        return args
    ap = argparse.ArgumentParser(description=doc, formatter_class=HelpFormatter,
                                 allow_abbrev=False)
    add_args(ap)
    return ap.parse_args()


def engine_options(args: argparse.Namespace, skip: Iterable[str] = ()) -> dict[str, Any]:
    """The engine options of a benchmark's command line (`flags.add_engine_options`): those
    given or defaulted by the benchmark, and always the model (the engine's default if not);
    `skip`: those it left out (a workload flag of the same name is not the engine's)."""
    options = {k: v for k, v in engine_kwargs(args).items() if k not in set(skip)}
    options.setdefault("model", ModelConfig().model)
    return options


def with_local_model(options: dict[str, Any]) -> dict[str, Any]:
    """Engine ``options`` with their model and tokenizer named by local folders
    (`local_model_config`: a Hugging Face id is fetched once, here, at its revision)."""
    from vlmserve.config import EngineConfig
    from vlmserve.models.metadata import local_model_config

    mc = local_model_config(EngineConfig.from_kwargs(**options).model_config)
    return {**options, "model": mc.model,
            **({"tokenizer": mc.tokenizer} if mc.tokenizer is not None else {})}


def table(head: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    """Right-aligned columns under a header and a rule, to read on screen."""
    widths = [max(len(x) for x in col) for col in zip(head, *rows)]
    fmt = "  ".join(f"{{:>{w}}}" for w in widths)
    return "\n".join([fmt.format(*head), "  ".join("-" * w for w in widths),
                      *(fmt.format(*row) for row in rows)])
