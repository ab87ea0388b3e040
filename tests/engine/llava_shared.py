"""Engine features both LLaVA parity modules check the same way (batching, chunks through
placeholder runs, preemption, offload with the encoder cache, prefix-cache hits): imported
into each module, where they run on its own `setup` (engine, transformers oracle) and its
`preemption_kv_blocks`."""

from __future__ import annotations

import pytest

from tests.engine.helpers import assert_prompts_hit, chat_prompt, make_image, mixed_prompts
from tests.engine.test_parity import check


def test_eight_requests_together(setup):
    llm, oracle = setup
    check(llm, oracle, mixed_prompts(llm))


@pytest.mark.parametrize("budget", [16, 37, 64])
def test_chunks_cut_through_images(setup, budget):
    llm, oracle = setup
    engine = check(llm, oracle, mixed_prompts(llm), max_num_batched_tokens=budget).engine
    assert engine.num_steps > 8


def test_preemption_keeps_output(setup, preemption_kv_blocks):
    llm, oracle = setup
    engine = check(llm, oracle, mixed_prompts(llm), num_kv_blocks=preemption_kv_blocks,
                   block_size=8, max_num_batched_tokens=128).engine
    assert engine.scheduler.num_preemptions > 0


def test_offload_cache_and_repeated_images(setup, second_image_size):
    """Embedding offload and the encoder cache: each distinct image encoded once."""
    llm, oracle = setup
    a, b = make_image(112, 84, 21), make_image(*second_image_size, 22)
    prompts = [chat_prompt(llm, "Twice the same?", [a, b, a]),
               chat_prompt(llm, "And again.", [a]),
               chat_prompt(llm, "Only b.", [b, b])]
    engine = check(llm, oracle, prompts, max_num_batched_tokens=37, max_num_seqs=2,
                   mm_embedding_offload=True).engine
    stats = engine.get_stats()
    assert stats["num_images_encoded"] == 2
    assert stats["prefetch_hit_rows"] > 0


def test_prefix_cache_hits_match(setup):
    llm, oracle = setup
    prompts = mixed_prompts(llm)[:5]
    llm = check(llm, oracle, prompts, max_num_batched_tokens=23, max_num_seqs=4,
                enable_prefix_caching=True)
    encoded = llm.engine.get_stats()["num_images_encoded"]
    check(llm, oracle, prompts)
    assert_prompts_hit(llm, prompts, encoded)
