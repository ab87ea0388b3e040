"""A Hugging Face Hub cache written by hand, in the Hub's own layout, so tests resolve model ids
offline: ``models--org--name/snapshots/<commit>/<files>`` and ``refs/<branch or tag>``."""

from __future__ import annotations

import shutil
from pathlib import Path

COMMIT = "0123456789abcdef0123456789abcdef01234567"


def add_snapshot(cache: Path, repo_id: str, source: Path, commit: str = COMMIT,
                 refs: tuple[str, ...] = ("main",), skip: tuple[str, ...] = ()) -> Path:
    """Copy checkpoint folder ``source`` (less the files named in ``skip``) into ``cache`` as
    ``repo_id``'s snapshot at ``commit``, which each of ``refs`` points to; the snapshot."""
    repo = cache / f"models--{repo_id.replace('/', '--')}"
    snapshot = repo / "snapshots" / commit
    shutil.copytree(source, snapshot, ignore=lambda _, names: [n for n in names if n in skip])
    (repo / "refs").mkdir(parents=True, exist_ok=True)
    for ref in refs:
        (repo / "refs" / ref).write_text(commit)
    return snapshot
