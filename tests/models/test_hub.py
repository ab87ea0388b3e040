"""Models named by Hugging Face id, resolved offline from a Hub cache laid out by hand
(tests/hub_cache.py): `LLM("org/name")` runs the same model as its folder, `--revision` picks
the snapshot, `--tokenizer` is where the tokenizer comes from, a model missing from the cache
is one line naming it, pickled weights are never fetched, remote code is refused unless
allowed. (`vlmserve serve org/name` as a process: tests/e2e/test_hub.py.)"""

from __future__ import annotations

import json
import shutil
import socket
from pathlib import Path

import pytest
from huggingface_hub.utils import filter_repo_objects

from tests.hub_cache import COMMIT, add_snapshot
from vlmserve import LLM, MultimodalEncoder, SamplingParams
from vlmserve.config import ModelConfig
from vlmserve.entrypoints.cli import main, make_parser
from vlmserve.flags import engine_kwargs
from vlmserve.models.builtin import resolve_model
from vlmserve.models.hub import ALLOW_PATTERNS, remote_code
from vlmserve.models.metadata import local_model_config

PROMPTS = ["Describe the weather.", "One two three"]
PARAMS = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")
OTHER = "fedcba9876543210fedcba9876543210fedcba98"


def _tokens(llm: LLM) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, PARAMS, use_tqdm=False)]


@pytest.fixture
def offline(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")


@pytest.fixture
def cache(tmp_path: Path, tiny_qwen2_vl_path: Path) -> Path:
    """A Hub cache: ``org/tiny`` (the tiny Qwen2-VL at `COMMIT`, main) and at another commit
    (tag v2) the same with another generation config; ``org/tiny-untokenized`` (no tokenizer
    files); ``org/tok`` (only the tokenizer files)."""
    root = tmp_path / "hub"
    add_snapshot(root, "org/tiny", tiny_qwen2_vl_path)
    v2 = add_snapshot(root, "org/tiny", tiny_qwen2_vl_path, commit=OTHER, refs=("v2",))
    (v2 / "generation_config.json").write_text(json.dumps({"max_new_tokens": 3}))
    add_snapshot(root, "org/tiny-untokenized", tiny_qwen2_vl_path, skip=TOKENIZER_FILES)
    add_snapshot(root, "org/tok", tiny_qwen2_vl_path,
                 skip=tuple(p.name for p in tiny_qwen2_vl_path.iterdir()
                            if p.name not in TOKENIZER_FILES))
    return root


@pytest.fixture
def folder_tokens(tiny_qwen2_vl_path: Path) -> list[list[int]]:
    return _tokens(LLM(str(tiny_qwen2_vl_path), dtype="float32", device="cpu"))


def test_llm_by_id_runs_the_cached_snapshot_like_its_folder(cache, offline, folder_tokens):
    llm = LLM("org/tiny", download_dir=str(cache), dtype="float32", device="cpu")
    snapshot = cache / "models--org--tiny" / "snapshots" / COMMIT
    assert Path(llm.engine.model_path) == snapshot
    assert llm.engine.config.model_config.model == str(snapshot)  # what other processes get
    assert _tokens(llm) == folder_tokens


def test_tokenizer_comes_from_its_own_id(cache, offline, folder_tokens):
    llm = LLM("org/tiny-untokenized", tokenizer="org/tok", download_dir=str(cache),
              dtype="float32", device="cpu")
    # without it, transformers would make an empty tokenizer of the model's folder (no files):
    # refused in one line
    with pytest.raises(ValueError, match="has no tokenizer files .*--tokenizer"):
        LLM("org/tiny-untokenized", download_dir=str(cache), dtype="float32", device="cpu")
    assert len(llm.get_tokenizer()) > 2
    tokenizer_folder = cache / "models--org--tok" / "snapshots" / COMMIT
    assert llm.engine.config.model_config.tokenizer == str(tokenizer_folder)
    assert Path(llm.get_tokenizer().name_or_path) == tokenizer_folder
    assert _tokens(llm) == folder_tokens
    # the chat template too (the model's folder has none)
    messages = [{"role": "user", "content": "Hi"}]
    chat = llm.chat(messages, PARAMS, use_tqdm=False)[0]
    tokenizer = llm.get_tokenizer()
    assert chat.prompt_token_ids == tokenizer.encode(
        tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False))


def test_encoder_by_id_loads_the_cached_snapshot(cache, offline):
    snapshot = cache / "models--org--tiny" / "snapshots" / COMMIT
    with MultimodalEncoder("org/tiny", download_dir=str(cache), dtype="float32",
                           device="cpu") as enc:
        assert enc.model_path == snapshot and enc.config.model_config.model == str(snapshot)


def test_revision_picks_the_snapshot(cache, offline):
    snapshots = cache / "models--org--tiny" / "snapshots"
    for revision, commit in ((None, COMMIT), ("main", COMMIT), ("v2", OTHER), (OTHER, OTHER)):
        mc = local_model_config(ModelConfig(model="org/tiny", revision=revision,
                                            download_dir=str(cache)))
        assert mc.model == str(snapshots / commit), revision
    # the tokenizer's: its own, else the model's when it is the model's id, else main
    for tokenizer, revision, tokenizer_revision, folder in (
            ("org/tiny", "v2", None, snapshots / OTHER),
            ("org/tiny", None, "v2", snapshots / OTHER),
            ("org/tok", "v2", None, cache / "models--org--tok" / "snapshots" / COMMIT)):
        mc = local_model_config(ModelConfig(
            model="org/tiny", tokenizer=tokenizer, revision=revision,
            tokenizer_revision=tokenizer_revision, download_dir=str(cache)))
        assert mc.tokenizer == str(folder), (tokenizer, revision, tokenizer_revision)
    llm = LLM("org/tiny", revision="v2", download_dir=str(cache), dtype="float32", device="cpu")
    assert llm.get_default_sampling_params().max_tokens == 3  # v2's generation config
    with pytest.raises(ValueError, match=r"'org/tiny' \(revision v3\) is not in the Hugging "
                       r"Face cache .*HF_HUB_OFFLINE"):
        resolve_model("org/tiny", revision="v3", download_dir=str(cache))


def test_resolution_is_idempotent_and_keeps_folders_and_builtins(cache, offline,
                                                                 tiny_qwen2_vl_path):
    first = local_model_config(ModelConfig(model="org/tiny", tokenizer="org/tok",
                                           download_dir=str(cache)))
    assert local_model_config(first) == first  # folders stay (a child process's view)
    assert local_model_config(ModelConfig(model="tiny-qwen2-vl")).model == str(
        tiny_qwen2_vl_path)
    assert local_model_config(ModelConfig(model=str(cache))).model == str(cache)


def test_a_model_missing_offline_is_one_line_from_the_cli(tmp_path, offline, capsys):
    empty = tmp_path / "empty"
    with pytest.raises(SystemExit) as exit_info:
        main(["serve", "org/missing", "--download-dir", str(empty), "--port", "0"])
    assert exit_info.value.code == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("vlmserve: error: model 'org/missing' "
                                                  "(revision main) is not in the Hugging Face "
                                                  f"cache {empty}")
    assert "HF_HUB_OFFLINE" in err and "Traceback" not in err
    with pytest.raises(SystemExit):
        main(["generate", "hi", "--model", "no-such-model"])
    err = capsys.readouterr().err
    assert "neither an existing path, a built-in model nor a Hugging Face model id" in err


def _closed_port() -> int:
    """A port free a moment ago, closed again."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_an_unreachable_hub_is_one_line(tmp_path, monkeypatch, capsys):
    """Online, with nothing listening where the Hub should be (HF_ENDPOINT, as
    huggingface_hub read it at import) and nothing cached."""
    from huggingface_hub import constants

    port, listen = _closed_port(), _closed_port()  # nothing there: connections are refused
    monkeypatch.setattr(constants, "ENDPOINT", f"http://127.0.0.1:{port}")
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.delenv("TRANSFORMERS_OFFLINE", raising=False)
    with pytest.raises(SystemExit) as exit_info:
        main(["serve", "org/tiny", "--revision", "v1", "--download-dir", str(tmp_path),
              "--port", str(listen)])  # the server checks its port before the model
    err = capsys.readouterr().err
    assert exit_info.value.code == 1 and err.count("\n") == 1, err
    assert err.startswith("vlmserve: error: model 'org/tiny' (revision v1) is not in the "
                          f"Hugging Face cache {tmp_path} and the Hugging Face Hub could not "
                          "be reached"), err


def test_only_safe_serving_files_are_fetched() -> None:
    files = ["config.json", "model-00001-of-00002.safetensors", "model.safetensors.index.json",
             "tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "merges.txt",
             "tokenizer.model", "generation_config.json", "preprocessor_config.json",
             "pytorch_model.bin", "training_args.bin", "optimizer.pt", "modeling_x.py"]
    fetched = set(filter_repo_objects(files, allow_patterns=list(ALLOW_PATTERNS)))
    assert fetched == set(files) - {"pytorch_model.bin", "training_args.bin", "optimizer.pt",
                                    "modeling_x.py"}


def _with_json(src: Path, dst: Path, name: str, **fields) -> Path:
    """Checkpoint ``src``'s json files copied to ``dst``, ``fields`` set in file ``name``."""
    dst.mkdir()
    for f in src.glob("*.json"):
        shutil.copy(f, dst)
    data = json.loads((dst / name).read_text()) if (dst / name).exists() else {}
    (dst / name).write_text(json.dumps({**data, **fields}))
    return dst


def test_remote_code_is_refused_unless_trusted(tmp_path, tiny_qwen2_vl_path, offline):
    custom = _with_json(tiny_qwen2_vl_path, tmp_path / "custom", "config.json",
                        model_type="x_custom", architectures=["XForCausalLM"],
                        auto_map={"AutoConfig": "configuration_x.XConfig",
                                  "AutoModelForCausalLM": "modeling_x.XForCausalLM"})
    assert remote_code(custom) == ["XConfig (config.json)", "XForCausalLM (config.json)"]
    with pytest.raises(ValueError, match=r"needs Python code of its own to load \(XConfig "
                       r"\(config.json\), XForCausalLM \(config.json\)\).*--trust-remote-code"):
        local_model_config(ModelConfig(model=str(custom)))
    assert local_model_config(ModelConfig(model=str(custom), trust_remote_code=True)).model == \
        str(custom)
    tok = _with_json(tiny_qwen2_vl_path, tmp_path / "tok", "tokenizer_config.json",
                     tokenizer_class="XTokenizer", auto_map={"AutoTokenizer": [
                         "tokenization_x.XTokenizer", None]})
    with pytest.raises(ValueError, match=r"XTokenizer \(tokenizer_config.json\)"):
        local_model_config(ModelConfig(model=str(tiny_qwen2_vl_path), tokenizer=str(tok)))
    # an auto_map beside classes transformers has itself runs none of the repository's code
    known = _with_json(tiny_qwen2_vl_path, tmp_path / "known", "config.json",
                       auto_map={"AutoConfig": "configuration_x.Qwen2VLConfig",
                                 "AutoModel": "modeling_x.Qwen2VLForConditionalGeneration"})
    assert remote_code(known) == [] and remote_code(tiny_qwen2_vl_path) == []
    args = make_parser().parse_args(["serve", "org/x", "--trust-remote-code", "--revision", "v1",
                                     "--tokenizer", "org/t", "--download-dir", "/d"])
    assert engine_kwargs(args) == {"trust_remote_code": True, "revision": "v1",
                                   "tokenizer": "org/t", "download_dir": "/d"}
