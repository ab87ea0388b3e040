"""Video files of ordinary sizes are served at the default settings: a whole video (Qwen2-VL,
Qwen2.5-VL) or a temporal patch (Qwen3-VL) is one encoder item, so the encoder budget and the
encoder cache hold the model's largest video item as they hold its largest image (vLLM's
sizing); a budget the user set below a video is refused naming the video and the flag. (The
docs/offline.md's `LLM(..., max_num_batched_tokens=256)` example serving a 32-frame file:
tests/e2e/test_readme.py; a server's: tests/e2e/test_server.py.)"""

from __future__ import annotations

import pytest

from tests.engine.helpers import make_image, make_smooth_mp4
from vlmserve import LLM, SamplingParams
from vlmserve.errors import PromptTooLongError

SIZES = {"448x448": (448, 448), "1280x720": (1280, 720)}


@pytest.fixture(scope="module")
def clips() -> dict[str, bytes]:
    return {name: make_smooth_mp4(32, w, h) for name, (w, h) in SIZES.items()}


def video_chat(clip: bytes, text: str = "What happens?") -> list[dict]:
    return [{"role": "user", "content": [{"type": "video", "video": clip},
                                         {"type": "text", "text": text}]}]


@pytest.mark.parametrize("model", ["tiny-qwen2-vl", "tiny-qwen3-vl"])
def test_32_frame_files_are_served_at_the_default_settings(model, clips, vlmserve_cache):
    """448x448 and 1280x720, 32 frames each: with Qwen2-VL one encoder item of about 4,000
    rows, twice the CPU's default step budget of 2,048 (Qwen3-VL's items, a temporal patch
    each, are small: it served them before too); the budget holds the model's largest video
    item within its context."""
    llm = LLM(model, dtype="float32", device="cpu")
    params = SamplingParams(max_tokens=1, temperature=0.0)
    for name, clip in clips.items():
        out = llm.chat(video_chat(clip), params, use_tqdm=False)[0]
        assert len(out.outputs[0].token_ids) == 1, name
        if model == "tiny-qwen2-vl":
            assert len(out.prompt_token_ids) > 4000, name
    processor = llm.engine.input_processor.model_processor
    largest = min(processor.max_video_item_tokens, llm.engine.core.max_model_len)
    assert llm.engine.config.scheduler_config.max_num_encoder_tokens >= largest
    assert llm.engine.config.resolved.encoder_cache_rows >= largest  # the default 4 GiB


def test_a_budget_set_below_a_video_is_refused_naming_the_video_and_the_flag(
        clips, vlmserve_cache):
    llm = LLM("tiny-qwen2-vl", dtype="float32", device="cpu", max_num_batched_tokens=256,
              max_num_encoder_tokens=1024)
    messages = video_chat(clips["448x448"])  # after an image: still video 0
    messages[0]["content"].insert(0, {"type": "image", "image": make_image(56, 56, 0)})
    prompt = llm.chat_prompt(messages)
    with pytest.raises(PromptTooLongError) as e:
        llm.engine.process_request(prompt)
    assert str(e.value) == ("video 0 becomes 4096 tokens, more than the per-step encoder "
                            "budget of 1024 (--max-num-encoder-tokens)")
