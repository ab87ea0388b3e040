"""Tensor parallelism on the CPU: ranks in separate processes over gloo, each loading only its
share of the checkpoint, give the same greedy tokens as one process (and so as transformers),
for both model families; what a rank holds is measured in its process."""

from __future__ import annotations

import os

import pytest

from tests.distributed.helpers import one_process, token_ids
from vlmserve import LLM, SamplingParams, StructuredOutputsParams


# Qwen2.5-VL's decoder is Qwen2-VL's, and Qwen3-VL-MoE holds all of Qwen3-VL's decoder (q/k
# norms, DeepStack rows, interleaved mRoPE) plus its experts; their towers under tensor
# parallelism are in test_vision_weights_mode.py
@pytest.mark.parametrize("model", ["tiny-qwen2-vl", "tiny-qwen3-vl-moe"])
def test_tp2_matches_single_process(vlmserve_cache, model):
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    kw = dict(dtype="float32", device="cpu", max_num_batched_tokens=37, max_num_seqs=4)
    single, prompts, expected = one_process(model, params, **kw)
    # structured outputs: rank 0 masks (its tokens are every rank's), the others do not
    structured = [SamplingParams(max_tokens=24, temperature=0.0, structured_outputs=so)
                  for so in (StructuredOutputsParams(regex=r"[a-c]{2}-\d{3}"),
                             StructuredOutputsParams(choice=["left", "right"]))] * 2
    want = token_ids(single, prompts[:4], structured)
    # prompt logprobs: the vocabulary-parallel head's logits, gathered on every rank alike
    scoring = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True, prompt_logprobs=2)
    scores = [o.prompt_logprobs for o in single.generate(prompts, scoring, use_tqdm=False)]
    tp = LLM(model, tensor_parallel_size=2, **kw)
    try:
        runner = tp.engine.executor.runner
        attn = runner.model.language_model.layers[0].self_attn
        assert (attn.heads, attn.kv_heads) == (2, 1)  # 4 heads / 2 KV heads split over 2
        if model.endswith("moe"):  # every expert's 48 intermediate columns split over 2
            experts = runner.model.language_model.layers[0].mlp.experts
            assert experts.gate_up_proj.shape == (8, 2 * 24, 64)
            assert experts.down_proj.shape == (8, 64, 24)
        outs = tp.generate(prompts, params, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outs] == expected
        enc = runner.encoder  # data mode (the default): rank 0 encoded only its share
        assert enc.tp is not None and 0 < enc.num_own_images < enc.num_images
        encoded = tp.engine.get_stats()["num_images_encoded"]
        again = tp.generate(prompts, params, use_tqdm=False)  # prefix caching across ranks
        assert [o.outputs[0].token_ids for o in again] == expected
        stats = tp.engine.get_stats()
        assert stats["prefix_cache_hit_tokens"] > 0 and stats["num_images_encoded"] == encoded
        assert stats["num_free_kv_blocks"] == stats["num_kv_blocks"]
        assert token_ids(tp, prompts[:4], structured) == want
        assert runner.grammars is not None  # rank 0's (the followers' runners have none)
        for got, ref in zip(tp.generate(prompts, scoring, use_tqdm=False), scores, strict=True):
            assert len(got.prompt_logprobs) == len(ref) and got.prompt_logprobs[0] is None
            for a, b in zip(got.prompt_logprobs[1:], ref[1:]):
                assert list(a) == list(b) and list(a.values()) == pytest.approx(
                    list(b.values()), abs=1e-4)
    finally:
        tp.engine.shutdown()


def test_expert_parallel_matches_single_process(vlmserve_cache):
    """`enable_expert_parallel`: each of 2 ranks holds 4 of the 8 experts whole (the dense
    layer and attention split as usual); the same greedy tokens as one process."""
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    kw = dict(dtype="float32", device="cpu", max_num_batched_tokens=37, max_num_seqs=4)
    _, prompts, expected = one_process("tiny-qwen3-vl-moe", params, **kw)
    ep = LLM("tiny-qwen3-vl-moe", tensor_parallel_size=2, enable_expert_parallel=True, **kw)
    try:
        layers = ep.engine.executor.runner.model.language_model.layers
        experts = layers[0].mlp.experts
        assert experts.gate_up_proj.shape == (4, 2 * 48, 64) and experts.expert_start == 0
        assert layers[1].mlp.gate_up_proj.weight.shape == (128, 64)  # dense: columns split
        outs = ep.generate(prompts, params, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outs] == expected
    finally:
        ep.engine.shutdown()


def test_tp4_replicates_kv_heads(vlmserve_cache):
    """4 ranks, 2 KV heads: each KV head lives on two ranks, each rank has one query head;
    with the start-up warm-up on every rank."""
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    kw = dict(dtype="float32", device="cpu", max_num_batched_tokens=64)
    _, prompts, expected = one_process("tiny-qwen2-vl", params, count=4, **kw)
    # every rank runs the start-up warm-up: its steps' collectives must pair up across ranks
    tp = LLM("tiny-qwen2-vl", tensor_parallel_size=4, kernel_warmup=True, **kw)
    try:
        attn = tp.engine.executor.runner.model.language_model.layers[0].self_attn
        assert (attn.heads, attn.kv_heads) == (1, 1)
        outs = tp.generate(prompts, params, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outs] == expected
    finally:
        tp.engine.shutdown()


def test_tp_must_divide_heads(vlmserve_cache):
    with pytest.raises(ValueError, match="must divide"):
        LLM("tiny-qwen2-vl", dtype="float32", device="cpu", tensor_parallel_size=3)


def test_row_parallel_bias_is_added_once_after_the_sum():
    """Two ranks' halves of an o_proj with a bias (Llama's `attention_bias`): the bias is
    added after the all-reduce, once, so the sum equals the whole layer."""
    import torch

    from vlmserve.layers.tensor_parallel import RowParallelLinear

    class _Sum:  # the all-reduce of two ranks, both computed here
        def __init__(self) -> None:
            self.parts: list[torch.Tensor] = []

        def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
            self.parts.append(x)
            return x

    torch.manual_seed(0)
    x, w, b = torch.randn(3, 8), torch.randn(5, 8), torch.randn(5)
    tp = _Sum()
    halves = [RowParallelLinear(4, 5, True, tp) for _ in range(2)]
    for i, layer in enumerate(halves):
        with torch.no_grad():
            layer.weight.copy_(w[:, i * 4:(i + 1) * 4])
            layer.bias.copy_(b)
        layer(x[:, i * 4:(i + 1) * 4])
    total = tp.parts[0] + tp.parts[1] + b
    torch.testing.assert_close(total, x @ w.T + b)


@pytest.mark.parametrize("model", ["tiny-llava-1.5", "tiny-llava-next"])
def test_tp2_llava_matches_single_process(vlmserve_cache, model):
    from tests.engine.helpers import make_image

    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    kw = dict(dtype="float32", device="cpu", max_num_batched_tokens=64, max_num_seqs=4)
    convs = [[{"role": "user", "content": [{"type": "image", "image": make_image(w, h, i)},
                                           {"type": "text", "text": "Describe."}]}]
             for i, (w, h) in enumerate([(84, 84), (120, 60)])]
    convs.append([{"role": "user", "content": "Just text."}])
    single = LLM(model, **kw)
    expected = [o.outputs[0].token_ids for o in single.chat(convs, params, use_tqdm=False)]
    # the vision tower replicated on both ranks (the default, data mode, runs in the Qwen tests)
    tp = LLM(model, tensor_parallel_size=2, mm_encoder_tp_mode="replicate", **kw)
    try:
        outs = tp.chat(convs, params, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outs] == expected
        enc = tp.engine.executor.runner.encoder
        assert enc.tp is None and enc.num_own_images == enc.num_images > 0
    finally:
        tp.engine.shutdown()


def test_a_dead_rank_stops_the_engine_with_an_error_not_a_hang(vlmserve_cache):
    """The rank's exit is noticed and named (not the 20 s collective timeout's error)."""
    import os
    import signal

    from vlmserve.distributed.parallel_state import RankFailedError

    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    tp = LLM("tiny-qwen2-vl", tensor_parallel_size=2, dtype="float32", device="cpu",
             max_num_batched_tokens=64, tp_timeout=20)
    try:
        assert len(tp.generate(["Hello"], params, use_tqdm=False)[0].outputs[0].token_ids) == 4
        rank1 = tp.engine.executor.followers.procs[0]
        os.kill(rank1.pid, signal.SIGKILL)
        rank1.join(10)
        with pytest.raises(RankFailedError, match=r"rank 1 \(pid \d+\) exited with code -9"):
            tp.generate(["Hello again"], params, use_tqdm=False)
    finally:
        tp.engine.shutdown()


def test_every_rank_takes_rank0s_tokens(vlmserve_cache, monkeypatch):
    """Rank 1's sampler sees other logits (fault injection: reversed); its tokens would
    differ, but every rank uses rank 0's, so the output equals one process's."""
    from pathlib import Path

    faults = str(Path(__file__).parents[1] / "e2e" / "fault_injection")
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(
        [faults, *filter(None, [os.environ.get("PYTHONPATH")])]))
    monkeypatch.setenv("VLMSERVE_PERTURB_RANK", "1")
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    kw = dict(dtype="float32", device="cpu", max_num_batched_tokens=64, max_num_seqs=4)
    prompts = ["One.", "Two three.", "Four five six."]
    expected = token_ids(LLM("tiny-qwen2-vl", **kw), prompts, params)
    tp = LLM("tiny-qwen2-vl", tensor_parallel_size=2, **kw)
    try:
        assert token_ids(tp, prompts, params) == expected
    finally:
        tp.engine.shutdown()


def _wide_lm_checkpoint(path):
    """tiny-qwen2-vl's tokenizer, processor and vision tower with a language model 60 times
    larger (hidden 256, MLP 1024, 4 layers): the language model is ~97% of the weights."""
    import torch
    import transformers

    from vlmserve.models.builtin import create_checkpoint

    create_checkpoint("tiny-qwen2-vl", path)
    config = transformers.AutoConfig.from_pretrained(path)
    text = config.text_config
    text.hidden_size, text.intermediate_size, text.num_hidden_layers = 256, 1024, 4
    text.num_attention_heads, text.num_key_value_heads = 16, 4  # head_dim stays 16
    text.layer_types = ["full_attention"] * 4
    config.vision_config.hidden_size = 256  # the merger's output: the LM's width
    torch.manual_seed(0)
    for f in path.glob("*.safetensors"):
        f.unlink()
    transformers.Qwen2VLForConditionalGeneration(config).save_pretrained(path)
    return path


_LOAD_STATS = """
import dataclasses, json, sys
from vlmserve import LLM, SamplingParams, StructuredOutputsParams
llm = LLM(sys.argv[1], tensor_parallel_size=int(sys.argv[2]), dtype="float32", device="cpu",
          max_num_batched_tokens=64, max_num_seqs=2, max_model_len=256)
ex = llm.engine.executor
stats = getattr(ex, "rank_load_stats", None) or [ex.load_stats]
out = llm.generate(["Hello"], SamplingParams(max_tokens=2, temperature=0.0), use_tqdm=False)
assert len(out[0].outputs[0].token_ids) == 2
llm.engine.shutdown()
print(json.dumps([dataclasses.asdict(s) for s in stats]))
"""


def test_sharded_loading_holds_about_half_the_weights_per_rank(vlmserve_cache, tmp_path):
    """Each TP=2 rank reads only its slices and allocates only them: its parameters and
    buffers, and the peak rise of its anonymous resident memory during the load (measured in
    each rank's process; fresh processes, as a server's), are below 0.6x of TP=1's."""
    import json
    import subprocess
    import sys

    path = _wide_lm_checkpoint(tmp_path / "wide-lm")

    def load_stats(tp: int) -> list[dict]:
        run = subprocess.run([sys.executable, "-c", _LOAD_STATS, str(path), str(tp)],
                             capture_output=True, text=True, timeout=120)
        assert run.returncode == 0, run.stderr[-3000:]
        return json.loads(run.stdout.splitlines()[-1])

    (single,), ranks = load_stats(1), load_stats(2)
    assert single["weight_bytes"] > 15e6
    # the measure sees the load (less what the allocator already held resident and reused:
    # up to 3.5 of these 16 MB in a freshly installed environment)
    assert single["peak_rss_delta"] >= 0.6 * single["weight_bytes"]
    assert len(ranks) == 2
    for rank in ranks:
        assert rank["weight_bytes"] < 0.6 * single["weight_bytes"], (rank, single)
        assert rank["peak_rss_delta"] < 0.6 * single["peak_rss_delta"], (rank, single)


def test_shard_plan_slices_and_a_padded_vocabulary_shard(tmp_path):
    """Checkpoint slices per rank (GQA with replicated KV heads, row-parallel columns), and
    a vocabulary that 4 ranks do not divide: the last shard is zero-padded, the embedding
    sums to the whole table's rows and the gathered logits are the whole head's."""
    import torch
    from safetensors.torch import save_file
    from transformers import Qwen2Config

    from vlmserve.layers.tensor_parallel import (
        ParallelLMHead,
        ShardPlan,
        TensorSlice,
        VocabParallelEmbedding,
    )
    from vlmserve.models.loader import iter_safetensors

    cfg = Qwen2Config(hidden_size=16, intermediate_size=32, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=10)
    plans = [ShardPlan.for_config(cfg, r, 4) for r in range(4)]
    assert [p.slice_for("model.layers.3.self_attn.k_proj.weight") for p in plans] == [
        TensorSlice(0, 0, 4, 4)] * 2 + [TensorSlice(0, 4, 8, 4)] * 2  # head_dim 4
    assert plans[2].slice_for("layers.0.self_attn.o_proj.weight") == TensorSlice(1, 8, 12, 4)
    assert plans[1].slice_for("language_model.model.layers.0.mlp.down_proj.weight") == \
        TensorSlice(1, 8, 16, 8)
    assert plans[1].slice_for("model.layers.0.self_attn.o_proj.bias") is None
    assert plans[1].slice_for("model.norm.weight") is None
    assert [p.slice_for("lm_head.weight") for p in plans][3] == TensorSlice(0, 9, 10, 3)

    torch.manual_seed(0)
    table, x = torch.randn(10, 16), torch.randn(3, 16)
    save_file({"lm_head.weight": table}, str(tmp_path / "w.safetensors"))

    class _Group:  # four ranks' collectives, computed here one rank at a time
        world_size = 4

        def all_reduce(self, t):
            return t

        def all_gather(self, parts, t):
            for i, p in enumerate(parts):
                p.copy_(logits[i])
            return parts

    group, embeds, logits = _Group(), [], []
    ids = torch.tensor([0, 9, 5, 8])
    for plan in plans:
        (_, w), = iter_safetensors(tmp_path, slice_for=plan.slice_for)
        assert w.shape == (3, 16)
        emb = VocabParallelEmbedding(3, 16, plan.vocab_start, group)
        emb.weight.data.copy_(w)
        embeds.append(emb(ids))
        logits.append(x @ w.T)
    assert torch.equal(logits[3][:, 1:], torch.zeros(3, 2))  # the padding rows
    torch.testing.assert_close(sum(embeds), table[ids], rtol=0, atol=0)
    head = ParallelLMHead(torch.nn.Parameter(torch.zeros(3, 16)), 10, group)
    torch.testing.assert_close(head(x), x @ table.T)
