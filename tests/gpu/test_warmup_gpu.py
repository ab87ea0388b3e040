"""GPU only: after `UniprocExecutor.warmup()`, a mixed workload (images of several sizes,
chunked prefills, decodes beside them, batches past the largest CUDA graph, a long context
that splits decode attention) compiles no new Triton kernel variant and, with
`fused_ops="compile"`, no new torch.compile graph; the greedy tokens equal those of an engine
that was not warmed up. Run on the GPU machine: `python -m pytest tests/gpu/test_warmup_gpu.py`.
"""

from __future__ import annotations

import pytest
import torch

from tests.engine.helpers import chat_prompt, make_image, mixed_prompts
from vlmserve import LLM, SamplingParams

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def compiled_variants() -> dict[str, int]:
    """Compiled variants held by each Triton kernel of the engine (all devices)."""
    from triton.runtime.jit import JITFunction

    from vlmserve.layers import triton_attention, triton_ops

    counts = {}
    for module in (triton_attention, triton_ops):
        for name, fn in vars(module).items():
            if isinstance(fn, JITFunction):
                counts[name] = sum(len(caches[0]) for caches in fn.device_caches.values())
    return counts


def compiled_graphs() -> int:
    from torch._dynamo.utils import counters

    return counters["stats"]["unique_graphs"]


def workload(llm: LLM) -> tuple[list, list[SamplingParams]]:
    prompts = mixed_prompts(llm) * 3
    prompts += [chat_prompt(llm, f"Picture {i}.", [make_image(w, h, 100 + i)])
                for i, (w, h) in enumerate([(448, 448), (224, 336), (56, 56), (672, 280)])]
    prompts.append(chat_prompt(llm, "story " * 700, []))  # long context: split decode
    params = [SamplingParams(max_tokens=1 + 7 * i % 40, temperature=0.0, ignore_eos=True)
              for i in range(len(prompts))]
    return prompts, params


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
@pytest.mark.parametrize("fused_ops", ["triton", "compile"])
def test_no_compilation_after_warmup(vlmserve_cache, dtype, fused_ops):
    kw = dict(dtype=dtype, device="cuda", max_num_seqs=20, max_num_batched_tokens=512,
              attention_backend="triton", vision_attention_backend="triton",
              fused_ops=fused_ops)
    warm = LLM("tiny-qwen2-vl", **kw)
    seconds = warm.engine.executor.warmup()
    variants, graphs = compiled_variants(), compiled_graphs()
    assert variants["_paged_attn_kernel"] > 0 and variants["_varlen_attn_kernel"] > 0
    prompts, params = workload(warm)
    outs = warm.generate(prompts, params, use_tqdm=False)
    new = {k: v - variants.get(k, 0) for k, v in compiled_variants().items()
           if v != variants.get(k, 0)}
    assert not new, f"compiled after a {seconds:.1f} s warm-up: {new}"
    assert compiled_graphs() == graphs
    assert warm.engine.executor.runner.num_graph_steps > 0

    cold = LLM("tiny-qwen2-vl", **kw)
    want = cold.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in want]
