"""The benchmarks' synthetic requests fit every model family's chat format: Qwen's (as it
always was, no system turn) and the LLaVA ones (from the tokenizer's chat template)."""

from __future__ import annotations

import pytest

from vlmserve import LLM, SamplingParams
from vlmserve.benchmarks.datasets import random_mm


@pytest.mark.parametrize("model,head", [
    ("tiny-qwen2-vl", "<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>"),
    ("tiny-llava-1.5", "USER: <image>\n<image>\n"),
    ("tiny-llava-next", "[INST] <image>\n<image>\n"),
])
def test_random_mm_requests_run_on_every_family(vlmserve_cache, model, head) -> None:
    llm = LLM(model, dtype="float32", device="cpu", max_model_len=2048)
    reqs = random_mm(llm.get_tokenizer(), num_requests=3, image_sizes=[84, 112],
                     images_per_request=2, prompt_len=8, output_len=3)
    assert head in llm.get_tokenizer().decode(reqs[0].prompt["prompt_token_ids"])
    outs = llm.generate([r.prompt for r in reqs], SamplingParams(max_tokens=3, ignore_eos=True),
                        use_tqdm=False)
    assert [len(o.outputs[0].token_ids) for o in outs] == [3, 3, 3]
