"""GPU only: launching a step never waits for the device. A blocking host-to-device copy (or a
read of a device value) inside a launch makes the host wait for everything queued before it
(the previous step, this step's vision tower), and the device then idles while the host
launches the rest: on the H200 such waits made a served image step's host launch as long as
its device time. Torch's sync debug mode turns every such wait into an error."""

from __future__ import annotations

import pytest
import torch

from tests.engine.helpers import chat_prompt, make_image, mixed_prompts
from vlmserve import LLM, SamplingParams

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.mark.parametrize("offload", [False, True])
@pytest.mark.parametrize("model", ["tiny-qwen2-vl", "tiny-qwen2.5-vl", "tiny-qwen3-vl",
                                   "tiny-qwen3-vl-moe", "tiny-qwen3.5"])
def test_step_launch_never_waits_for_the_device(vlmserve_cache, model, offload):
    llm = LLM(model, dtype="float32", device="cuda", max_num_seqs=8,
              max_num_batched_tokens=64, mm_embedding_offload=offload)
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    llm.generate(mixed_prompts(llm), params, use_tqdm=False)  # every shape met once, unchecked
    runner = llm.engine.executor.runner
    launch = runner.execute_model
    checked = {"steps": 0, "images": 0, "mixed": 0}

    def strict(so):
        torch.cuda.set_sync_debug_mode("error")
        try:
            result = launch(so)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        n = so.num_scheduled_tokens.values()
        checked["steps"] += 1
        checked["images"] += len(so.encoder_inputs)
        checked["mixed"] += bool(so.encoder_inputs) and any(k == 1 for k in n)
        return result

    runner.execute_model = strict
    # new images (fresh hashes: encoded again), long enough prompts to chunk beside decodes
    prompts = [chat_prompt(llm, f"Look again at picture {i} and describe every detail of it.",
                           [make_image(56 + 28 * (i % 3), 84, 500 + i)]) for i in range(12)]
    # greedy, and sampled rows of every kind beside them (temperature, top-k, top-p, seeds)
    sampled = [SamplingParams(max_tokens=8, temperature=0.8, top_k=[-1, 20][i % 2],
                              top_p=[1.0, 0.9][i // 2 % 2], seed=[None, i][i // 4 % 2],
                              ignore_eos=True) for i in range(8)]
    outs = llm.generate(prompts, [params] * 4 + sampled, use_tqdm=False)
    assert all(len(o.outputs[0].token_ids) == 8 for o in outs)
    assert checked["images"] == 12 and checked["mixed"] > 0, checked


@pytest.mark.parametrize("model", ["tiny-qwen2-vl", "tiny-qwen2.5-vl", "tiny-qwen3-vl"])
def test_transformers_backend_towers_never_wait_for_the_device(vlmserve_cache, model):
    """The transformers backend's vision part of a Qwen model: its grids read on the host
    (`models/transformers_grids.py`), the tower's launch never waits for the device, and the
    tower keeps them there (no fallback to device grids)."""
    llm = LLM(model, dtype="float32", device="cuda", model_impl="transformers",
              max_num_seqs=8, max_num_batched_tokens=512)
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    llm.generate(mixed_prompts(llm), params, use_tqdm=False)  # every shape met once, unchecked
    model_ = llm.engine.executor.runner.model
    encode, calls = model_.encode_images, []

    def strict(*args, **kwargs):
        torch.cuda.set_sync_debug_mode("error")
        try:
            return encode(*args, **kwargs)
        finally:
            torch.cuda.set_sync_debug_mode("default")
            calls.append(1)

    model_.encode_images = strict
    prompts = [chat_prompt(llm, f"Picture {i}.", [make_image(56 + 28 * (i % 3), 84, 700 + i)])
               for i in range(6)]
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert all(len(o.outputs[0].token_ids) == 4 for o in outs)
    assert calls and model_.grids.on


@pytest.mark.parametrize("offload", [False, True])
def test_served_size_steps_launch_ahead_of_a_sleeping_device(vlmserve_cache, offload):
    """Waits below torch, which its sync debug mode cannot see: a copy from pageable host
    memory, which the driver "may" stage after synchronizing with the stream (CUDA's API
    synchronization notes), or any other blocking driver call. Before each launch the device
    is given about a second of sleep; when the launch returns, the sleep must still be
    running. The steps are as large as a served step's: 32 images of 1,024 patches and about
    9,000 prompt tokens (host inputs of hundreds of kilobytes)."""
    llm = LLM("tiny-qwen2-vl", dtype="float32", device="cuda", max_num_seqs=32,
              max_num_batched_tokens=16384, mm_embedding_offload=offload,
              enable_prefix_caching=False)
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)

    def prompts(seed: int) -> list[dict]:
        return [chat_prompt(llm, f"Compare picture {i} with the next one in every detail.",
                            [make_image(448, 448, seed + 2 * i),
                             make_image(448, 448, seed + 2 * i + 1)]) for i in range(16)]

    llm.generate(prompts(0), params, use_tqdm=False)  # the same shapes met once, unchecked
    runner = llm.engine.executor.runner
    launch = runner.execute_model
    waited, checked = [], {"steps": 0, "images": 0}

    def asleep(so):
        torch.cuda._sleep(1 << 31)  # about a second of the device's clock
        slept = torch.cuda.Event()
        slept.record()
        result = launch(so)
        if slept.query():  # the sleep ended before the launch returned: the launch waited
            waited.append((len(so.encoder_inputs), sum(so.num_scheduled_tokens.values())))
        checked["steps"] += 1
        checked["images"] += len(so.encoder_inputs)
        return result

    runner.execute_model = asleep
    outs = llm.generate(prompts(1000), params, use_tqdm=False)
    assert all(len(o.outputs[0].token_ids) == 4 for o in outs)
    assert checked["images"] == 32 and not waited, (waited, checked)
