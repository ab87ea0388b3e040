"""Native Gemma 3 against transformers' own processor and `generate` on a tiny checkpoint
(`tests/models/hf_tiny.py`: a sliding layer of window 16 and a full layer, 4 soft tokens an
image), greedy token for token, with blocks of 4 tokens so that every prompt runs past the
window: text, one and two images in one batch; chunked prefill at budgets that end before an
image; a multi-turn chat whose second turn starts from the first's cached prefix; preemption
and resumption; and a sliding group's blocks that stop growing once the window is full."""

from __future__ import annotations

import pytest
import torch

from tests.engine.helpers import make_image, watch_live_blocks
from tests.models.hf_tiny import build_tiny
from tests.models.test_transformers_backend import Reference
from vlmserve import LLM, SamplingParams

BS = 4
WINDOW = 16


class _Reference(Reference):
    @torch.inference_mode()
    def generate(self, prompt: str, images, max_new_tokens: int = 6) -> list[int]:
        inputs = self.processor(text=[prompt], images=[images] if images else None,
                                return_tensors="pt")
        out = self.model.generate(**inputs, max_new_tokens=max_new_tokens, do_sample=False,
                                  eos_token_id=None, pad_token_id=0)
        return out[0, inputs["input_ids"].shape[1]:].tolist()


@pytest.fixture(scope="module")
def gemma3(tmp_path_factory):
    path = str(build_tiny("gemma3", tmp_path_factory.mktemp("gemma3")))
    return path, _Reference(path)


def _llm(path: str, **kw) -> LLM:
    llm = LLM(path, dtype="float32", device="cpu", block_size=BS, **kw)
    assert type(llm.engine.core.executor.runner.model).__name__ == \
        "Gemma3ForConditionalGeneration"
    return llm


def _chat(llm: LLM, turns: list[tuple[str, str, list]]) -> str:
    """turns: (role, text, images)."""
    messages = [{"role": role, "content": [{"type": "image"} for _ in imgs]
                 + [{"type": "text", "text": text}]} for role, text, imgs in turns]
    return llm.engine.input_processor.model_processor.apply_chat_template(messages)


def _run(llm: LLM, prompts, max_tokens: int = 6) -> list[list[int]]:
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    inputs = [{"prompt": p, "multi_modal_data": {"image": imgs}} if imgs else {"prompt": p}
              for p, imgs in prompts]
    return [o.outputs[0].token_ids for o in llm.generate(inputs, params, use_tqdm=False)]


def _prompts(llm: LLM) -> list[tuple[str, list]]:
    one, two, three = make_image(40, 30, 1), make_image(64, 48, 2), make_image(30, 60, 3)
    return [
        (_chat(llm, [("user", "The quick brown fox jumps over the lazy dog again.", [])]), []),
        (_chat(llm, [("user", "What is in this picture?", [one])]), [one]),
        (_chat(llm, [("user", "Compare the two images.", [two, three])]), [two, three]),
    ]


def test_text_images_and_a_batch_with_chunked_prefill(gemma3):
    path, ref = gemma3
    llm = _llm(path)
    groups = llm.engine.core.executor.cache_groups
    assert [(g.kind.kind, g.kind.size) for g in groups] == [("full", 0), ("sliding", WINDOW)]
    prompts = _prompts(llm)
    assert all(len(llm.engine.input_processor.process(
        {"prompt": p, "multi_modal_data": {"image": imgs}} if imgs else p).prompt_token_ids)
        > WINDOW + BS for p, imgs in prompts)
    expected = [ref.generate(p, imgs) for p, imgs in prompts]
    assert _run(llm, prompts) == expected
    # a step budget of 6 (and 9) tokens ends chunks right before a 4-token image it would cut
    for budget in (6, 9):
        chunked = _llm(path, max_num_batched_tokens=budget, max_num_seqs=2)
        assert chunked.engine.core.scheduler.whole_images
        assert _run(chunked, prompts) == expected, f"budget {budget}"


def test_a_second_turn_starts_from_the_first_turns_prefix(gemma3):
    path, ref = gemma3
    llm = _llm(path, enable_prefix_caching=True)
    image = make_image(40, 30, 4)
    first = _chat(llm, [("user", "What is in this picture?", [image])])
    answer = llm.engine.input_processor.model_processor.tokenizer.decode(
        _run(llm, [(first, [image])])[0])
    second = _chat(llm, [("user", "What is in this picture?", [image]),
                         ("assistant", answer, []), ("user", "And what colour is it?", [])])
    before = llm.engine.core.scheduler.stats().prefix_cache_hit_tokens
    warm = _run(llm, [(second, [image])], max_tokens=8)
    hit = llm.engine.core.scheduler.stats().prefix_cache_hit_tokens - before
    assert hit > WINDOW + BS  # past the window: the sliding group served its window's blocks
    cold = _run(_llm(path), [(second, [image])], max_tokens=8)
    assert warm == cold == [ref.generate(second, [image], 8)]


def test_preempted_requests_resume_and_match(gemma3):
    path, ref = gemma3
    llm = _llm(path, num_kv_blocks=20, max_num_seqs=3)
    prompts = _prompts(llm)
    expected = [ref.generate(p, imgs, 10) for p, imgs in prompts]
    assert _run(llm, prompts, max_tokens=10) == expected
    sched = llm.engine.core.scheduler
    assert sched.num_preemptions > 0
    assert sched.kv.num_free_blocks == sched.kv.num_blocks


def test_a_sliding_groups_blocks_stop_growing_past_the_window(gemma3):
    path, ref = gemma3
    llm = _llm(path)
    live = watch_live_blocks(llm)
    prompt = _prompts(llm)[1]
    assert _run(llm, [prompt], max_tokens=40) == [ref.generate(*prompt, 40)]
    full, sliding = zip(*live)
    assert max(full) >= (31 + 39) // BS  # the full group holds every position
    assert max(sliding[-30:]) <= WINDOW // BS + 1  # decodes: the window and one block


def test_tensor_parallel_on_two_ranks(gemma3):
    """TP=2 over gloo: heads, MLP columns and vocabulary split; each rank holds its own
    share of both cache groups; the tokens are transformers'."""
    path, ref = gemma3
    llm = _llm(path, tensor_parallel_size=2, enable_prefix_caching=True)
    try:
        attn = llm.engine.core.executor.runner.model.language_model.layers[0].self_attn
        assert (attn.heads, attn.kv_heads) == (2, 1)  # 4 heads / 2 KV heads over 2 ranks
        prompts = _prompts(llm)
        expected = [ref.generate(p, imgs) for p, imgs in prompts]
        assert _run(llm, prompts) == expected
        assert _run(llm, prompts) == expected  # again, from the cached prefixes
        assert llm.engine.core.scheduler.stats().prefix_cache_hit_tokens > 0
    finally:
        llm.engine.shutdown()


def _four_turn_chat_hit_rate(path: str) -> float:
    llm = _llm(path, enable_prefix_caching=True)
    turns: list[tuple[str, str, list]] = []
    questions = [("What is in this picture?", [make_image(40, 30, 5)]),
                 ("Describe its colours.", []),
                 ("And this one?", [make_image(64, 48, 6)]),
                 ("Which of the two is brighter?", [])]
    tokenizer = llm.engine.input_processor.model_processor.tokenizer
    for text, imgs in questions:
        turns.append(("user", text, imgs))
        images = [img for _, _, i in turns for img in i]
        answer = _run(llm, [(_chat(llm, turns), images)])[0]
        turns.append(("assistant", tokenizer.decode(answer), []))
    return llm.engine.core.scheduler.stats().prefix_cache_hit_rate


def test_a_chats_prefix_hit_rate_matches_a_full_attention_models(gemma3, tmp_path):
    """The issue's check: a 4-turn chat with images hits the prefix cache as often on the
    hybrid model (sliding + full) as on the same model with every layer full attention."""
    import json
    import shutil

    path, _ = gemma3
    full = tmp_path / "full"
    shutil.copytree(path, full)
    config = json.loads((full / "config.json").read_text())
    config["text_config"]["layer_types"] = ["full_attention"] * 2
    (full / "config.json").write_text(json.dumps(config))
    hybrid, dense = _four_turn_chat_hit_rate(path), _four_turn_chat_hit_rate(str(full))
    assert dense > 0.5 and abs(hybrid - dense) <= 0.10, (hybrid, dense)
