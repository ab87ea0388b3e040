"""GPU only: 32-frame video files of ordinary sizes (448x448 and 1280x720) are served at the
GPU's default settings by models of real shapes (Qwen2-VL-2B's: a whole video is one encoder
item of thousands of rows; Qwen3.5-0.8B's, whose tower is Qwen3-VL's: a temporal patch each),
within the budget the defaults size. The CPU's version with the tiny models:
tests/engine/test_video_sizes.py. Run on the GPU machine (PyAV installed):
`python -m pytest tests/gpu/test_video_defaults.py`.
"""

from __future__ import annotations

import gc

import pytest
import torch

from tests.engine.helpers import make_smooth_mp4
from tests.engine.test_video_sizes import SIZES, video_chat
from vlmserve import LLM, SamplingParams

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.fixture(scope="module")
def clips() -> dict[str, bytes]:
    pytest.importorskip("av")
    return {name: make_smooth_mp4(32, w, h) for name, (w, h) in SIZES.items()}


@pytest.mark.parametrize("model", ["qwen2-vl-2b-random", "qwen3.5-0.8b-random"])
def test_32_frame_files_at_the_gpu_defaults(model, clips, tmp_path, monkeypatch):
    monkeypatch.setenv("VLMSERVE_CACHE", str(tmp_path))
    llm = LLM(model, gpu_memory_utilization=0.4)
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    outs = llm.chat([video_chat(clip) for clip in clips.values()], params, use_tqdm=False)
    processor = llm.engine.input_processor.model_processor
    largest = min(processor.max_video_item_tokens, llm.engine.core.max_model_len)
    for name, out in zip(clips, outs, strict=True):
        assert len(out.outputs[0].token_ids) == 8, name
        print(f"{model} {name}: {len(out.prompt_token_ids)} prompt tokens")
    assert llm.engine.config.scheduler_config.max_num_encoder_tokens >= largest
    assert llm.engine.config.resolved.encoder_cache_rows >= largest
    # the next model's budget counts what this one still holds: give it all back
    llm.engine.shutdown()
    del llm, processor
    gc.collect()
    torch.cuda.empty_cache()
