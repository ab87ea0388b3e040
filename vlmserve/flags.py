"""Command-line flags generated from option dataclasses: the engine's options
(`EngineConfig.option_fields()`) for `vlmserve serve` / `generate` and the benchmarks, the
server's (`entrypoints/args.py`). Each field becomes `--field-name` with its
`metadata["help"]`, its type (Optional ints parse as ints) and, for bools, `--x/--no-x`;
a field's metadata may also give `choices` (a value outside them is refused naming them),
`type` (a parser of its own), `nargs` and `aliases` (other flags, vLLM's `-tp`), and names
its help section (`group`: a key of `GROUPS`, vLLM's grouping; expert options last).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import types
from collections.abc import Iterable, Mapping
from typing import Any, Union, get_args, get_origin

from vlmserve.config import EngineConfig

_TYPES: dict[str, type] = {"int": int, "float": float, "str": str, "bool": bool}


def _json_object(text: str) -> dict:
    """A JSON object given on the command line (`--mm-processor-kwargs '{"max_pixels": 1}'`)."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"not JSON: {e}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError("expected a JSON object")
    return value


_json_object.__name__ = "json"  # the metavar: --mm-processor-kwargs JSON


def _one_of(choices: tuple[str, ...]) -> Any:
    """A parser of `choices`: a value outside them is refused in one line naming them."""
    def parse(text: str) -> str:
        if text not in choices:
            raise argparse.ArgumentTypeError(
                f"must be one of {', '.join(choices)}, not {text!r}")
        return text
    return parse


def _field_type(f: dataclasses.Field) -> type:
    """The non-None type of a field annotated `X` or `X | None` (annotations may be strings)."""
    t = f.type
    if isinstance(t, str):
        names = [p.strip() for p in t.split("|") if p.strip() != "None"]
        if len(names) == 1 and names[0].startswith("dict"):
            return _json_object
        return _TYPES.get(names[0], str) if len(names) == 1 else str
    if get_origin(t) in (Union, types.UnionType):
        args = [a for a in get_args(t) if a is not type(None)]
        return args[0] if len(args) == 1 else str
    return t if isinstance(t, type) else str


# the help's sections (argparse groups), in the order `--help` lists them, as vLLM groups its
# flags; a field's `metadata["group"]` names its section; expert options come last
GROUPS = {
    "model": "model: what to load and how",
    "frontend": "serving: the HTTP front end",
    "scheduler": "scheduler: batching and step budgets",
    "cache": "cache: KV cache, prefix caching, image embeddings",
    "multimodal": "multimodal inputs: limits, local and remote media, preprocessing",
    "parallel": "parallelism: tensor, expert and data parallel",
    "encoder": "encoder service: encode / prefill-decode disaggregation (EPD)",
    "structured": "structured outputs, tools and reasoning",
    "expert": "kernels and expert options",
}


def option_group(parser: argparse.ArgumentParser, key: str) -> argparse._ArgumentGroup:
    """``parser``'s group for the options of `GROUPS` ``key`` (every group made at once, the
    first time, so that `--help` lists them in `GROUPS` order whatever adds options first)."""
    groups = getattr(parser, "_vlmserve_groups", None)
    if groups is None:
        groups = {k: parser.add_argument_group(title) for k, title in GROUPS.items()}
        parser._vlmserve_groups = groups  # type: ignore[attr-defined]
    return groups[key]


class ExamplesFormatter(argparse.HelpFormatter):
    """argparse's wrapping, except lines indented by two spaces (an epilog's examples), kept
    as written."""

    def _fill_text(self, text: str, width: int, indent: str) -> str:
        out: list[str] = []
        para: list[str] = []
        for line in [*text.splitlines(), ""]:
            if line.startswith("  ") or not line.strip():
                if para:
                    out.append(super()._fill_text(" ".join(para), width, indent))
                    para = []
                out.append(indent + line if line.strip() else "")
            else:
                para.append(line)
        return "\n".join(out).rstrip("\n")


def add_field_options(parser: argparse.ArgumentParser | argparse._ArgumentGroup,
                      fields: Iterable[dataclasses.Field], skip: Iterable[str] = (),
                      defaults: Mapping[str, tuple[Any, str]] | None = None) -> list[str]:
    """Add `--name` per field, into its `GROUPS` section (`metadata["group"]`) when
    ``parser`` is a parser; options not given stay absent from the namespace, so the
    dataclass defaults apply. `defaults`: fields whose default the caller sets instead, by
    name, as (value, why): the help shows both, and the option is in the namespace at that
    value unless given. Returns the names added."""
    added = []
    skipped = set(skip)
    defaults = defaults or {}
    unknown = set(defaults) - {f.name for f in fields}
    assert not unknown, f"defaults for unknown options: {sorted(unknown)}"
    for f in fields:
        if f.name in skipped:
            continue
        typ = f.metadata.get("type") or _field_type(f)
        default = f.default if f.default is not dataclasses.MISSING else None
        help_text = f.metadata.get("help", "")
        if "default" not in help_text:
            help_text += f" (default: {default})"
        given_default = argparse.SUPPRESS
        if f.name in defaults:
            given_default, why = defaults[f.name]
            help_text = help_text.replace("(default:", "(the engine's default:")
            help_text += f" Default here: {given_default} ({why})."
        flags = ["--" + f.name.replace("_", "-"), *f.metadata.get("aliases", ())]
        group = parser
        if isinstance(parser, argparse.ArgumentParser) and "group" in f.metadata:
            group = option_group(parser, f.metadata["group"])
        if typ is bool:
            group.add_argument(*flags, dest=f.name, action=argparse.BooleanOptionalAction,
                                default=given_default, help=help_text)
        else:
            choices = f.metadata.get("choices")
            group.add_argument(*flags, dest=f.name, type=_one_of(choices) if choices else typ,
                                default=given_default, help=help_text,
                                nargs=f.metadata.get("nargs"),
                                metavar="{" + ",".join(choices) + "}" if choices
                                else typ.__name__.upper())
        added.append(f.name)
    return added


def add_engine_options(parser: argparse.ArgumentParser, skip: Iterable[str] = (),
                       defaults: Mapping[str, tuple[Any, str]] | None = None) -> list[str]:
    """The engine's options as flags (see `add_field_options`), each in its `GROUPS`
    section (same names as `LLM(...)`'s keyword arguments)."""
    return add_field_options(parser, EngineConfig.option_fields(), skip, defaults)


def engine_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """The engine options given on the command line, for `EngineConfig.from_kwargs`."""
    return {f.name: getattr(args, f.name) for f in EngineConfig.option_fields()
            if hasattr(args, f.name)}
