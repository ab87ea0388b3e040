"""Video inputs (Qwen2-VL, Qwen2.5-VL): greedy output token-for-token identical to transformers
`generate` given the same frames (beside an image, chunked through the video, batched with
image requests); mRoPE positions equal to transformers' `get_rope_index`; the pixel rows in
the HF video processor's layout; bad videos answered with errors naming the problem."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.engine.helpers import HFOracle, make_image, make_mp4, mixed_prompts
from vlmserve import LLM, SamplingParams
from vlmserve.errors import InvalidImageError, InvalidRequestError
from vlmserve.models.mrope import compute_mrope_positions
from vlmserve.models.qwen2_vl_processing import Qwen2VLPixels
from vlmserve.multimodal.video import Video, decode_video, load_video

MAX_TOKENS = 10
MODELS = {
    "qwen2-vl": ("tiny-qwen2-vl", "Qwen2VLForConditionalGeneration"),
    "qwen2.5-vl": ("tiny-qwen2.5-vl", "Qwen2_5_VLForConditionalGeneration"),
}
VIDEO_PAD = "<|vision_start|><|video_pad|><|vision_end|>"
IMAGE_PAD = "<|vision_start|><|image_pad|><|vision_end|>"


def frames(count: int, height: int, width: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (count, height, width, 3), np.uint8)


def prompt(text: str, videos=(), images=()) -> dict:
    pads = VIDEO_PAD * len(videos) + IMAGE_PAD * len(images)
    mm = {}
    if videos:
        mm["video"] = list(videos)
    if images:
        mm["image"] = list(images)
    return {"prompt": f"<|im_start|>user\n{pads}{text}<|im_end|>\n<|im_start|>assistant\n",
            "multi_modal_data": mm}


@pytest.fixture(scope="module", params=list(MODELS))
def setup(request, vlmserve_cache):
    name, arch = MODELS[request.param]
    from vlmserve.models.builtin import resolve_model

    return name, LLM(name, dtype="float32", device="cpu"), HFOracle(resolve_model(name), arch)


def _video_kwargs(llm: LLM, fps: list[float]) -> dict:
    """Qwen2.5-VL's seconds per temporal patch, as its processor computes them."""
    if llm.engine.input_processor.model_processor.tokens_per_second is None:
        return {}
    return {"second_per_grid_ts": torch.tensor([2.0 / f for f in fps])}


def test_a_video_beside_an_image_equals_transformers(setup):
    """5 frames (padded to 6: three temporal patches) at 4 fps, then an image; positions as
    transformers' `get_rope_index`, tokens as its `generate`. (The video is wider than its
    times run, where transformers 5.2x and the original rule agree on the text after it:
    `test_text_after_a_long_video_resumes_past_its_last_time`.)"""
    name, llm, oracle = setup
    p = prompt("What happens?", [(frames(5, 56, 168, 1), {"fps": 4.0})], [make_image(56, 56, 2)])
    processed = llm.engine.input_processor.process(p)
    video, image = processed.images
    assert video.encoder_meta == (3, 4, 12) and video.length == 36
    assert tuple(video.pixels.shape) == (6, 56, 168, 3)
    assert torch.equal(video.pixels[5], video.pixels[4])  # the last frame, repeated
    ids, kwargs = oracle._inputs(processed)
    extra = _video_kwargs(llm, [4.0])
    want, delta = oracle.model.model.get_rope_index(
        ids, kwargs["mm_token_type_ids"], kwargs["image_grid_thw"], kwargs["video_grid_thw"],
        **extra)
    assert torch.equal(processed.prompt_positions, want[:, 0])
    assert processed.position_offset == int(delta)
    out = llm.generate([p], SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0,
                                           ignore_eos=True), use_tqdm=False)
    assert out[0].outputs[0].token_ids == oracle.generate(processed, MAX_TOKENS, **extra)


def test_chunked_through_the_video_and_batched_with_images(setup):
    """Chunks of 8 tokens cut through the video's 18 rows; two videos of other sizes and the
    image requests in one batch."""
    name, llm, oracle = setup
    prompts = [prompt("Describe.", [frames(4, 56, 56, 3)]),
               prompt("Two clips.", [(frames(2, 84, 56, 4), {"fps": 2.0}),
                                     [make_image(56, 56, 5 + i) for i in range(3)]]),
               *mixed_prompts(llm)[:3]]
    fps = [[24.0], [2.0, 24.0]]  # transformers' rate where none is given: 24
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    for engine in (llm, LLM(name, dtype="float32", device="cpu", max_num_batched_tokens=8,
                            enable_prefix_caching=False)):
        outs = engine.generate(prompts, params, use_tqdm=False)
        for i, (p, out) in enumerate(zip(prompts, outs, strict=True)):
            processed = engine.engine.input_processor.process(p)
            extra = _video_kwargs(llm, fps[i]) if i < 2 else {}
            assert out.outputs[0].token_ids == oracle.generate(processed, MAX_TOKENS, **extra)


def test_the_same_video_again_hits_the_encoder_cache(setup):
    """The same frames after another prefix (no KV to reuse): encoded once."""
    name, llm, oracle = setup
    p = prompt("Again.", [frames(4, 56, 56, 7)])
    other = {**p, "prompt": "<|im_start|>system\nBe brief.<|im_end|>\n" + p["prompt"]}
    before = llm.engine.get_stats()["num_encoder_cache_hits"]
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    for q in (p, other):
        out = llm.generate([q], params, use_tqdm=False)[0].outputs[0].token_ids
        processed = llm.engine.input_processor.process(q)
        assert out == oracle.generate(processed, MAX_TOKENS, **_video_kwargs(llm, [24.0]))
    assert llm.engine.get_stats()["num_encoder_cache_hits"] > before


def test_video_rows_are_the_hf_video_processors():
    """The rows of `[B, F, H, W, 3]` frames in transformers' video patch layout (its torch
    `patchify`: [t, T, C, h/m, m, p, w/m, m, p] -> (t, h/m, w/m, m, m, C, T, p, p)); two
    equal frames give the rows of that frame as an image."""
    tf = Qwen2VLPixels(rescale_factor=1 / 255, mean=(0.5, 0.4, 0.3), std=(0.2, 0.3, 0.4),
                       fused=False, patch_size=14, temporal_patch_size=2, merge_size=2)
    video = torch.from_numpy(frames(4, 56, 84, 9))[None]
    got = tf(video, torch.float32)
    x = tf.normalized(video[0])  # [F, C, H, W]
    ref = x.reshape(1, 2, 2, 3, 2, 2, 14, 3, 2, 14).permute(0, 1, 4, 7, 5, 8, 3, 2, 6, 9)
    assert torch.equal(got, ref.reshape(2 * 4 * 6, 3 * 2 * 14 * 14))
    still = video[:, :1].expand(1, 2, 56, 84, 3)
    assert torch.equal(tf(still, torch.float32), tf(video[:, 0], torch.float32))


def released_rope_index(ids: list[int], grids: list[tuple[int, int, int]],
                        steps: list[float], vision_ids: set[int], merge: int) -> torch.Tensor:
    """The mRoPE positions [3, len(ids)] of the rule Qwen2-VL and Qwen2.5-VL were released
    with (the `get_rope_index` of their transformers 4.45 / 4.49 code, Qwen's fine-tuning
    code and vLLM), written out token by token: text counts on from one past the largest
    position so far, in all three sections; an item's token (k, y, x) of its merged grid sits
    at its start plus (floor(k * step), y, x); after an item, the next start is one past the
    largest position it holds (its time or its extent, whichever runs further)."""
    out, start, i, items = [], 0, 0, iter(zip(grids, steps, strict=True))
    while i < len(ids):
        if ids[i] not in vision_ids:
            out.append((start, start, start))
            start, i = start + 1, i + 1
            continue
        (t, h, w), step = next(items)
        cells = [(start + int(k * step), start + y, start + x)
                 for k in range(t) for y in range(h // merge) for x in range(w // merge)]
        out += cells
        start, i = max(max(c) for c in cells) + 1, i + len(cells)
    return torch.tensor(out).T


@pytest.mark.parametrize("count, fps, agree", [(5, 4.0, True), (8, 2.0, False)])
def test_positions_after_a_video_follow_the_released_rule(setup, count, fps, agree):
    """A video then an image and text: positions equal the released rule's (an independent
    walk over the tokens, `released_rope_index`). A video wider than its times run (5 frames
    of 56x168: 3 temporal patches, 6 merged columns): transformers 5.2x's `get_rope_index`
    gives the same. A video whose times run past its width (8 frames of 56x56: 4 temporal
    patches, 2 merged columns; Qwen2.5-VL's times 0, 4, 8, 12): transformers 5.2x resumes
    at start + max(h, w) / merge and so differs; we keep the released rule."""
    name, llm, oracle = setup
    width = 168 if agree else 56
    p = prompt("After.", [(frames(count, 56, width, 11), {"fps": fps})],
               [make_image(56, 56, 12)])
    processed = llm.engine.input_processor.process(p)
    model_processor = llm.engine.input_processor.model_processor
    tps = model_processor.tokens_per_second
    steps = [1.0 if tps is None else tps * 2 / fps, 1.0]
    hf_config = model_processor.hf_config
    want = released_rope_index(processed.prompt_token_ids,
                               [img.encoder_meta for img in processed.images], steps,
                               {hf_config.image_token_id, hf_config.video_token_id}, 2)
    assert torch.equal(processed.prompt_positions, want)
    assert processed.position_offset == int(want.max()) + 1 - want.shape[1]
    ids, kwargs = oracle._inputs(processed)
    theirs, _ = oracle.model.model.get_rope_index(
        ids, kwargs["mm_token_type_ids"], kwargs["image_grid_thw"], kwargs["video_grid_thw"],
        **_video_kwargs(llm, [fps]))
    assert torch.equal(theirs[:, 0], want) == agree
    video = processed.images[0]
    after = video.offset + video.length  # the token after the video
    assert want[0, after] == int(want[:, video.offset:after].max()) + 1


def test_text_after_a_long_video_resumes_past_its_last_time():
    """The original implementation's (and vLLM's) rule: text after a video whose times run
    past its spatial extent resumes one past its largest position. (transformers 5.2x's
    `get_rope_index` resumes at start + max(h, w) / merge whatever the times, so positions
    of the text after such a video repeat the video's own; we keep the rule the models were
    trained with.)"""
    positions, delta = compute_mrope_positions(2 + 8 + 1, [(2, (8, 2, 2), 1.0)], 2)
    assert positions[0, 2:10].tolist() == [2, 3, 4, 5, 6, 7, 8, 9]
    assert positions[:, 10].tolist() == [10, 10, 10] and delta == 0
    positions, _ = compute_mrope_positions(1 + 2 + 1, [(1, (2, 2, 2), 2.5)], 2)
    assert positions[0, 1:3].tolist() == [1, 3]  # times 0, 2.5 -> 0, 2 (rounded down)


@pytest.mark.parametrize("bad, message", [
    (frames(2, 56, 56, 0).astype(np.float32), "uint8"),
    (frames(2, 56, 56, 0)[..., :2], "[frames, H, W, 3]"),
    ([np.zeros((56, 56, 3), np.uint8), np.zeros((28, 56, 3), np.uint8)], "differ in size"),
    ((frames(2, 56, 56, 0), {"fps": -1}), "fps must be a positive"),
    ((frames(2, 56, 56, 0), {"rate": 2}), "unknown key"),
    (np.zeros((0, 56, 56, 3), np.uint8), "1 to 768 frames"),
    ("clip.mp4", "video 0: video file not found"),
    (b"not a video", "video 0: not a video container this server reads"),
    (42, "a video is an array"),
])
def test_bad_videos_are_named(setup, bad, message):
    _, llm, _ = setup
    with pytest.raises(InvalidRequestError, match=message.replace("[", r"\[").replace("]", r"\]")):
        llm.engine.input_processor.process(prompt("Bad.", [bad]))


def test_placeholders_and_videos_must_agree(setup):
    _, llm, _ = setup
    p = prompt("Two?", [frames(2, 56, 56, 0)])
    p["multi_modal_data"]["video"].append(Video(frames(2, 56, 56, 1)))
    with pytest.raises(InvalidRequestError, match="1 video placeholder"):
        llm.engine.input_processor.process(p)


def test_llava_says_it_takes_no_video(vlmserve_cache):
    processor = LLM("tiny-llava-1.5", dtype="float32", device="cpu").engine.input_processor
    with pytest.raises(InvalidRequestError, match="this model does not take video inputs"):
        processor.process(prompt("Hi.", [frames(2, 56, 56, 0)]))


@pytest.fixture(scope="module", params=[("tiny-qwen3-vl", "Qwen3VLForConditionalGeneration"),
                                        ("tiny-qwen3-vl-moe",
                                         "Qwen3VLMoeForConditionalGeneration")],
                ids=["qwen3-vl", "qwen3-vl-moe"])
def qwen3(request, vlmserve_cache):
    from vlmserve.models.builtin import resolve_model

    name, arch = request.param
    return LLM(name, dtype="float32", device="cpu"), HFOracle(resolve_model(name), arch)


def test_qwen3_vl_video_equals_transformers(qwen3):
    """Qwen3-VL: each temporal patch after its time as text, in a vision block of its own,
    as transformers' processor writes the prompt; the tower's rows of the video as one (its
    grid (t, h, w)) equal those of its patches one by one; positions as `get_rope_index`,
    tokens as `generate`, beside an image."""
    llm, oracle = qwen3
    clip = (frames(5, 64, 96, 12), {"fps": 2.0})
    p = llm.chat_prompt([{"role": "user", "content": [
        {"type": "video", "video": clip}, {"type": "image", "image": make_image(64, 64, 13)},
        {"type": "text", "text": "What happens?"}]}])
    processed = llm.engine.input_processor.process(p)
    tok = llm.engine.input_processor.model_processor.tokenizer
    text = tok.decode(processed.prompt_token_ids)
    block = "<|vision_start|>" + "<|video_pad|>" * 6 + "<|vision_end|>"
    # frames at 0, 0.5, 1, 1.5, 2 s, the last repeated: patches at 0.25, 1.25, 2.0 s
    assert f"user\n<0.2 seconds>{block}<1.2 seconds>{block}<2.0 seconds>{block}" in text
    patches = [img for img in processed.images if img.pixels.dim() == 4]
    assert [img.encoder_meta for img in patches] == [(1, 4, 6)] * 3
    ids, kwargs = oracle._inputs(processed)
    whole = torch.tensor([[3, 4, 6]])
    model = oracle.model.model
    split = model.get_video_features(kwargs["pixel_values_videos"], kwargs["video_grid_thw"])
    joint = model.get_video_features(kwargs["pixel_values_videos"], whole)
    torch.testing.assert_close(torch.cat(split.pooler_output), torch.cat(joint.pooler_output))
    want, delta = model.get_rope_index(ids, kwargs["mm_token_type_ids"],
                                       kwargs["image_grid_thw"], whole)
    assert torch.equal(processed.prompt_positions, want[:, 0])
    assert processed.position_offset == int(delta)
    out = llm.generate([p], SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0,
                                           ignore_eos=True), use_tqdm=False)
    assert out[0].outputs[0].token_ids == oracle.generate(processed, MAX_TOKENS)


def test_qwen3_vl_video_needs_a_text_prompt(qwen3):
    llm, _ = qwen3
    ids = llm.engine.input_processor.model_processor.tokenizer.encode(VIDEO_PAD + "Hi")
    with pytest.raises(InvalidRequestError, match="need the prompt as text"):
        llm.engine.input_processor.process({"prompt_token_ids": ids,
                                            "multi_modal_data": {"video": frames(2, 64, 64, 0)}})


def test_chat_takes_video_parts(setup):
    """`LLM.chat` with a `{"type": "video", "video": frames}` part: the chat template's
    video placeholder, and the same tokens as the prompt written out."""
    _, llm, _ = setup
    clip = frames(4, 56, 56, 11)
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    chat = llm.chat([{"role": "user", "content": [{"type": "video", "video": clip},
                                                  {"type": "text", "text": "What happens?"}]}],
                    params, use_tqdm=False)
    written = prompt("What happens?", [clip])
    written["prompt"] = ("<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
                         + written["prompt"])  # the template's default system message
    direct = llm.generate([written], params, use_tqdm=False)
    assert chat[0].prompt_token_ids == direct[0].prompt_token_ids
    assert chat[0].outputs[0].token_ids == direct[0].outputs[0].token_ids


def test_a_video_file_is_sampled_evenly(tmp_path):
    """A 12-frame MP4 at 6 fps read into 4 frames: indices 0, 3, 7, 11 (vLLM's `np.linspace`),
    sampled at 4 frames / 2 s = 2 fps; all 12 when more are asked; from a path too."""
    clip = make_mp4(count=12, fps=6)
    video = decode_video(clip, num_frames=4)
    assert video.frames.shape == (4, 48, 64, 3) and video.fps == pytest.approx(2.0)
    every = decode_video(clip, num_frames=32)
    assert every.num_frames == 12 and every.fps == pytest.approx(6.0)
    assert np.array_equal(video.frames, every.frames[[0, 3, 7, 11]])
    assert video.timestamps == (0.0, 3 / 6, 7 / 6, 11 / 6)
    path = tmp_path / "clip.mp4"
    path.write_bytes(clip)
    assert np.array_equal(load_video(str(path)).frames, every.frames)
    with pytest.raises(InvalidImageError, match="within the limit of 1000 pixels a frame"):
        decode_video(clip, max_pixels=1000)  # MPEG-4 in MP4: its size known by decoding
    with pytest.raises(InvalidImageError, match="4 frames of 64x48 hold 12288 pixels"):
        decode_video(clip, num_frames=4, max_total_pixels=12000)
    with pytest.raises(InvalidImageError, match="decoding the video took over 0 s"):
        decode_video(clip, timeout_s=0)


def test_qwen3_vl_times_of_a_video_file_are_its_frames(qwen3):
    """A video file's patches are timed by their frames' places in the file (40 frames at
    10 fps, 32 kept: not evenly 1 / 8 s apart)."""
    llm, _ = qwen3
    clip = make_mp4(count=40, width=64, height=64, fps=10)
    times = decode_video(clip).timestamps
    assert times[:3] == (0.0, 0.1, 0.2) and times[-1] == 3.9
    p = llm.chat_prompt([{"role": "user", "content": [{"type": "video", "video": clip},
                                                      {"type": "text", "text": "When?"}]}])
    text = llm.engine.input_processor.model_processor.tokenizer.decode(
        llm.engine.input_processor.process(p).prompt_token_ids)
    stamps = [f"<{(times[k] + times[k + 1]) / 2:.1f} seconds>" for k in range(0, 32, 2)]
    assert text.count(" seconds>") == 16 and all(s in text for s in stamps)
