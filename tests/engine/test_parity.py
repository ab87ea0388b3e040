"""Greedy output token-for-token identical to transformers `generate` on the tiny checkpoints,
through every engine feature: batching, chunked prefill through images, preemption."""

from __future__ import annotations

import os

import pytest
import torch

from tests.engine.helpers import HFOracle, chat_prompt, make_image, mixed_prompts
from vlmserve import LLM, SamplingParams

MAX_TOKENS = 10
# The same parity on the GPU (float32): VLMSERVE_TEST_DEVICE=cuda pytest tests/engine/test_parity.py
DEVICE = os.environ.get("VLMSERVE_TEST_DEVICE", "cpu")
torch.backends.cudnn.allow_tf32 = False
torch.backends.cuda.matmul.allow_tf32 = False
MODELS = {
    "qwen2-vl": ("tiny-qwen2-vl", "Qwen2VLForConditionalGeneration"),
    "qwen2.5-vl": ("tiny-qwen2.5-vl", "Qwen2_5_VLForConditionalGeneration"),
    "qwen3-vl": ("tiny-qwen3-vl", "Qwen3VLForConditionalGeneration"),
    "qwen3-vl-moe": ("tiny-qwen3-vl-moe", "Qwen3VLMoeForConditionalGeneration"),
}


@pytest.fixture(scope="module", params=list(MODELS))
def setup(request, vlmserve_cache):
    name, arch = MODELS[request.param]
    llm = LLM(name, dtype="float32", device=DEVICE)
    from vlmserve.models.builtin import resolve_model

    return name, llm, HFOracle(resolve_model(name), arch, DEVICE)


def check(llm: LLM, oracle: HFOracle, prompts: list[dict], **engine_kwargs) -> LLM:
    if engine_kwargs:
        llm = LLM(llm.engine.config.model_config.model, dtype="float32", device=DEVICE,
                  **engine_kwargs)
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    outs = llm.generate(prompts, params, use_tqdm=False)
    for prompt, out in zip(prompts, outs):
        processed = llm.engine.input_processor.process(prompt)
        assert out.prompt_token_ids == processed.prompt_token_ids
        expected = oracle.generate(processed, MAX_TOKENS)
        assert out.outputs[0].token_ids == expected, f"mismatch for {prompt.get('prompt')!r}"
        assert out.outputs[0].finish_reason == "length"
    llm.engine.step()  # an empty step hands the worker the last frees
    stats = llm.engine.get_stats()
    assert stats["num_free_kv_blocks"] == stats["num_kv_blocks"]
    assert stats["encoder_cache_referenced"] == 0
    assert stats["mm_embedding_entries"] == stats["encoder_cache_entries"]
    if not llm.engine.config.cache_config.enable_mm_cache:
        assert stats["encoder_cache_entries"] == 0
        assert stats["mm_embedding_bytes_host"] == 0
    if not stats["mm_embedding_offload"]:
        assert stats["mm_embedding_bytes_host"] == 0
    return llm


def test_text_only(setup):
    _, llm, oracle = setup
    check(llm, oracle, [chat_prompt(llm, "Write a haiku about the sea.", [])])


def test_one_image(setup):
    _, llm, oracle = setup
    check(llm, oracle, [chat_prompt(llm, "What is this?", [make_image(112, 84, 1)])])


def test_three_images_of_different_sizes(setup):
    _, llm, oracle = setup
    imgs = [make_image(56, 56, 2), make_image(140, 84, 3), make_image(224, 196, 4)]
    check(llm, oracle, [chat_prompt(llm, "Compare the three.", imgs)])


def test_eight_requests_together(setup):
    _, llm, oracle = setup
    check(llm, oracle, mixed_prompts(llm))


@pytest.mark.parametrize("budget", [16, 37, 64])
def test_chunks_cut_through_images(setup, budget):
    _, llm, oracle = setup
    engine = check(llm, oracle, mixed_prompts(llm), max_num_batched_tokens=budget).engine
    assert engine.num_steps > 8


def test_max_num_seqs_smaller_than_requests(setup):
    _, llm, oracle = setup
    check(llm, oracle, mixed_prompts(llm), max_num_seqs=3, max_num_batched_tokens=64)


def test_prefill_capped_while_decoding(setup):
    """New prompts admitted in 13-token chunks beside running decodes (3 slots for 8
    requests), through images: the same tokens."""
    _, llm, oracle = setup
    check(llm, oracle, mixed_prompts(llm), max_num_seqs=3, max_num_batched_tokens=64,
          max_num_prefill_tokens_while_decoding=13)


def test_preemption_keeps_output(setup):
    _, llm, oracle = setup
    engine = check(llm, oracle, mixed_prompts(llm), num_kv_blocks=24, block_size=8,
                   max_num_batched_tokens=128).engine
    assert engine.scheduler.num_preemptions > 0


@pytest.mark.parametrize("budget", [16, 37, 64])
@pytest.mark.parametrize("offload, cache", [(True, True), (True, False), (False, False)])
def test_offload_and_cache_modes(setup, budget, offload, cache):
    _, llm, oracle = setup
    engine = check(llm, oracle, mixed_prompts(llm), max_num_batched_tokens=budget,
                   max_num_seqs=4, mm_embedding_offload=offload, enable_mm_cache=cache).engine
    stats = engine.get_stats()
    if offload:
        assert stats["prefetch_hit_rows"] > 0, "the next-step prediction should mostly hit"
        assert stats["mm_embedding_peak_bytes_device"] == 2 * budget * engine.executor \
            .bytes_per_embedding_row, "only the two ping-pong buffers stay on the device"


def test_same_image_twice_in_a_prompt_and_across_requests(setup):
    _, llm, oracle = setup
    a, b = make_image(112, 84, 21), make_image(84, 112, 22)
    prompts = [chat_prompt(llm, "Twice the same?", [a, b, a]),
               chat_prompt(llm, "And again.", [a]),
               chat_prompt(llm, "Only b.", [b, b])]
    engine = check(llm, oracle, prompts, max_num_batched_tokens=16, max_num_seqs=2,
                   mm_embedding_offload=True).engine
    stats = engine.get_stats()
    assert stats["num_images_encoded"] == 2  # a and b, once each


def test_mm_processor_kwargs_per_request_and_per_engine(setup):
    """One image processed two ways (a request's own `mm_processor_kwargs`, and the
    engine's), in one batch, twice: two encodes, neither output taking the other's rows
    (prefix cache, encoder cache), each equal to transformers; an engine given the options
    itself answers as the request that gave them."""
    name, llm, oracle = setup
    img = make_image(224, 196, 7)
    base = chat_prompt(llm, "Describe it.", [img])
    small = {**base, "mm_processor_kwargs": {"max_pixels": 112 * 112}}
    assert (len(llm.engine.input_processor.process(small).prompt_token_ids)
            < len(llm.engine.input_processor.process(base).prompt_token_ids))
    engine = check(llm, oracle, [base, small, small, base], max_num_batched_tokens=64).engine
    assert engine.get_stats()["num_images_encoded"] == 2
    check(llm, oracle, [small, base])  # the second time from the caches
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    capped = LLM(name, dtype="float32", device=DEVICE,
                 mm_processor_kwargs={"max_pixels": 112 * 112})
    assert ([o.outputs[0].token_ids for o in capped.generate([base], params, use_tqdm=False)]
            == [o.outputs[0].token_ids for o in llm.generate([small], params, use_tqdm=False)])


def test_everything_at_once(setup):
    """Chunking through images, few sequences, preemption, offload and the cache together."""
    _, llm, oracle = setup
    engine = check(llm, oracle, mixed_prompts(llm) + mixed_prompts(llm)[:3],
                   max_num_batched_tokens=37, max_num_seqs=5, num_kv_blocks=24, block_size=8,
                   mm_embedding_offload=True).engine
    assert engine.scheduler.num_preemptions > 0


def test_compiled_fused_ops(setup, monkeypatch):
    """torch.compile'd norm/rotary/SiLU (what CUDA decode graphs capture) change nothing: one
    prompt with an image, so the tower's ops and the decoder's run at prefill and at decode
    sizes, each traced whole (fullgraph) with dynamic sizes, the KV write as a mutation. On
    the CPU the graphs run through AOTAutograd's eager backend: the same capture and
    functionalization as inductor's, without minutes of C++ code generation on 2 cores
    (inductor itself runs in tests/gpu/test_warmup_gpu.py)."""
    name, llm, oracle = setup
    if name != "tiny-qwen2-vl":
        pytest.skip("one model is enough: the compiled functions are shared")
    traced: list[str] = []
    if DEVICE == "cpu":
        real, aot_eager = torch.compile, torch._dynamo.lookup_backend("aot_eager")

        def compile_(fn, **kwargs):
            def backend(graph, inputs):
                traced.append(fn.__name__)
                return aot_eager(graph, inputs)

            return real(fn, **{**kwargs, "backend": backend})

        monkeypatch.setattr(torch, "compile", compile_)
    prompt = chat_prompt(llm, "What is this?", [make_image(56, 84, 5)])
    check(llm, oracle, [prompt], fused_ops="compile")
    if DEVICE == "cpu":
        assert set(traced) == {"rms_norm", "add_rms_norm", "layer_norm", "add_layer_norm",
                               "silu_mul", "rotary_qk_cache", "rotary_qk_float32",
                               "quick_gelu"}, traced
