"""GPU only: engines sharing one GPU each take their gpu_memory_utilization share of it (what
they took since their start, not the memory the others hold), and one asking for more than
the GPU has free is refused at start with a line naming the setting (`utils.DeviceShare`).
Run on the GPU machine: `python -m pytest tests/gpu/test_memory_share.py`."""

from __future__ import annotations

import gc

import pytest
import torch

from vlmserve import LLM, SamplingParams

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

MODEL = "qwen2-vl-2b-random"  # big enough blocks that the share, not max_num_seqs, sizes them


def test_two_engines_on_one_gpu_get_equal_shares_and_a_third_is_refused():
    kw = dict(gpu_memory_utilization=0.3, enforce_eager=True, kernel_warmup=False)
    # blocks torch's allocator holds free when the first engine starts are free for it
    # too: what it takes of them counts against its share
    held = torch.empty(4 << 30, dtype=torch.uint8, device="cuda")
    del held
    first = LLM(MODEL, **kw)
    second = LLM(MODEL, **kw)
    blocks = [llm.engine.executor.num_kv_blocks for llm in (first, second)]
    assert abs(blocks[0] - blocks[1]) <= 0.02 * blocks[0], blocks
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    outs = [llm.generate(["A GPU shared by two engines"], params, use_tqdm=False)[0]
            for llm in (first, second)]
    assert outs[0].outputs[0].token_ids == outs[1].outputs[0].token_ids
    free, total = torch.cuda.mem_get_info()
    assert free < 0.5 * total
    with pytest.raises(RuntimeError, match="less than gpu_memory_utilization=0.5"):
        LLM(MODEL, gpu_memory_utilization=0.5, enforce_eager=True, kernel_warmup=False)
    for llm in (first, second):
        llm.engine.shutdown()
    del first, second, outs
    gc.collect()
    torch.cuda.empty_cache()
