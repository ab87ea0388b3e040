"""Admission processing vs Hugging Face: token expansion, grids, mRoPE positions; image loading."""

from __future__ import annotations

import base64
import inspect
import io
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from transformers import AutoImageProcessor, AutoModelForImageTextToText

from vlmserve.errors import InvalidImageError, InvalidRequestError
from vlmserve.models.qwen2_vl_processing import Qwen2VLInputProcessor
from vlmserve.multimodal.hashing import hash_image
from vlmserve.multimodal.image import load_image
from vlmserve.multimodal.inputs import pixel_values

SIZES = [(60, 90), (200, 50), (128, 128)]  # three different grids


def random_image(h: int, w: int, seed: int = 0) -> Image.Image:
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8))


def png_bytes(image: Image.Image) -> bytes:
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return buf.getvalue()


def chat(num_images: int) -> list[dict]:
    parts: list[dict] = []
    for i in range(num_images):
        parts += [{"type": "text", "text": f"Image {i}:"}, {"type": "image"}]
    return [{"role": "user", "content": [*parts, {"type": "text", "text": "Describe."}]}]


@pytest.fixture(scope="module", params=["tiny_qwen2_vl_path", "tiny_qwen25_vl_path",
                                        "tiny_qwen3_vl_path"])
def model_and_processor(request: pytest.FixtureRequest):
    path = request.getfixturevalue(request.param)
    model = AutoModelForImageTextToText.from_pretrained(path).eval()
    return path, model, Qwen2VLInputProcessor(path, model.config)


@pytest.fixture(scope="module")
def processor(tiny_qwen2_vl_path: Path) -> Qwen2VLInputProcessor:
    return Qwen2VLInputProcessor(tiny_qwen2_vl_path)


def test_chat_template_renders_image_parts(processor: Qwen2VLInputProcessor) -> None:
    text = processor.apply_chat_template(chat(1))
    assert text == (
        "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
        "<|im_start|>user\nImage 0:<|vision_start|><|image_pad|><|vision_end|>Describe.<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    own_system = processor.apply_chat_template(
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    )
    assert own_system == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"
        "<|im_start|>assistant\n"
    )


def test_expansion_matches_hf_image_processor(model_and_processor) -> None:
    path, model, proc = model_and_processor
    images = [random_image(h, w, seed=i) for i, (h, w) in enumerate(SIZES)]
    out = proc.process(proc.apply_chat_template(chat(3)), None, images)
    hf = AutoImageProcessor.from_pretrained(path)(images=images, return_tensors="pt")

    grids = [tuple(g) for g in hf["image_grid_thw"].tolist()]
    assert [i.encoder_meta for i in out.images] == grids
    assert len(set(grids)) == 3
    assert torch.equal(pixel_values(out.images), hf["pixel_values"])
    image_token = model.config.image_token_id
    ids = out.prompt_token_ids
    for image, (t, h, w) in zip(out.images, grids, strict=True):
        assert image.length == t * h * w // 4 == pixel_values([image]).shape[0] // 4
        run = ids[image.offset : image.offset + image.length]
        assert run == [image_token] * image.length
        assert (
            ids[image.offset - 1] != image_token and ids[image.offset + image.length] != image_token
        )
    assert ids.count(image_token) == sum(i.length for i in out.images)

    again = proc.process(None, ids, images)  # an already expanded prompt is accepted as is
    assert again.prompt_token_ids == ids
    assert [(i.offset, i.length) for i in again.images] == [
        (i.offset, i.length) for i in out.images
    ]


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs CUDA"))])
def test_pixels_match_hf_bit_for_bit(processor: Qwen2VLInputProcessor, device: str) -> None:
    """Host resize + device rescale/normalize/patchify == the HF processor's pixel_values,
    exactly: sizes kept as they are, scaled down, scaled up, odd aspect ratios, non-RGB
    modes; images of one size go through the transform as one batch."""
    hf = AutoImageProcessor.from_pretrained(processor.model_path)
    rng = np.random.default_rng(3)
    images = [random_image(h, w, seed=i) for i, (h, w) in enumerate(
        [(56, 84), (56, 84), (28, 28), (20, 30), (333, 517), (700, 41), (640, 480)])]
    images.append(Image.fromarray(rng.integers(0, 256, (70, 90), dtype=np.uint8), mode="L"))
    images.append(Image.fromarray(rng.integers(0, 256, (60, 60, 4), dtype=np.uint8)))  # RGBA
    pad, sep = processor.image_token_id, 1
    out = processor.process(None, [pad, sep] * len(images), images)
    assert [tuple(i.pixels.shape) for i in out.images][:2] == [(56, 84, 3)] * 2  # not resized
    ref = hf(images=[im.convert("RGB") for im in images], return_tensors="pt")
    grids = [tuple(g) for g in ref["image_grid_thw"].tolist()]
    assert [i.encoder_meta for i in out.images] == grids
    on_device = [i.pixels.to(device) for i in out.images]
    assert torch.equal(pixel_values(out.images, on_device).cpu(), ref["pixel_values"])
    half = pixel_values(out.images, on_device, torch.bfloat16).cpu()
    assert half.dtype == torch.bfloat16
    assert torch.equal(half, ref["pixel_values"].to(torch.bfloat16))


@pytest.mark.parametrize("num_images", [0, 1, 3])
def test_mrope_positions_match_hf_get_rope_index(model_and_processor, num_images: int) -> None:
    _, model, proc = model_and_processor
    images = [random_image(h, w, seed=i) for i, (h, w) in enumerate(SIZES[:num_images])]
    out = proc.process(proc.apply_chat_template(chat(num_images)), None, images)

    ids = torch.tensor([out.prompt_token_ids])
    kwargs = {}
    if images:
        kwargs["image_grid_thw"] = torch.tensor([i.encoder_meta for i in out.images])
    if "mm_token_type_ids" in inspect.signature(model.model.get_rope_index).parameters:
        kwargs["mm_token_type_ids"] = (ids == model.config.image_token_id).int()
    positions, delta = model.model.get_rope_index(ids, **kwargs)

    assert out.prompt_positions.shape == (3, len(out.prompt_token_ids))
    assert torch.equal(out.prompt_positions, positions[:, 0])
    assert out.position_offset == int(delta)
    if num_images == 0:
        assert out.position_offset == 0
        assert torch.equal(out.prompt_positions[0], torch.arange(ids.shape[1]))
    else:
        assert out.position_offset < 0  # images use fewer positions than tokens


def test_placeholder_count_mismatch_names_both_counts(processor: Qwen2VLInputProcessor) -> None:
    prompt = processor.apply_chat_template(chat(2))
    with pytest.raises(InvalidRequestError, match=r"2 image placeholder.*1 image"):
        processor.process(prompt, None, [random_image(56, 56)])
    with pytest.raises(InvalidRequestError, match=r"0 image placeholder.*1 image"):
        processor.process("no images here", None, [random_image(56, 56)])


def test_placeholder_text_in_a_message_stays_a_plain_token(
        processor: Qwen2VLInputProcessor) -> None:
    """A message's text may hold placeholder strings (vLLM's random-mm prompts are random
    tokens and sometimes do): the image goes where the template framed it, the strays stay one
    token each, as in vLLM. Placeholders the template did not frame still count as before."""
    stray = "words <|video_pad|> more <|vision_start|><|image_pad|>"
    messages = [{"role": "user", "content": [{"type": "text", "text": stray},
                                             {"type": "image"}]}]
    prompt = processor.apply_chat_template(messages)
    image = random_image(56, 56)  # 4 tokens
    out = processor.process(prompt, None, [image])
    clean = processor.process(processor.apply_chat_template(chat(1)), None, [image])
    (placed,) = out.images
    framed = processor.token_ids(prompt, None)
    start = framed.index(processor.hf_config.vision_end_token_id) - 1  # the framed pad
    assert placed.offset == start and placed.length == clean.images[0].length == 4
    ids = out.prompt_token_ids
    assert ids[start:start + 4] == [processor.image_token_id] * 4
    assert ids.count(processor.image_token_id) == 5  # the stray pad stays one token
    assert ids.count(processor.video_token_id) == 1
    assert out.prompt_positions.shape[1] == len(ids)
    # text positions run on through the strays; the image's block follows its frame
    assert out.prompt_positions[0, start] == out.prompt_positions[0, start - 1] + 1
    with pytest.raises(InvalidRequestError, match=r"2 image placeholder.*1 image"):
        processor.process("<|image_pad|> and <|image_pad|>", None, [image])


def test_rejects_bad_runs_and_bad_arguments(processor: Qwen2VLInputProcessor) -> None:
    pad = processor.image_token_id
    image = random_image(56, 56)  # 4x4 patches -> 4 tokens
    ok = processor.process(None, [1, pad, 2], [image])
    assert ok.prompt_token_ids == [1, pad, pad, pad, pad, 2]
    with pytest.raises(InvalidRequestError, match="3 tokens; expected 1 or 4"):
        processor.process(None, [1, pad, pad, pad, 2], [image])
    with pytest.raises(InvalidRequestError, match="exactly one"):
        processor.process("hi", [1, 2], [])
    with pytest.raises(InvalidRequestError, match="exactly one"):
        processor.process(None, None, [])
    with pytest.raises(InvalidImageError, match="aspect ratio"):
        processor.process("<|image_pad|>", None, [Image.new("RGB", (1, 300))])
    with pytest.raises(InvalidRequestError, match="video"):
        processor.process("<|vision_start|><|video_pad|><|vision_end|>", None, [])


def test_image_hashes(processor: Qwen2VLInputProcessor, tiny_qwen25_vl_path: Path) -> None:
    a, a_copy, b = (
        random_image(40, 50, seed=0),
        random_image(40, 50, seed=0),
        random_image(40, 50, 1),
    )
    assert hash_image(a) == hash_image(a_copy)
    assert hash_image(a) != hash_image(b)
    assert hash_image(a) != hash_image(a, extra="other settings")
    assert hash_image(a) != hash_image(a.convert("L").convert("RGB"))
    assert hash_image(Image.new("RGB", (2, 3))) != hash_image(Image.new("RGB", (3, 2)))
    assert hash_image(np.asarray(a)) == hash_image(a)  # the array path hashes the same bytes
    assert hash_image(np.asarray(a)[:, ::-1]) == hash_image(a.transpose(Image.FLIP_LEFT_RIGHT))

    prompt = processor.apply_chat_template(chat(3))
    out = processor.process(prompt, None, [a, b, a_copy])
    hashes = [i.mm_hash for i in out.images]
    assert hashes[0] == hashes[2] != hashes[1]
    other_model = Qwen2VLInputProcessor(tiny_qwen25_vl_path).process(prompt, None, [a, b, a_copy])
    assert other_model.images[0].mm_hash != hashes[0]


def test_load_image_sources(tmp_path: Path) -> None:
    image = random_image(20, 30)
    data = png_bytes(image)
    (tmp_path / "a.png").write_bytes(data)
    url = "data:image/png;base64," + base64.b64encode(data).decode()
    wrapped = "data:image/png;base64," + base64.encodebytes(data).decode()  # 76-char lines
    for src in [
        image,
        data,
        url,
        wrapped,
        str(tmp_path / "a.png"),
        tmp_path / "a.png",
        (tmp_path / "a.png").as_uri(),
    ]:
        loaded = load_image(src, allowed_local_dir=str(tmp_path))
        assert loaded.mode == "RGB" and loaded.size == (30, 20)
        assert loaded.tobytes() == image.tobytes()

    rgba = Image.new("RGBA", (4, 4), (0, 0, 0, 0))  # fully transparent -> white
    assert load_image(png_bytes(rgba)).getpixel((0, 0)) == (255, 255, 255)
    assert load_image(Image.new("L", (3, 3), 7)).getpixel((1, 1)) == (7, 7, 7)


@pytest.mark.parametrize(
    "src, message",
    [
        (b"definitely not an image", "could not decode"),
        (b"", "empty"),
        (png_bytes(random_image(20, 30))[:60], "could not decode"),  # truncated file
        (Image.new("RGB", (0, 0)), "zero size"),
        ("data:image/png;base64,@@not-base64@@", "invalid base64"),
        ("data:image/png,rawbytes", "base64"),
        ("data:text/plain;base64,aGVsbG8=", "not an image"),
        ("data:image/png;base64", "malformed data URL"),
        ("/no/such/dir/image.png", "not found"),
        ("file:///no/such/image.png", "not found"),
        ("https://example.com/cat.png", "remote image URLs are not allowed"),
        (12345, "unsupported image source"),
    ],
)
def test_load_image_errors(src, message: str) -> None:
    with pytest.raises(InvalidImageError, match=message):
        load_image(src)


def test_load_image_restrictions(tmp_path: Path) -> None:
    allowed, outside = tmp_path / "allowed", tmp_path / "outside"
    allowed.mkdir()
    outside.mkdir()
    data = png_bytes(random_image(20, 30))
    (outside / "x.png").write_bytes(data)
    (allowed / "link.png").symlink_to(outside / "x.png")
    for src in [outside / "x.png", str(allowed / ".." / "outside" / "x.png"), allowed / "link.png"]:
        with pytest.raises(InvalidImageError, match="outside the allowed directory"):
            load_image(src, allowed_local_dir=str(allowed))
    assert load_image(outside / "x.png").size == (30, 20)  # no restriction when not given
    with pytest.raises(InvalidImageError, match="600 pixels exceeds the limit of 599"):
        load_image(data, max_pixels=599)
    assert load_image(data, max_pixels=600).size == (30, 20)


def test_chat_template_gets_tools_and_tool_messages(processor) -> None:
    """Tools (OpenAI's function definitions), an assistant's tool calls and a tool's answer
    reach the chat template as transformers passes them (a template of Qwen2.5's kind shows
    them)."""
    tok = processor.tokenizer
    saved = tok.chat_template
    tok.chat_template = (
        "{% for t in tools or [] %}TOOL {{ t.function.name }}\n{% endfor %}"
        "{% for m in messages %}{{ m.role }}: {{ m.content }}"
        "{% for c in m.tool_calls or [] %} CALL {{ c.function.name }}{% endfor %}"
        "{% if m.tool_call_id %} FOR {{ m.tool_call_id }}{% endif %}\n{% endfor %}")
    try:
        from vlmserve.inputs.chat import parse_chat_messages

        msgs, _, _ = parse_chat_messages([
            {"role": "user", "content": "Weather?"},
            {"role": "assistant", "content": None, "tool_calls": [
                {"id": "c1", "type": "function",
                 "function": {"name": "weather", "arguments": "{}"}}]},
            {"role": "tool", "tool_call_id": "c1", "content": "sunny"}])
        text = processor.apply_chat_template(
            msgs, [{"type": "function", "function": {"name": "weather"}}])
    finally:
        tok.chat_template = saved
    assert text.replace("\n", "") == ("TOOL weatheruser: Weather?assistant:  CALL weather"
                                      "tool: sunny FOR c1")


@pytest.mark.parametrize("kwargs", [{"max_pixels": 112 * 112}, {"min_pixels": 224 * 224},
                                    {"size": {"shortest_edge": 84 * 84,
                                              "longest_edge": 168 * 168}}])
def test_mm_processor_kwargs_resize_as_hf_does(model_and_processor, kwargs) -> None:
    """A request's `mm_processor_kwargs` (and the engine's) resize its images as the HF
    processor given the same options: the same grids and pixel values, bit for bit; the
    images hash apart from the engine's way of processing them."""
    path, model, proc = model_and_processor
    images = [random_image(h, w, seed=i) for i, (h, w) in enumerate(SIZES)]
    options = proc.image_options(kwargs)
    out = proc.process(proc.apply_chat_template(chat(3)), None, images, options)
    hf_kwargs = dict(kwargs)
    if "size" not in hf_kwargs:  # transformers takes them as its size
        hf_kwargs = {"size": {"shortest_edge": kwargs.get("min_pixels", proc.min_pixels),
                              "longest_edge": kwargs.get("max_pixels", proc.max_pixels)}}
    hf = AutoImageProcessor.from_pretrained(path)(images=images, return_tensors="pt",
                                                 **hf_kwargs)
    assert [i.encoder_meta for i in out.images] == [tuple(g) for g in
                                                    hf["image_grid_thw"].tolist()]
    assert torch.equal(pixel_values(out.images), hf["pixel_values"])
    plain = proc.process(proc.apply_chat_template(chat(3)), None, images)
    assert [i.encoder_meta for i in plain.images] != [i.encoder_meta for i in out.images]
    assert not {i.mm_hash for i in plain.images} & {i.mm_hash for i in out.images}
    engine = Qwen2VLInputProcessor(path, model.config, kwargs)  # the engine's own options
    same = engine.process(engine.apply_chat_template(chat(3)), None, images)
    assert [i.encoder_meta for i in same.images] == [i.encoder_meta for i in out.images]
    if "max_pixels" in kwargs:
        unit = proc.patch_size * proc.merge_size
        assert engine.max_image_tokens == kwargs["max_pixels"] // unit**2


@pytest.mark.parametrize("kwargs, message", [
    ({"max_pixel": 5}, r"unknown option\(s\) \['max_pixel'\]"),
    ({"max_pixels": 0}, "max_pixels must be a positive integer"),
    ({"min_pixels": "1"}, "min_pixels must be a positive integer"),
    ({"min_pixels": 9000, "max_pixels": 100}, "min_pixels 9000 exceeds max_pixels 100"),
    ({"size": {"height": 3}}, "size must be an object"),
    ([1], "must be an object"),
])
def test_mm_processor_kwargs_errors_name_the_problem(processor, kwargs, message) -> None:
    with pytest.raises(InvalidRequestError, match=message):
        processor.image_options(kwargs)


@pytest.mark.parametrize("path", ["tiny_qwen2_vl_path", "tiny_qwen3_vl_path"])
def test_video_rows_equal_the_hf_video_processor(path: str,
                                                 request: pytest.FixtureRequest) -> None:
    """Frames that need resizing (and an odd count: the last repeated) give the rows and grid
    of transformers' video processor, bit for bit (it needs torchvision: the GPU machine)."""
    pytest.importorskip("torchvision")
    from transformers import AutoVideoProcessor

    from vlmserve.multimodal.video import Video

    path = request.getfixturevalue(path)
    processor = Qwen2VLInputProcessor(path)
    frames = np.random.default_rng(3).integers(0, 256, (5, 100, 150, 3), np.uint8)
    hf = AutoVideoProcessor.from_pretrained(path)(
        videos=[[Image.fromarray(f) for f in frames]], return_tensors="pt",
        do_sample_frames=False)
    _, pixels, grid = processor.prepare_video(Video(frames))
    assert grid == tuple(hf["video_grid_thw"][0].tolist())
    assert torch.equal(processor.pixel_transform(pixels[None], torch.float32),
                       hf["pixel_values_videos"])


VIDEO_MEAN, VIDEO_STD = [0.1, 0.2, 0.3], [0.9, 0.8, 0.7]


def _with_video_config(path: Path, folder: Path, **settings) -> Path:
    """The checkpoint at `path` (its files linked) with a video_preprocessor_config.json of
    its own: the image processor's settings but another mean and std, another pixel range
    and qwen-vl-utils' cap (`cap_pixels_per_frame`, `max_video_tokens`)."""
    import json

    folder.mkdir()
    for f in path.iterdir():
        (folder / f.name).symlink_to(f)
    image = json.loads((path / "preprocessor_config.json").read_text())
    qwen3 = "qwen3" in json.loads((path / "config.json").read_text())["model_type"]
    video = {k: v for k, v in image.items()
             if k not in ("image_processor_type", "min_pixels", "max_pixels")}
    video.update(video_processor_type="Qwen3VLVideoProcessor" if qwen3
                 else "Qwen2VLVideoProcessor", image_mean=VIDEO_MEAN, image_std=VIDEO_STD,
                 do_sample_frames=False, size={"shortest_edge": 28 * 28 * 4,
                                               "longest_edge": 28 * 28 * 200}, **settings)
    (folder / "video_preprocessor_config.json").write_text(json.dumps(video))
    return folder


@pytest.mark.parametrize("path", ["tiny_qwen2_vl_path", "tiny_qwen25_vl_path",
                                  "tiny_qwen3_vl_path"])
@pytest.mark.parametrize("max_video_tokens", [40, 3])
def test_videos_follow_the_video_processor_config_as_transformers(
        path: str, max_video_tokens: int, request: pytest.FixtureRequest,
        tmp_path: Path) -> None:
    """A checkpoint whose video_preprocessor_config.json has its own mean, std, pixel range
    and per-frame cap: token ids, grids and pixel rows equal transformers' whole processor
    (`AutoProcessor`) on the same folder, bit for bit (the image processor's mean and std,
    and no cap, gave other rows and grids; it needs torchvision: the GPU machine)."""
    pytest.importorskip("torchvision")
    from transformers import AutoProcessor

    from vlmserve.multimodal.video import Video

    folder = _with_video_config(request.getfixturevalue(path), tmp_path / "ckpt",
                                cap_pixels_per_frame=True, max_video_tokens=max_video_tokens)
    frames = np.random.default_rng(0).integers(0, 256, (8, 120, 200, 3), np.uint8)
    text = "<|im_start|>user\n<|vision_start|><|video_pad|><|vision_end|>What?<|im_end|>\n"
    ours = Qwen2VLInputProcessor(folder).process(text, None, [], videos=[Video(frames)])
    hf = AutoProcessor.from_pretrained(folder)(
        text=[text], videos=[[Image.fromarray(f) for f in frames]], return_tensors="pt",
        do_sample_frames=False)
    assert ours.prompt_token_ids == hf["input_ids"][0].tolist()
    t, h, w = hf["video_grid_thw"][0].tolist()
    assert {img.encoder_meta[1:] for img in ours.images} == {(h, w)}
    assert sum(img.encoder_meta[0] for img in ours.images) == t
    rows = torch.cat([img.transform(img.pixels[None], torch.float32) for img in ours.images])
    assert torch.equal(rows, hf["pixel_values_videos"])


def test_video_rows_use_the_video_mean_std_and_cap(tiny_qwen2_vl_path: Path,
                                                   tmp_path: Path) -> None:
    """Without transformers' video processor (no torchvision): a one-colour video's rows are
    (value - mean * 255) / (std * 255) with the video config's mean and std (the fused order
    of transformers' video processors), not the image processor's; its cap holds 8 frames of
    120x200 to 90% of 40 tokens' pixels a temporal patch: 4 x 6 patches (8 x 14 without)."""
    from vlmserve.multimodal.video import Video

    folder = _with_video_config(tiny_qwen2_vl_path, tmp_path / "ckpt",
                                cap_pixels_per_frame=True, max_video_tokens=40)
    processor = Qwen2VLInputProcessor(folder)
    frames = np.full((8, 120, 200, 3), (10, 100, 250), np.uint8)
    (video,) = processor.process("<|video_pad|>", None, [], videos=[Video(frames)]).images
    assert video.encoder_meta == (4, 4, 6)
    rows = video.transform(video.pixels[None], torch.float32)  # [96, 3 * 2 * 14 * 14]
    want = [(torch.tensor(v, dtype=torch.float32) - torch.tensor(m, dtype=torch.float32)
             * 255.0) / (torch.tensor(s, dtype=torch.float32) * 255.0)
            for v, m, s in zip((10, 100, 250), VIDEO_MEAN, VIDEO_STD)]
    assert torch.equal(rows.view(96, 3, -1), torch.stack(want).view(1, 3, 1).expand(96, 3, 392))
    uncapped = Qwen2VLInputProcessor(_with_video_config(tiny_qwen2_vl_path, tmp_path / "b"))
    assert uncapped.process("<|video_pad|>", None, [], videos=[Video(frames)]
                            ).images[0].encoder_meta == (4, 8, 14)
