"""The `vlmserve` command: `serve`, `generate`, `bench ...`.

Every mistake is one line on stderr, `vlmserve: error: ...`: a command line the parser
refuses (an unknown flag, a value of the wrong type, out of its range or choices) exits 2, as
argparse; any other mistake found before or while running (a missing file, option values
that do not go together, a device that is not here) exits 1.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import NoReturn

from vlmserve import __version__
from vlmserve.entrypoints.args import add_engine_options, add_server_options, engine_kwargs
from vlmserve.flags import ExamplesFormatter

DEFAULT_MODEL = "tiny-qwen2-vl"
# `serve --help`'s epilog (each line parses: tests/e2e/test_cli.py)
SERVE_EXAMPLES = """examples:
  vlmserve serve tiny-qwen2-vl --device cpu
  vlmserve serve Qwen/Qwen2-VL-2B-Instruct --api-key KEY --max-model-len 8192
  vlmserve serve Qwen/Qwen2.5-VL-7B-Instruct -tp 2 --limit-mm-per-prompt '{"image": 4}'
  vlmserve serve Qwen/Qwen2-VL-2B-Instruct --role encoder --port 8001
  vlmserve serve Qwen/Qwen2-VL-2B-Instruct --encoder-url http://127.0.0.1:8001

the docs: docs/serving.md (these options by group), docs/multimodal.md, docs/epd.md"""
_SAMPLING_FLAGS = ("max_tokens", "temperature", "top_p", "top_k", "seed")


class _Parser(argparse.ArgumentParser):
    """argparse's parser whose mistakes are one line (not the whole usage) and a hint."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"vlmserve: error: {message} (`{self.prog} --help` lists the options)\n")


def _add_model(p: argparse.ArgumentParser) -> None:
    p.add_argument("model_pos", nargs="?", metavar="MODEL", default=None,
                   help="Checkpoint folder, built-in model name or Hugging Face model id "
                   f"(org/name) (default: {DEFAULT_MODEL}); same as --model.")


def _resolve_model(args: argparse.Namespace, parser: argparse.ArgumentParser) -> None:
    flag = getattr(args, "model", None)
    if args.model_pos and flag and args.model_pos != flag:
        parser.error(f"model given twice: {args.model_pos!r} and --model {flag!r}")
    args.model = args.model_pos or flag or DEFAULT_MODEL


def _serve(args: argparse.Namespace) -> None:
    from vlmserve.entrypoints.openai.launch import run_server

    run_server(args)


def _check_images(paths: Sequence[str]) -> None:
    """`generate --image` files exist and are files (URLs are read later), before the model
    loads; numbered as the server numbers a request's images."""
    for n, path in enumerate(paths, 1):
        if path.split(":", 1)[0].lower() in ("data", "http", "https", "file"):
            continue
        p = Path(path).expanduser()
        if p.is_dir():
            raise ValueError(f"image {n} of the request: {path!r} is a directory, not an "
                             "image file")
        if not p.is_file():
            raise ValueError(f"image {n} of the request: image file not found: {path!r}")


def _generate(args: argparse.Namespace) -> None:
    from vlmserve import LLM, SamplingParams

    # the inputs are checked before the model loads
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature,
                            top_p=args.top_p, top_k=args.top_k, seed=args.seed)
    _check_images(args.image or [])
    kwargs = {k: v for k, v in engine_kwargs(args).items() if k != "seed"}
    if args.seed is not None:
        kwargs["seed"] = args.seed
    llm = LLM(**kwargs)
    parts = [{"type": "image_url", "image_url": {"url": path}} for path in args.image or []]
    parts.append({"type": "text", "text": args.prompt})
    out = llm.chat([{"role": "user", "content": parts}], params, use_tqdm=False)[0]
    print(out.outputs[0].text)


# `vlmserve bench NAME`: module under vlmserve.benchmarks (with add_args and main) and help
_BENCHMARKS = {
    "throughput": ("throughput", "Offline throughput, ours vs transformers generate."),
    "serve": ("serve", "Online: TTFT, TPOT, ITL and goodput against a running server."),
    "kernels": ("kernels", "Decode step vs the bandwidth floor; prefill and vision vs the "
                "bf16 matmul rate."),
    "attention": ("attention_kernels", "Attention kernels vs the torch reference and the "
                  "hardware."),
    "offload": ("offload", "Image-embedding offload on vs off: memory and throughput."),
}


def _bench(args: argparse.Namespace) -> None:
    module = importlib.import_module(f"vlmserve.benchmarks.{_BENCHMARKS[args.bench_command][0]}")
    module.main(args)


def make_parser(with_benchmarks: bool = True) -> argparse.ArgumentParser:
    """The parser; without `with_benchmarks`, the benchmarks are listed but their modules
    (and torch) are not imported for their options."""
    parser = _Parser(
        prog="vlmserve", description="A serving engine for vision-language models.",
        allow_abbrev=False)
    parser.add_argument("--version", action="version",
                        version=f"vlmserve {__version__}")
    parser.add_argument("--debug", action="store_true",
                        help="Show the full traceback of an error (also VLMSERVE_DEBUG=1).")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    serve = sub.add_parser(
        "serve", help="Run the OpenAI-compatible server.", allow_abbrev=False,
        description="Serve a model over an OpenAI-compatible HTTP API (/v1/chat/completions "
        "with images, /v1/completions, /v1/models, /health, /metrics). Options are grouped "
        "as vLLM groups them; everyday ones first, kernels and expert options last.",
        usage="%(prog)s [MODEL] [options]", epilog=SERVE_EXAMPLES,
        formatter_class=ExamplesFormatter)
    _add_model(serve)
    add_engine_options(serve)  # first: within a group, the engine's (--model) lead
    add_server_options(serve)
    serve.set_defaults(func=_serve, parser=serve)

    gen = sub.add_parser(
        "generate", help="Answer one prompt (with images) and print the text.", allow_abbrev=False,
        description="Run one chat prompt, with any number of images, through the engine.")
    gen.add_argument("prompt", help="The user message.")
    gen.add_argument("--model", default=None, help="Checkpoint folder, built-in model name or "
                     f"Hugging Face model id (org/name) (default: {DEFAULT_MODEL}).")
    gen.add_argument("--image", action="append", metavar="FILE",
                     help="An image file (or data URL) to show the model; repeatable.")
    s = gen.add_argument_group("sampling options")
    s.add_argument("--max-tokens", type=int, default=64,
                   help="Most tokens to generate (default: 64).")
    s.add_argument("--temperature", type=float, default=0.0,
                   help="Sampling temperature; 0 is greedy (default: 0).")
    s.add_argument("--top-p", type=float, default=1.0,
                   help="Nucleus sampling threshold (default: 1, off).")
    s.add_argument("--top-k", type=int, default=-1, help="Top-k sampling (default: -1, off).")
    s.add_argument("--seed", type=int, default=None,
                   help="Seed of the sampler (also the engine's seed).")
    add_engine_options(gen, skip=("model", *_SAMPLING_FLAGS))
    gen.set_defaults(func=_generate, parser=gen, model_pos=None)

    bench = sub.add_parser("bench", help="Benchmarks.", allow_abbrev=False,
                           description="Benchmarks; each prints a summary to read and, with "
                           "--out (--out-dir for serve), writes its full results as JSON.")
    bench_sub = bench.add_subparsers(dest="bench_command", required=True, metavar="BENCHMARK")
    for name, (module_name, help_text) in _BENCHMARKS.items():
        if not with_benchmarks:
            bench_sub.add_parser(name, help=help_text, allow_abbrev=False)
            continue
        from vlmserve.benchmarks import HelpFormatter

        module = importlib.import_module(f"vlmserve.benchmarks.{module_name}")
        bp = bench_sub.add_parser(name, help=help_text, description=module.__doc__,
                                  allow_abbrev=False, formatter_class=HelpFormatter)
        module.add_args(bp)
        bp.set_defaults(func=_bench)
    return parser


_SERVE_MODULES = ("fastapi", "uvicorn", "pydantic", "prometheus_client", "starlette")


def _one_line(e: BaseException) -> str:
    """What went wrong, in one line, with the fix where it is known."""
    if isinstance(e, ModuleNotFoundError) and (e.name or "").split(".")[0] in _SERVE_MODULES:
        return (f"{e.name} is not installed: the server needs the serve extra "
                "(pip install -e \".[serve]\")")
    text = " ".join(str(e).split()) or type(e).__name__
    return text if isinstance(e, ValueError) else f"{type(e).__name__}: {text}"


def main(argv: Sequence[str] | None = None) -> None:
    """The CLI. A mistake (a missing file, a bad option value, ...) prints one line on stderr
    and exits 1; `--debug` (or VLMSERVE_DEBUG=1) shows the traceback instead."""
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = make_parser(with_benchmarks="bench" in argv)
    args = parser.parse_args(argv)
    debug = args.debug or os.environ.get("VLMSERVE_DEBUG", "") not in ("", "0")
    if args.command in ("serve", "generate"):
        _resolve_model(args, args.parser)
        del args.parser
    func = args.func
    del args.func, args.debug  # the namespace goes on to code that may serialize it
    try:
        func(args)
    except KeyboardInterrupt:
        sys.exit(130)
    except SystemExit as e:  # a message (not an exit code): the same one line
        if not isinstance(e.code, str):
            raise
        print(f"vlmserve: error: {' '.join(e.code.split())}", file=sys.stderr)
        sys.exit(1)
    except Exception as e:  # noqa: BLE001 - the user gets one line, --debug the traceback
        if debug:
            raise
        print(f"vlmserve: error: {_one_line(e)}", file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    sys.exit(main())
