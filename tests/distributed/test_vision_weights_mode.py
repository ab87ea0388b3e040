"""Tensor parallelism, the vision tower's weights mode (`mm_encoder_tp_mode="weights"`): the
image encoder (tower and projector / merger) split across the ranks like the language model
(attention heads, MLP columns, all-reduced on the same group), every rank encoding every
image. Two ranks in real processes over gloo give one process's greedy tokens for every
model family, with chunked prefill cutting through images; each rank holds about half of
the tower (its load stats, measured in its process); a TP size that does not divide the
vision heads is refused with a clear error."""

from __future__ import annotations

import pytest
import torch

from tests.distributed.helpers import one_process
from vlmserve import LLM, SamplingParams
from vlmserve.models.builtin import resolve_model
from vlmserve.models.loader import build_model, load_hf_config, weight_bytes

CPU = torch.device("cpu")


class _Rank:
    """What building a rank's model reads of its group (the build runs no collective)."""

    def __init__(self, rank: int, world_size: int) -> None:
        self.rank, self.world_size = rank, world_size


def _encoder_layer_bytes(model: torch.nn.Module) -> int:
    """Bytes of the image encoder's parameters past its patch embedding (the blocks and the
    projector / merger: what weights mode splits, but for norms and the biases added after an
    all-reduce; the patch embedding, a large share of a tiny tower, stays whole)."""
    return sum(p.numel() * p.element_size() for name, p in model.named_parameters()
               if not name.startswith(("language_model.", "lm_head."))
               and ".patch_embed." not in name and ".embeddings." not in name)


@pytest.mark.parametrize("model", ["tiny-qwen2-vl", "tiny-qwen2.5-vl", "tiny-qwen3-vl",
                                   "tiny-llava-1.5", "tiny-llava-next"])
def test_tp2_weights_mode_matches_single_process(vlmserve_cache, model):
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    kw = dict(dtype="float32", device="cpu", max_num_batched_tokens=37, max_num_seqs=4)
    single, prompts, expected = one_process(model, params, **kw)
    whole = _encoder_layer_bytes(single.engine.executor.runner.model)
    tp = LLM(model, tensor_parallel_size=2, mm_encoder_tp_mode="weights", **kw)
    try:
        executor = tp.engine.executor
        outs = tp.generate(prompts, params, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outs] == expected
        assert tp.engine.num_steps > len(prompts)  # chunks of 37 tokens, through images
        enc = executor.runner.encoder  # every rank ran every image through its shard
        assert enc.tp is None and enc.num_own_images == enc.num_images > 0
        assert 0.45 * whole < _encoder_layer_bytes(executor.runner.model) < 0.55 * whole
        # each rank's own measure (in its process) against a data-mode rank's model (the same
        # build with the tower whole): about half of the tower's layers less
        hf_config = load_hf_config(resolve_model(model))
        for rank, stats in enumerate(executor.rank_load_stats):
            data = weight_bytes(build_model(hf_config, torch.float32, CPU, _Rank(rank, 2)))
            assert 0.45 * whole < data - stats.weight_bytes < 0.55 * whole, (rank, model)
    finally:
        tp.engine.shutdown()


def test_weights_mode_checks_the_vision_heads(vlmserve_cache):
    """4 ranks split the tiny models' language model (4 heads, 2 KV heads) but not their
    vision towers' 2 heads: weights mode is refused, naming the option; data mode builds."""
    hf_config = load_hf_config(resolve_model("tiny-qwen2-vl"))
    with pytest.raises(ValueError, match=r"tensor_parallel_size=4 must divide the vision "
                       r"tower's attention heads \(2\) with mm_encoder_tp_mode='weights'"):
        build_model(hf_config, torch.float32, CPU, _Rank(0, 4), shard_vision=True)
    build_model(hf_config, torch.float32, CPU, _Rank(0, 4))
    for model in ("tiny-qwen2-vl", "tiny-llava-1.5"):  # num_heads / num_attention_heads
        with pytest.raises(ValueError, match=r"must divide the vision tower's attention "
                           r"heads \(2\)"):  # before any rank is spawned
            LLM(model, device="cpu", tensor_parallel_size=4, mm_encoder_tp_mode="weights")
    with pytest.raises(ValueError, match="mm_encoder_tp_mode must be one of"):
        LLM("tiny-qwen2-vl", mm_encoder_tp_mode="heads")
