"""Models named by a Hugging Face model id (``org/name``): the files a serving engine reads,
fetched into the Hub's cache (or found there offline), and the check that loading a
checkpoint runs no Python code it ships unless the user allowed it.

A model id is resolved once, where the options are parsed (`metadata.local_model_config`):
every other process (engine core, tensor-parallel ranks, preprocessing processes, encoder
core) gets the local folder, so only one process talks to the Hub and the others never do.
"""

from __future__ import annotations

import json
import logging
import os
import re
from pathlib import Path
from typing import Any

# What the engine reads from a checkpoint: configs, tokenizer and processor files, chat
# templates (json, jinja), vocabularies (txt, SentencePiece .model), safetensors weights and
# their index. Never pickled weights (*.bin, *.pt): loading those can run arbitrary code.
ALLOW_PATTERNS = ("*.json", "*.jinja", "*.txt", "*.model", "*.safetensors")
# a checkpoint's own Python code, fetched only with trust_remote_code
CODE_PATTERNS = ("*.py",)

logger = logging.getLogger(__name__)
_REPO_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")


def is_model_id(name: str) -> bool:
    """Whether ``name`` reads as a Hub model id, ``org/name`` (a bare ``name`` never does: it
    would be a mistyped built-in name or folder far more often than a Hub model)."""
    return bool(_REPO_ID.fullmatch(name)) and ".." not in name and not name.endswith(".git")


def offline() -> bool:
    """Whether the Hub may not be contacted: ``HF_HUB_OFFLINE`` (or ``TRANSFORMERS_OFFLINE``)
    set, read now, so a process that set it after importing huggingface_hub (a notebook, a
    test) is honoured too."""
    import huggingface_hub

    value = os.environ.get("HF_HUB_OFFLINE") or os.environ.get("TRANSFORMERS_OFFLINE") or ""
    return huggingface_hub.is_offline_mode() or value.upper() in ("1", "ON", "YES", "TRUE")


def download_model(model_id: str, revision: str | None = None,
                   download_dir: str | None = None, trust_remote_code: bool = False) -> Path:
    """The local snapshot folder of ``model_id`` at ``revision`` (default: main) in the Hub's
    cache (``download_dir``, else ``$HF_HUB_CACHE`` / ``$HF_HOME/hub``): downloaded with a
    progress bar when online (only `ALLOW_PATTERNS`, plus the checkpoint's Python files with
    ``trust_remote_code``), found in the cache without any request when offline
    (``HF_HUB_OFFLINE=1``). ``HF_TOKEN`` is read by huggingface_hub itself. A model that is
    missing, gated, unreachable or not cached offline raises one `ValueError` line naming
    the id, the revision and what to do."""
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import (
        GatedRepoError,
        HfHubHTTPError,
        IncompleteSnapshotError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    what = f"model {model_id!r} (revision {revision or 'main'})"
    where = f"the Hugging Face cache {download_dir or constants.HF_HUB_CACHE}"
    patterns = [*ALLOW_PATTERNS, *(CODE_PATTERNS if trust_remote_code else ())]
    local_only = offline()
    logger.info("%s from %s", what, f"{where} (offline)" if local_only
                else f"the Hugging Face Hub (cached in {where})")
    try:
        return Path(snapshot_download(
            model_id, revision=revision, cache_dir=download_dir, allow_patterns=patterns,
            local_files_only=local_only))
    except GatedRepoError:
        raise ValueError(
            f"{what} is gated on the Hugging Face Hub: accept its terms at "
            f"https://huggingface.co/{model_id} and set HF_TOKEN to a token of that "
            "account") from None
    except RepositoryNotFoundError:
        raise ValueError(
            f"{what} is neither a local folder nor a model on the Hugging Face Hub (a private "
            "one needs HF_TOKEN set to a token that can read it)") from None
    except RevisionNotFoundError:
        raise ValueError(
            f"{what}: the model has no such revision on the Hugging Face Hub; --revision "
            "takes a branch, tag or commit hash of it") from None
    except IncompleteSnapshotError:
        raise ValueError(
            f"{what} is only partly in {where} (an interrupted download): download it again "
            "online (without HF_HUB_OFFLINE)") from None
    except LocalEntryNotFoundError as e:
        if local_only:
            raise ValueError(
                f"{what} is not in {where} and the Hub may not be contacted (HF_HUB_OFFLINE "
                "is set): download it once online, or give --download-dir where it "
                "was downloaded") from None
        raise ValueError(
            f"{what} is not in {where} and the Hugging Face Hub could not be reached "
            f"({_first_line(e.__cause__ or e)}): check the network, HF_ENDPOINT or the proxy, "
            "or download it where this machine can read it") from None
    except HfHubHTTPError as e:
        raise ValueError(f"{what}: the Hugging Face Hub refused the download "
                         f"({_first_line(e)})") from None


def _first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return text[0] if text else type(e).__name__


def _read_json(path: Path) -> dict[str, Any]:
    try:
        with open(path) as f:
            data = json.load(f)
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def _auto_classes(auto_map: dict[str, Any], keys: tuple[str, ...] | None = None) -> list[str]:
    """Class names of ``auto_map``'s entries (all, or those under ``keys``); an entry is
    ``module.Class``, ``repo--module.Class`` or a [slow, fast] pair."""
    names = []
    for key, refs in auto_map.items():
        if keys is not None and key not in keys:
            continue
        for ref in refs if isinstance(refs, list) else [refs]:
            if isinstance(ref, str):
                names.append(ref.rpartition(".")[2])
    return names


def remote_code(folder: str | Path) -> list[str]:
    """The classes that only the checkpoint's own Python code (an ``auto_map`` entry)
    defines and that loading it would need, each with the file that asks for it: its config
    class (a model type transformers lacks), its architecture's class, its tokenizer, image
    processor or processor class (one transformers lacks). transformers uses its own class
    where it has one, so an ``auto_map`` beside a class it knows needs no code."""
    import transformers
    from transformers import CONFIG_MAPPING

    folder = Path(folder)

    def known(name: Any) -> bool:
        return isinstance(name, str) and hasattr(transformers, name)

    found = []
    config = _read_json(folder / "config.json")
    auto_map = config.get("auto_map") or {}
    if "AutoConfig" in auto_map and config.get("model_type") not in CONFIG_MAPPING:
        found += [f"{c} (config.json)" for c in _auto_classes(auto_map, ("AutoConfig",))]
    architectures = set(config.get("architectures") or [])
    found += [f"{c} (config.json)" for c in _auto_classes(auto_map)
              if c in architectures and not known(c)]
    for name, declared, keys in (
            ("tokenizer_config.json", "tokenizer_class", ("AutoTokenizer",)),
            ("preprocessor_config.json", "image_processor_type", ("AutoImageProcessor",)),
            ("processor_config.json", "processor_class", ("AutoProcessor",))):
        data = _read_json(folder / name)
        classes = _auto_classes(data.get("auto_map") or {}, keys)
        if classes and not known(data.get(declared)):
            found += [f"{c} ({name})" for c in dict.fromkeys(classes)]
    return list(dict.fromkeys(found))


def check_remote_code(name: str, folder: str | Path, trust_remote_code: bool) -> None:
    """Refuse, in one line, a checkpoint whose loading would run its own Python code, unless
    the user allowed it (``trust_remote_code``): never run it silently."""
    if trust_remote_code:
        return
    classes = remote_code(folder)
    if classes:
        raise ValueError(
            f"{name!r} needs Python code of its own to load ({', '.join(classes)}), which "
            "vlmserve runs only with --trust-remote-code (trust_remote_code=True): pass it if "
            "you trust the repository's code")
