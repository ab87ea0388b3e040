"""Benchmarks: each module has `add_args(parser)` and `main(args=None)` (see `vlmserve bench`)."""

from __future__ import annotations

import argparse
from collections.abc import Callable


def parse_args(args: argparse.Namespace | None, add_args: Callable, doc: str | None
               ) -> argparse.Namespace:
    """`args` as given (from the `vlmserve bench` CLI), or parsed from the command line."""
    if args is not None:
        return args
    ap = argparse.ArgumentParser(description=doc,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    add_args(ap)
    return ap.parse_args()
