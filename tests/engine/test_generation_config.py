"""Default sampling parameters from the model's generation_config.json (`--generation-config`,
vLLM's default "auto"): what is read, what is not, and `LLM` using them for prompts given no
SamplingParams."""

from __future__ import annotations

import json
import shutil

import pytest

from vlmserve import LLM, SamplingParams
from vlmserve.sampling_params import generation_defaults

PROMPT = {"prompt": "Once upon a time there was"}


def _write(folder, **fields) -> None:
    path = folder / "generation_config.json"
    data = json.loads(path.read_text()) if path.exists() else {}
    path.write_text(json.dumps(data | fields))


@pytest.fixture(scope="module")
def model_dir(vlmserve_cache, tmp_path_factory):
    from vlmserve.models.builtin import resolve_model

    folder = tmp_path_factory.mktemp("gen") / "tiny"
    shutil.copytree(resolve_model("tiny-qwen2-vl"), folder)
    # Qwen2-VL-Instruct's kind of defaults; top_p 1.0 and top_k 50 are transformers' own
    # defaults, written out by it, not the model's choice
    _write(folder, do_sample=True, temperature=0.7, top_k=1, top_p=1.0,
           repetition_penalty=1.3, max_new_tokens=7)
    return folder


def test_what_is_read(model_dir, tmp_path) -> None:
    want = {"temperature": 0.7, "top_k": 1, "repetition_penalty": 1.3, "max_tokens": 7}
    assert generation_defaults("auto", model_dir) == want
    assert generation_defaults("vllm", model_dir) == {}
    other = tmp_path / "other"
    other.mkdir()
    _write(other, top_k=50, min_p=0.05, top_p=0.8)
    assert generation_defaults(str(other), model_dir) == {"min_p": 0.05, "top_p": 0.8}
    assert generation_defaults("auto", tmp_path) == {}  # no file: none
    with pytest.raises(ValueError, match="no generation_config.json"):
        generation_defaults(str(tmp_path), model_dir)
    _write(other, repetition_penalty=5.0)
    with pytest.raises(ValueError, match="generation_config.json.*repetition_penalty"):
        generation_defaults(str(other), model_dir)


def test_llm_uses_them_when_given_no_params(model_dir) -> None:
    llm = LLM(str(model_dir), dtype="float32")
    defaults = llm.get_default_sampling_params()
    assert (defaults.temperature, defaults.top_k, defaults.repetition_penalty,
            defaults.max_tokens) == (0.7, 1, 1.3, 7)
    out = llm.generate(PROMPT, use_tqdm=False)[0].outputs[0]
    explicit = llm.generate(PROMPT, SamplingParams(temperature=0.7, top_k=1,
                                                   repetition_penalty=1.3, max_tokens=7),
                            use_tqdm=False)[0].outputs[0]
    assert out.token_ids == explicit.token_ids and len(out.token_ids) <= 7
    ours = LLM(str(model_dir), dtype="float32", generation_config="vllm")
    assert ours.get_default_sampling_params() == SamplingParams()
