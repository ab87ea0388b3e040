"""A step that raises fails the request that caused it, not the engine or its neighbours
(issue 21): the real engine on the tiny model, with a fault injected into the sampler or the
vision encoder for one request's input."""

from __future__ import annotations

import pytest
import torch

import vlmserve.worker.model_runner as model_runner
from tests.engine.helpers import chat_prompt, make_image, mixed_prompts
from vlmserve import LLM, SamplingParams
from vlmserve.engine.core import MAX_FAILED_STEPS_IN_A_ROW
from vlmserve.worker.encoder_runner import EncoderRunner

POISON_SEED = 666


@pytest.fixture(scope="module")
def llm(vlmserve_cache):
    return LLM("tiny-qwen2-vl", dtype="float32", device="cpu", max_num_batched_tokens=128)


def greedy(n=10):
    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)


def poison():
    return SamplingParams(max_tokens=10, temperature=1.0, seed=POISON_SEED, ignore_eos=True)


@pytest.fixture
def poisoned_sampler(monkeypatch):
    """The sampler raises for any batch holding a request seeded POISON_SEED."""
    real = model_runner.sample
    calls = {"failed": 0}

    def sample(logits, params, *rest):
        if any(p.seed == POISON_SEED for p in params):
            calls["failed"] += 1
            raise RuntimeError("injected sampler fault")
        return real(logits, params, *rest)

    monkeypatch.setattr(model_runner, "sample", sample)
    return calls


def _clean(llm) -> None:
    llm.engine.step()  # an empty step hands the worker what was freed last
    s = llm.engine.get_stats()
    assert s["num_running"] == s["num_waiting"] == 0
    assert s["num_free_kv_blocks"] == s["num_kv_blocks"]
    assert s["encoder_cache_referenced"] == 0
    assert s["mm_embedding_entries"] == s["encoder_cache_entries"]
    assert not llm.engine.core.scheduler._suspects


def test_a_failing_request_fails_alone_and_its_batch_is_unchanged(llm, poisoned_sampler):
    prompts = mixed_prompts(llm)
    expected = [o.outputs[0].token_ids for o in llm.generate(prompts, greedy(), use_tqdm=False)]
    bad = chat_prompt(llm, "Poison.", [make_image(84, 84, 99)])
    outs = llm.generate(prompts[:4] + [bad] + prompts[4:], [greedy()] * 4 + [poison()]
                        + [greedy()] * 4, use_tqdm=False)
    failed = outs.pop(4)
    assert failed.finished and failed.outputs[0].finish_reason == "error"
    assert [o.outputs[0].finish_reason for o in outs] == ["length"] * 8
    assert [o.outputs[0].token_ids for o in outs] == expected  # greedy output unchanged
    # one failed batch, then the poisoned request failed again alone; nobody else failed
    assert poisoned_sampler["failed"] == 2
    assert llm.engine.core.scheduler.num_failed_steps == 2
    _clean(llm)
    again = llm.generate(prompts[:2], greedy(), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in again] == expected[:2]


def test_a_request_failing_alone_fails_at_once(llm, poisoned_sampler):
    bad = chat_prompt(llm, "Alone.", [])
    out = llm.generate(bad, poison(), use_tqdm=False)[0]
    assert out.outputs[0].finish_reason == "error" and poisoned_sampler["failed"] == 1
    _clean(llm)


def test_a_failing_image_is_not_left_in_the_encoder_cache(vlmserve_cache, monkeypatch):
    """The encoder raises on one image; the images encoded with it in that step are
    forgotten, so a later request with one of them encodes it again instead of reading
    rows the store never got."""
    llm = LLM("tiny-qwen2-vl", dtype="float32", device="cpu", max_num_batched_tokens=256,
              enable_mm_cache=True)
    bad_img, good_img = make_image(140, 84, 5), make_image(56, 112, 6)
    bad_grid = llm.engine.input_processor.process(chat_prompt(llm, "x", [bad_img])
                                                  ).images[0].encoder_meta
    real = EncoderRunner.run

    def run(self, inputs):
        if any(tuple(img.encoder_meta) == tuple(bad_grid) for img in inputs.values()):
            raise RuntimeError("injected encoder fault")
        return real(self, inputs)

    monkeypatch.setattr(EncoderRunner, "run", run)
    good = chat_prompt(llm, "Good.", [good_img])
    outs = llm.generate([good, chat_prompt(llm, "Bad.", [bad_img])], greedy(), use_tqdm=False)
    assert [o.outputs[0].finish_reason for o in outs] == ["length", "error"]
    monkeypatch.setattr(EncoderRunner, "run", real)
    reference = LLM("tiny-qwen2-vl", dtype="float32", device="cpu",
                    max_num_batched_tokens=256).generate(good, greedy(), use_tqdm=False)
    assert outs[0].outputs[0].token_ids == reference[0].outputs[0].token_ids
    assert llm.generate(good, greedy(), use_tqdm=False)[0].outputs[0].token_ids == \
        reference[0].outputs[0].token_ids
    _clean(llm)


def test_an_engine_that_fails_every_step_stops(vlmserve_cache, monkeypatch):
    llm = LLM("tiny-qwen2-vl", dtype="float32", device="cpu", max_num_batched_tokens=128)

    def broken(*_):
        raise RuntimeError("the device is gone")

    monkeypatch.setattr(model_runner, "sample", broken)
    prompts = [chat_prompt(llm, f"Q{i}.", []) for i in range(MAX_FAILED_STEPS_IN_A_ROW + 4)]
    with pytest.raises(RuntimeError, match="steps failed in a row"):
        llm.generate(prompts, greedy(), use_tqdm=False)


def test_seeded_sampling_after_a_failure_uses_a_valid_generator(llm, poisoned_sampler):
    """Innocent sampled requests of a failed batch keep sampling (from a live generator)."""
    prompts = [chat_prompt(llm, f"Seeded {i}.", []) for i in range(3)]
    params = [SamplingParams(max_tokens=6, temperature=1.0, seed=i, ignore_eos=True)
              for i in range(3)]
    outs = llm.generate(prompts + [chat_prompt(llm, "P.", [])], params + [poison()],
                        use_tqdm=False)
    assert [o.outputs[0].finish_reason for o in outs] == ["length"] * 3 + ["error"]
    assert all(len(o.outputs[0].token_ids) == 6 for o in outs[:3])
    assert torch.is_grad_enabled()  # the failure left no inference_mode behind
    _clean(llm)
