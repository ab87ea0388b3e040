"""Qwen3.5 and Qwen3.5-MoE under tensor parallelism: two ranks in real processes over gloo,
each holding its share of the Gated DeltaNet heads (and so of the state pools), of the gated
full-attention heads, of the MLP or of the experts (every expert's columns, or with expert
parallelism half of the experts whole) and the shared expert's columns. Greedy tokens equal
transformers' `generate` for a batch with images in chunks of 23 tokens (through images and
across a 100-token prompt's 64-token linear chunks), and for a chat's second turn that
resumes from the prefix cache (the linear layers from a state snapshot). Qwen3.5's tower runs
split too (`mm_encoder_tp_mode="weights"`); the MoE runs keep it in the default data mode."""

from __future__ import annotations

import pytest

from tests.engine.helpers import (
    HFOracle,
    chat_prompt,
    check_second_turn,
    make_image,
    mixed_prompts,
)
from tests.engine.test_parity import MAX_TOKENS, check
from vlmserve import LLM, SamplingParams
from vlmserve.models.builtin import resolve_model

GREEDY = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
ARCH = {"tiny-qwen3.5": "Qwen3_5ForConditionalGeneration",
        "tiny-qwen3.5-moe": "Qwen3_5MoeForConditionalGeneration"}
CASES = {  # name -> (model, engine options)
    "dense-weights-mode": ("tiny-qwen3.5", {"mm_encoder_tp_mode": "weights"}),
    "moe": ("tiny-qwen3.5-moe", {}),
    "moe-expert-parallel": ("tiny-qwen3.5-moe", {"enable_expert_parallel": True}),
}


@pytest.fixture(scope="module")
def oracles(vlmserve_cache) -> dict[str, HFOracle]:
    return {name: HFOracle(resolve_model(name), arch) for name, arch in ARCH.items()}


def _check_rank0_shapes(llm: LLM, case: str) -> None:
    """What rank 0 holds: half of every split (tiny: 4 heads / 2 KV heads of 32, 2 key / 4
    value linear heads of 16, 8 experts of 48 columns, a shared expert of 64)."""
    runner = llm.engine.executor.runner
    linear, full = runner.model.language_model.layers[:2]
    la, attn = linear.linear_attn, full.self_attn
    assert (la.k_heads, la.v_heads) == (1, 2)
    assert la.in_proj.out_sizes == [16, 16, 32, 32, 2, 2]
    conv, ssm = runner.kv_caches[0]  # the state pools: conv [slots, 3, 16 + 16 + 32]
    assert conv.shape[1:] == (3, 64) and ssm.shape[1:] == (2, 16, 16)
    assert (attn.heads, attn.kv_heads) == (2, 1)
    assert attn.qkv_proj.out_sizes == [2 * 2 * 32, 32, 32]  # query and gate rows per head
    assert runner.kv_caches[1].shape[-2:] == (1, 32)
    enc = runner.encoder
    if case == "dense-weights-mode":
        assert linear.mlp.gate_up_proj.weight.shape == (2 * 64, 64)
        assert enc.tp is None and enc.num_own_images == enc.num_images > 0
        tower = runner.model.visual.blocks[0].attn  # weights mode: 1 of the 2 vision heads
        assert tower.num_heads == 1 and tower.qkv.weight.shape == (3 * 16, 32)
        return
    moe = linear.mlp
    assert moe.tp is not None and moe.routed.tp is None  # one all-reduce of both sums
    assert moe.shared_expert.gate_up_proj.weight.shape == (2 * 32, 64)
    assert moe.shared_expert.down_proj.weight.shape == (64, 32)
    experts = moe.routed.experts
    if case == "moe":
        assert experts.gate_up_proj.shape == (8, 2 * 24, 64)
    else:
        assert experts.gate_up_proj.shape == (4, 2 * 48, 64) and experts.expert_start == 0
    assert enc.tp is not None  # data mode: a step's images shared out by rows


@pytest.mark.parametrize("case", list(CASES))
def test_tp2_matches_transformers(oracles, case):
    model, options = CASES[case]
    oracle = oracles[model]
    llm = LLM(model, tensor_parallel_size=2, dtype="float32", device="cpu",
              max_num_batched_tokens=23, enable_prefix_caching=True, **options)
    try:
        long = chat_prompt(llm, " ".join(f"word{i}" for i in range(60)), [])
        check(llm, oracle, [long, *mixed_prompts(llm)[1:4]])
        assert llm.engine.num_steps > 10  # in chunks
        _check_rank0_shapes(llm, case)
        check_second_turn(llm, check, oracle, make_image(112, 84, 9), GREEDY)
    finally:
        llm.engine.shutdown()


def test_linear_heads_that_do_not_divide_are_refused_before_ranks_start(vlmserve_cache):
    with pytest.raises(ValueError, match=r"tensor_parallel_size=4 must divide "
                       r"linear_num_key_heads \(2\)"):
        LLM("tiny-qwen3.5", dtype="float32", device="cpu", tensor_parallel_size=4)


def test_shard_plan_of_the_linear_layers_the_gated_query_and_the_shared_expert():
    """Rank 1 of 2 of a Qwen3.5-MoE text config (which has no dense MLP size): 4 key heads
    and 8 value heads of 8 (the value head i reads key head i // 2), q_proj rows by 2 *
    head_dim a head, the shared expert's columns."""
    from transformers import Qwen3_5MoeTextConfig

    from vlmserve.layers.tensor_parallel import ShardPlan, TensorSlice, TPLayout

    cfg = Qwen3_5MoeTextConfig(
        hidden_size=16, num_attention_heads=4, num_key_value_heads=2, head_dim=4,
        linear_num_key_heads=4, linear_num_value_heads=8, linear_key_head_dim=8,
        linear_value_head_dim=8, num_experts=4, moe_intermediate_size=12,
        shared_expert_intermediate_size=20, vocab_size=10)
    assert getattr(cfg, "intermediate_size", None) is None
    plan = ShardPlan.for_config(cfg, 1, 2, layout=TPLayout(gated_query=True))

    def part(name: str) -> TensorSlice | None:
        return plan.slice_for(f"model.language_model.layers.0.{name}")

    # q | k | v rows: q and k 32 rows each (heads 2-3 of 8 rows), v 64 (heads 4-7)
    qkv = TensorSlice(0, 16, 128, 64, ((16, 32), (48, 64), (96, 128)))
    assert part("linear_attn.in_proj_qkv.weight") == part("linear_attn.conv1d.weight") == qkv
    assert part("linear_attn.in_proj_z.weight") == TensorSlice(0, 32, 64, 32)
    for name in ("in_proj_b.weight", "in_proj_a.weight", "dt_bias", "A_log"):
        assert part(f"linear_attn.{name}") == TensorSlice(0, 4, 8, 4)
    assert part("linear_attn.out_proj.weight") == TensorSlice(1, 32, 64, 32)
    assert part("linear_attn.norm.weight") is None  # per value-head dim: replicated
    assert part("self_attn.q_proj.weight") == TensorSlice(0, 16, 32, 16)  # [q | gate] a head
    assert part("self_attn.k_proj.weight") == TensorSlice(0, 4, 8, 4)
    assert part("self_attn.o_proj.weight") == TensorSlice(1, 8, 16, 8)
    assert part("self_attn.q_norm.weight") is None
    assert part("mlp.shared_expert.up_proj.weight") == TensorSlice(0, 10, 20, 10)
    assert part("mlp.shared_expert.down_proj.weight") == TensorSlice(1, 10, 20, 10)
    assert part("mlp.shared_expert_gate.weight") is None
    assert part("mlp.gate.weight") is None  # the router: replicated
