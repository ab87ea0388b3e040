"""`kv_cache_dtype="fp8"` through the engine (tiny models, float32, CPU): the cache sized
from a byte budget holds 4x the blocks of a float32 cache (2x a 16-bit one), the checkpoint's
k/v scales reach the attention layers, the engine computes exactly what a float32 cache
holding the quantized values computes (through prefill chunks, prefix hits and preemption;
Qwen2-VL, Qwen3.5, Gemma 3), and greedy decoding stays close to the unquantized cache (the
tolerance measured below)."""

from __future__ import annotations

import shutil

import pytest
import torch
from safetensors.torch import save_file

from tests.engine.helpers import chat_prompt, make_image
from tests.models.hf_tiny import build_tiny
from vlmserve import LLM, SamplingParams
from vlmserve.executor.uniproc import UniprocExecutor
from vlmserve.layers import fused, kv_quant
from vlmserve.layers.attention import write_kv
from vlmserve.models import qwen3_5
from vlmserve.models.builtin import resolve_model
from vlmserve.worker.kv_cache import kv_block_bytes

TOKENS = 64  # greedy tokens scored against the float32 cache
BUDGET = 1 << 20  # KV bytes, as CUDA's free memory would give them (the CPU sizes by count)
SCALES = {0: (0.02, 0.03)}  # layer 1: none in the checkpoint, so 1.0
# Measured on this model over six chat-like prompts (random weights: near-flat distributions,
# about -2.6 nats a token): the FP8 cache's log-probabilities of the float32 cache's 64 greedy
# tokens differed by at most 0.84 nats a token, 0.14 on average over a prompt; tolerated:
# MAX_LOGPROB_DIFF, MEAN_LOGPROB_DIFF (docs/caching.md). Greedy tokens stayed the same until
# the first near-tie went the other way: after 8 tokens for `STORY`, as early as the first
# token for two of the six.
MAX_LOGPROB_DIFF, MEAN_LOGPROB_DIFF = 1.5, 0.25
STORY, FIRST_TOKENS = "Tell me a story about a robot who learns to paint.", 4


@pytest.fixture(scope="module")
def llms(vlmserve_cache, tmp_path_factory):
    """(float32 cache, FP8 cache) engines of tiny-qwen2-vl with k/v scales for layer 0 in
    its checkpoint, KV sized from `BUDGET`."""
    path = tmp_path_factory.mktemp("fp8kv") / "tiny-qwen2-vl-kv-scales"
    shutil.copytree(resolve_model("tiny-qwen2-vl"), path)
    save_file({f"model.layers.{layer}.self_attn.{kind}_scale": torch.tensor(s)
               for layer, pair in SCALES.items() for kind, s in zip("kv", pair)},
              str(path / "kv_scales.safetensors"))
    kw = dict(dtype="float32", device="cpu", max_num_seqs=4)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(UniprocExecutor, "_memory_budget", lambda self, config: BUDGET)
        yield {d: LLM(str(path), kv_cache_dtype=d, **kw) for d in ("auto", "fp8")}


def _runner(llm: LLM):
    return llm.engine.executor.runner


def test_the_budget_holds_four_times_the_float32_blocks(llms):
    auto, fp8 = (llms[d].engine for d in ("auto", "fp8"))
    blocks = auto.executor.num_kv_blocks
    assert blocks >= 64 and 4 * blocks <= fp8.executor.num_kv_blocks <= 4 * blocks + 3
    model = _runner(llms["fp8"]).model
    assert kv_block_bytes(model, 16, torch.bfloat16) == 2 * kv_block_bytes(
        model, 16, torch.float8_e4m3fn)
    assert all(kv.dtype == torch.float8_e4m3fn for kv in _runner(llms["fp8"]).kv_caches)
    assert fp8.get_stats()["kv_cache_dtype"] == "float8_e4m3fn"
    assert auto.get_stats()["kv_cache_dtype"] == "float32"


def test_the_checkpoint_scales_reach_the_attention_layers(llms):
    layers = _runner(llms["fp8"]).model.language_model.layers
    assert [layer.self_attn.kv_scales.tolist() for layer in layers] == [
        pytest.approx(list(SCALES[0])), [1.0, 1.0]]
    assert all(layer.self_attn.kv_scales is None
               for layer in _runner(llms["auto"]).model.language_model.layers)


def _greedy(llm: LLM, prompts: list, tokens: int = 24) -> list:
    greedy = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True, logprobs=0)
    return [o.outputs[0] for o in llm.generate(prompts, greedy, use_tqdm=False)]


def _same(got: list, want: list) -> None:
    for a, b in zip(got, want, strict=True):
        assert a.token_ids == b.token_ids
        assert [next(iter(x.values())) for x in a.logprobs] == pytest.approx(
            [next(iter(x.values())) for x in b.logprobs], abs=1e-4)


def _quantized_write(kv_cache, k, v, slots, kv_scales):
    """`write_kv` of an unquantized cache storing what an FP8 cache reads back."""
    k, v = (kv_quant.dequantize(kv_quant.quantize(x, s), s, x.dtype)
            for x, s in ((k, kv_scales[0]), (v, kv_scales[1])))
    write_kv(kv_cache, k, v, slots)


def _as_quantized(fp8: LLM, monkeypatch, **kw) -> LLM:
    """An engine of `fp8`'s model with an unquantized cache whose every KV write (the eager
    ops' and Qwen3.5's own) stores the values quantized by `fp8`'s scales and read back."""
    sim = LLM(fp8.engine.config.model_config.model, dtype="float32", device="cpu", **kw)
    sim.engine.executor.runner.model.set_kv_cache_scales(
        [getattr(getattr(layer, "self_attn", None), "kv_scales", None)
         for layer in _runner(fp8).model.language_model.layers])
    for module in (fused, qwen3_5):
        monkeypatch.setattr(module, "write_kv", _quantized_write)
    return sim


def test_fp8_is_a_float32_cache_of_the_quantized_values(llms, monkeypatch):
    """The same tokens and log-probabilities as an unquantized engine whose KV writes
    store quantized-and-read-back values (by the checkpoint's scales): every write and read
    of the FP8 cache, decode and prefill, quantizes exactly so. The FP8 engine again, its
    prompts now prefix hits, and one of one-chunk-at-a-time steps whose blocks run out
    (preemption) compute the same."""
    fp8 = llms["fp8"]
    prompts = [STORY, chat_prompt(fp8, "Describe the picture.", [make_image(56, 84, 1)])]
    want = _greedy(fp8, prompts)
    _same(_greedy(fp8, prompts), want)
    assert fp8.engine.get_stats()["prefix_cache_hit_tokens"] > 0
    small = LLM(fp8.engine.config.model_config.model, dtype="float32", device="cpu",
                kv_cache_dtype="fp8", num_kv_blocks=7, max_num_batched_tokens=24,
                enable_prefix_caching=False)
    _same(_greedy(small, prompts), want)
    assert small.engine.get_stats()["num_preemptions"] > 0
    _same(_greedy(_as_quantized(fp8, monkeypatch, num_kv_blocks=64), prompts), want)


@pytest.mark.parametrize("family", ["qwen3.5", "gemma3"])
def test_other_families_compute_the_quantized_cache(family, vlmserve_cache, tmp_path,
                                                    monkeypatch):
    """Qwen3.5 (linear-attention layers beside its own KV write) and Gemma 3 (sliding
    layers on a second KV group, its own attention): the same as their quantized float32
    caches too."""
    model = "tiny-qwen3.5" if family == "qwen3.5" else str(build_tiny("gemma3", tmp_path))
    fp8 = LLM(model, dtype="float32", device="cpu", kv_cache_dtype="fp8", num_kv_blocks=64)
    prompts = [STORY, "Hi."]
    want = _greedy(fp8, prompts, 12)
    _same(_greedy(_as_quantized(fp8, monkeypatch, num_kv_blocks=64), prompts, 12), want)


def test_greedy_decoding_stays_close_to_the_float32_cache(llms):
    """The FP8 engine scores the float32 engine's 64 greedy tokens (prompt log-probabilities
    over prompt + output: each position reads the FP8 cache, as a decode does) within
    `MAX_LOGPROB_DIFF` / `MEAN_LOGPROB_DIFF` of the float32 engine's own scores; its own
    first greedy tokens are the same."""
    auto, fp8 = llms["auto"], llms["fp8"]
    (out,), (own,) = _greedy(auto, [STORY], TOKENS), _greedy(fp8, [STORY], FIRST_TOKENS)
    assert own.token_ids == out.token_ids[:FIRST_TOKENS]
    seq = auto.engine.input_processor.process(STORY).prompt_token_ids + out.token_ids
    score = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0)
    got = {}
    for name, llm in (("auto", auto), ("fp8", fp8)):
        (r,) = llm.generate([{"prompt_token_ids": seq}], score, use_tqdm=False)
        got[name] = torch.tensor([r.prompt_logprobs[i][seq[i]]
                                  for i in range(len(seq) - TOKENS, len(seq))])
    diff = (got["fp8"] - got["auto"]).abs()
    assert diff.max() < MAX_LOGPROB_DIFF and diff.mean() < MEAN_LOGPROB_DIFF, diff
    assert diff.max() > 1e-3  # the cache is quantized


def test_the_transformers_backend_computes_the_quantized_cache(vlmserve_cache, tmp_path,
                                                               monkeypatch):
    """Through the transformers backend (Gemma 3: sliding layers on a second KV group, its
    KV writes and attention the backend's): the same as its quantized float32 cache."""
    from vlmserve.models import transformers_attention

    path = str(build_tiny("gemma3", tmp_path))
    kw = dict(model_impl="transformers", dtype="float32", device="cpu", num_kv_blocks=64)
    fp8 = LLM(path, kv_cache_dtype="fp8", **kw)
    assert all(kv.dtype == torch.float8_e4m3fn for kv in _runner(fp8).kv_caches)
    prompts = [STORY, chat_prompt(fp8, "Describe the picture.", [make_image(56, 84, 1)])]
    want = _greedy(fp8, prompts, 12)
    sim = LLM(path, **kw)
    sim.engine.executor.runner.model.set_kv_cache_scales(_runner(fp8).model.step.kv_scales)
    monkeypatch.setattr(transformers_attention, "write_kv", _quantized_write)
    _same(_greedy(sim, prompts, 12), want)
    monkeypatch.undo()
    auto = _greedy(LLM(path, **kw), prompts, 12)
    assert any(a.logprobs != b.logprobs for a, b in zip(auto, want))  # (it is quantized)
