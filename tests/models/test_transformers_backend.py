"""The transformers backend (`model_impl="transformers"`): greedy output token for token equal
to transformers' own `generate` on its own processor's inputs, for every architecture of the
table: tiny checkpoints built here from transformers' config classes (`tests/models/hf_tiny.py`)
and the built-in families run through the backend instead of their native classes. The six
native families (the Qwen built-ins, llava, llava_next) run the same table through their native
classes too (`model_impl="native"`).

Each architecture runs one engine through: a batch of text-only, one-image and two-image
prompts together, then the same prompts with a step budget small enough that prefill chunks
cut through images (or, for a model that reads an image's tokens both ways, end right before
one), and a second pass over the first prompts (prefix-cache and encoder-cache hits)."""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch
from PIL import Image

from tests.engine.helpers import make_image, watch_live_blocks
from tests.models.hf_tiny import (
    FLAT_IMAGES,
    NEEDS_TORCHVISION,
    NO_CHAT_TEMPLATE,
    SINGLE_IMAGE,
    TINY_ARCHS,
    build_tiny,
    plain_prompt,
)
from vlmserve import LLM, SamplingParams
from vlmserve.layers.vision_attention import varlen_attention
from vlmserve.models.transformers_fused import VISION_ATTENTION_NAME

MAX_TOKENS = 6
DEVICE = os.environ.get("VLMSERVE_TEST_DEVICE", "cpu")
HAS_TORCHVISION = importlib.util.find_spec("torchvision") is not None
# built-in checkpoints of native families (their transformers path is the backend's check on
# models we know); the Qwen processors of transformers 5 need torchvision
BUILTIN = {"tiny-llava-1.5": False, "tiny-llava-next": False, "tiny-qwen2-vl": True,
           "tiny-qwen2.5-vl": True, "tiny-qwen3-vl": True, "tiny-qwen3-vl-moe": True}
# the native families' rows: each also runs through its native class
NATIVE = frozenset({"tiny-qwen2-vl", "tiny-qwen2.5-vl", "tiny-qwen3-vl", "tiny-qwen3-vl-moe",
                    "llava", "llava_next"})
_NO_TORCHVISION = pytest.mark.skipif(not HAS_TORCHVISION, reason="its processor needs "
                                     "torchvision")


# those whose vision tower transformers runs on a varlen path: the engine's varlen attention
# runs it (one call a layer for every image and window)
VARLEN_VISION = frozenset({"tiny-qwen2-vl", "tiny-qwen2.5-vl", "tiny-qwen3-vl",
                           "tiny-qwen3-vl-moe", "glm4v", "hunyuan_vl", "paddleocr_vl"})


# models whose processor refuses a prompt without an image (a classifier, an OCR model)
IMAGES_ONLY = frozenset({"shieldgemma2", "got_ocr2", "blip-2", "paligemma"})
# transformers pads a prompt's images to one size before the tower (Emu3's VQ encoder then
# sees the padding): several images of different sizes give other codes there than alone,
# and the backend encodes each image alone
PADS_IMAGES = frozenset({"emu3"})
# architectures the backend refuses at load, and the reason its one line gives
REFUSED = {"granite4_vision": "inside the decoder's layers",
           "ovis2": "visual vocabulary", "granite_docling": "inside the decoder's layers",
           "instructblip": "depend on the prompt's text"}
# served, but not yet token for token: what differs (a strict xfail: CI says when it passes)
OPEN = {"shieldgemma2": "an image prompt's first token differs (its processor builds a "
                        "policy prompt around each image)"}


def _params() -> list:
    out = [pytest.param(("builtin", name), id=name, marks=[_NO_TORCHVISION] if needs else [])
           for name, needs in BUILTIN.items()]
    return out + [pytest.param(("tiny", arch), id=arch, marks=(
        [pytest.mark.xfail(strict=True, reason=OPEN[arch])] if arch in OPEN else []) + (
        [_NO_TORCHVISION] if arch in NEEDS_TORCHVISION else []))
        for arch in TINY_ARCHS if arch not in REFUSED]


class Reference:
    """transformers' processor and model on the same folder: `generate` of a prompt."""

    def __init__(self, path, flat: bool = False) -> None:
        from transformers import AutoProcessor

        from vlmserve.models.loader import load_hf_config
        from vlmserve.models.transformers_backend import hf_model_class

        self.processor = AutoProcessor.from_pretrained(path)
        cls = hf_model_class(load_hf_config(path))
        self.model = cls.from_pretrained(path, dtype=torch.float32).to(DEVICE).eval()
        self.flat = flat

    @torch.inference_mode()
    def generate(self, prompt: str, images: list[Image.Image]) -> list[int]:
        batch = (images if self.flat else [images]) if images else None
        inputs = self.processor(text=[prompt], images=batch, return_tensors="pt").to(DEVICE)
        if "pixel_values" in inputs and inputs["pixel_values"].is_floating_point():
            inputs["pixel_values"] = inputs["pixel_values"].float()
        out = self.model.generate(**inputs, max_new_tokens=MAX_TOKENS, do_sample=False,
                                  eos_token_id=None, pad_token_id=0)
        return out[0, inputs["input_ids"].shape[1]:].tolist()


@pytest.fixture(scope="module", params=_params())
def arch(request, vlmserve_cache, tmp_path_factory):
    kind, name = request.param
    if kind == "builtin":
        from vlmserve.models.builtin import resolve_model

        path = resolve_model(name)
    else:
        path = build_tiny(name, tmp_path_factory.mktemp(name))
    return name, str(path), Reference(str(path), flat=name in FLAT_IMAGES)


def _prompts(llm: LLM, name: str) -> list[tuple[str, list[Image.Image]]]:
    processor = llm.engine.input_processor.model_processor

    def chat(text: str, images: list[Image.Image]) -> str:
        if name in NO_CHAT_TEMPLATE:
            return plain_prompt(name, len(images)) if images else text
        parts = [{"type": "image"} for _ in images] + [{"type": "text", "text": text}]
        return processor.apply_chat_template([{"role": "user", "content": parts}])

    one, two, three = make_image(40, 30, 1), make_image(64, 48, 2), make_image(30, 60, 3)
    last = ([(chat("And this one?", [two]), [two])] if name in SINGLE_IMAGE | PADS_IMAGES else
            [(chat("Compare the two images.", [two, three]), [two, three])])
    text = [] if name in IMAGES_ONLY else [(chat("The quick brown fox jumps.", []), [])]
    return [*text, (chat("What is in this picture?", [one]), [one]), *last]


def _run(llm: LLM, prompts) -> list[list[int]]:
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    inputs = [{"prompt": p, "multi_modal_data": {"image": imgs}} if imgs else {"prompt": p}
              for p, imgs in prompts]
    return [o.outputs[0].token_ids for o in llm.generate(inputs, params, use_tqdm=False)]


def test_greedy_parity_batched_and_chunked(arch):
    name, path, ref = arch
    seen: dict[tuple, list[int]] = {}  # the reference's output by prompt and images
    for impl in ("transformers", "native") if name in NATIVE else ("transformers",):
        _check(name, path, ref, impl, seen)


def _check(name: str, path: str, ref: Reference, impl: str, seen: dict) -> None:
    """One engine of ``impl`` through the table's prompts: batched, cached and chunked."""
    llm = LLM(path, model_impl=impl, dtype="float32", device=DEVICE,
              enable_prefix_caching=True)
    backend = type(llm.engine.core.executor.runner.model).__name__ == "TransformersVLM"
    assert backend == (impl == "transformers"), (name, impl)
    name_impl = f"{name} ({impl})"
    prompts = _prompts(llm, name)
    expected = []
    for p, imgs in prompts:
        key = (p, *(im.tobytes() for im in imgs))
        if key not in seen:
            seen[key] = ref.generate(p, imgs)
        expected.append(seen[key])
    assert _run(llm, prompts) == expected, name_impl
    assert _run(llm, prompts[1:]) == expected[1:], f"{name_impl}: cached prefixes and images"
    # chunks of a quarter of the longest image (at least 8 tokens) cut through every image,
    # unless the model reads images both ways: then the step holds the longest image whole
    # (and a model that reads its whole prompt both ways computes each prompt in one step)
    processed = [llm.engine.input_processor.process(
        {"prompt": p, "multi_modal_data": {"image": imgs}} if imgs else p)
        for p, imgs in prompts]
    longest = max(f.length for pp in processed for f in pp.images)
    if not llm.engine.core.scheduler.enable_chunked_prefill:
        assert not llm.engine.core.scheduler.kv.enable_prefix_caching
        budget = max(len(pp.prompt_token_ids) for pp in processed)
    elif llm.engine.core.scheduler.whole_images:
        budget = longest
    else:
        budget = max(longest // 4, 8)
    chunked = LLM(path, model_impl=impl, dtype="float32", device=DEVICE,
                  max_num_batched_tokens=budget, max_num_seqs=2)
    calls = []
    if impl == "transformers":  # the vision towers on the engine's varlen attention
        model = chunked.engine.core.executor.runner.model
        varlen = {m.config._attn_implementation == VISION_ATTENTION_NAME
                  for m in model.hf.modules() if hasattr(m, "config")}
        assert (True in varlen) == (name in VARLEN_VISION), name

        def counted(q, k, v, cu_seqlens, max_seqlen, scale=None):  # as flash and triton
            calls.append(max_seqlen)
            return varlen_attention(q, k, v, cu_seqlens, scale=scale)
        model.set_vision_attention_backend(counted)
    assert _run(chunked, prompts) == expected, f"{name_impl}: chunked at {budget}"
    assert bool(calls) == (impl == "transformers" and name in VARLEN_VISION), name
    if impl == "transformers":  # their grids read on the host throughout (no fallback)
        assert model.grids.on == (name in VARLEN_VISION), name


@pytest.mark.parametrize("name", [pytest.param(n, marks=[_NO_TORCHVISION] if n in NEEDS_TORCHVISION
                                                else []) for n in sorted(REFUSED)])
def test_refused_in_one_line(name, tmp_path):
    """An architecture the backend cannot serve exactly fails at load with one line naming
    the reason."""
    path = build_tiny(name, tmp_path / name)
    with pytest.raises(ValueError, match=REFUSED[name]) as err:
        LLM(str(path), model_impl="transformers", dtype="float32", device=DEVICE)
    assert "\n" not in str(err.value) and name in str(err.value)


def test_text_both_ways_refused_in_one_line():
    """A Gemma 4 whose text attends both ways over the whole sequence (an encoder's
    `use_bidirectional_attention="all"`) is refused in one line; `"vision"` is served."""
    import transformers as tf

    from vlmserve.models.transformers_backend import check_supported

    def config(mode):
        text = dict(num_hidden_layers=2, use_bidirectional_attention=mode)
        return tf.Gemma4Config(text_config=text, vision_config=dict(num_hidden_layers=1))

    check_supported(config("vision"))
    with pytest.raises(ValueError, match="both ways over the whole sequence") as err:
        check_supported(config("all"))
    assert "\n" not in str(err.value) and "gemma4" in str(err.value)


def test_layers_neither_attention_nor_convolutions_refused_in_one_line():
    """LFM2's short convolutions are served; a text layer of another kind (linear attention
    here) is refused in one line naming it."""
    import transformers as tf

    from vlmserve.models.transformers_backend import check_supported

    def config(kinds):
        return tf.Lfm2VlConfig(text_config=dict(num_hidden_layers=2, layer_types=kinds))

    check_supported(config(["conv", "full_attention"]))
    with pytest.raises(ValueError, match="layers of kind") as err:
        check_supported(config(["linear_attention", "full_attention"]))
    assert "\n" not in str(err.value) and "lfm2_vl" in str(err.value)


@pytest.mark.parametrize("name", [pytest.param(n, marks=[_NO_TORCHVISION] if n in
                                                NEEDS_TORCHVISION else [])
                                  for n in ("gemma3", "llama4", "paligemma")])
def test_windowed_layers_hold_only_their_window(name, vlmserve_cache, tmp_path):
    """Sliding (Gemma 3, PaliGemma's Gemma 2) and chunked (Llama 4) layers keep their KV in
    cache groups of their own, which free the blocks a window has left: a request's blocks
    there stop growing while it decodes past the window, and the tokens stay transformers'."""
    from vlmserve.models.transformers_families import layer_windows

    path = str(build_tiny(name, tmp_path / name))
    ref = Reference(path, flat=name in FLAT_IMAGES)
    block = 4
    llm = LLM(path, model_impl="transformers", dtype="float32", device=DEVICE,
              block_size=block, max_num_batched_tokens=32)
    kinds = [g.kind for g in llm.engine.core.executor.cache_groups]
    windows = {w for w in layer_windows(llm.engine.core.hf_config) if w is not None}
    # a full group, then a group per window
    assert kinds[0].kind == "full" and sorted((k.kind, k.size) for k in kinds[1:]) == sorted(
        (w.kind, w.size) for w in windows)
    live = watch_live_blocks(llm)
    prompt, images = _prompts(llm, name)[-2 if name in IMAGES_ONLY else 0]
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    inputs = {"prompt": prompt, "multi_modal_data": {"image": images}} if images else prompt
    got = llm.generate([inputs], params, use_tqdm=False)[0].outputs[0].token_ids
    ref_out = ref.model.generate(**ref.processor(
        text=[prompt], images=((images if ref.flat else [images]) if images else None),
        return_tensors="pt").to(DEVICE), max_new_tokens=40, do_sample=False,
        eos_token_id=None, pad_token_id=0)
    assert got == ref_out[0, -40:].tolist()
    per_group = list(zip(*live))
    assert max(per_group[0]) >= 40 // block  # the full group holds every position
    for kind, counts in zip(kinds[1:], per_group[1:], strict=True):
        assert max(counts[-20:]) <= kind.max_blocks(block, 1), kind  # decodes: the window


@pytest.mark.parametrize("size", [(300, 3), (200, 1)])
def test_images_of_one_or_three_pixels_are_read_channels_last(size, vlmserve_cache, tmp_path):
    """A red image 3 (or 1) pixels high or wide: transformers' image processors would take
    its [3, W, 3] array for a 3-channel image; each channel comes out one colour."""
    from vlmserve.models.loader import load_hf_config
    from vlmserve.models.transformers_packing import unpack_meta, unpack_tensors
    from vlmserve.models.transformers_processing import TransformersInputProcessor

    path = build_tiny("emu3", tmp_path / "emu3")  # (read so with or without torchvision)
    processor = TransformersInputProcessor(path, load_hf_config(path, "transformers"))
    prompt = processor.apply_chat_template(
        [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What?"}]}])
    red = Image.new("RGB", size, (255, 0, 0))
    image = processor.process(prompt, None, [red]).images[0]
    pixels = unpack_tensors(image.pixels, unpack_meta(image.encoder_meta))["pixel_values"]
    r, g, b = (pixels[0, c] for c in range(3))
    assert all(torch.allclose(x, x.flatten()[0].expand_as(x)) for x in (r, g, b))
    assert r.flatten()[0] > 1 > -1 > max(g.flatten()[0], b.flatten()[0])  # (normalized)
    # an operator's own input_data_format (mm_processor_kwargs) is the one given
    own = TransformersInputProcessor(path, load_hf_config(path, "transformers"),
                                     {"input_data_format": "channels_last"})
    image = own.process(prompt, None, [red]).images[0]
    assert torch.equal(unpack_tensors(image.pixels, unpack_meta(image.encoder_meta))[
        "pixel_values"], pixels)


@_NO_TORCHVISION
def test_gemma4s_shared_layers_read_their_sources_cache(vlmserve_cache, tmp_path):
    """Gemma 4's last layers reuse an earlier layer's keys and values: their cache is that
    layer's tensor; each layer's cache has its own KV heads and head size (the full layers
    1 KV head of 32, the sliding ones 2 of 16), and the KV cache is sized by what the
    layers that hold one take."""
    from vlmserve.worker.kv_cache import kv_block_bytes

    path = str(build_tiny("gemma4", tmp_path / "gemma4"))
    llm = LLM(path, model_impl="transformers", dtype="float32", device=DEVICE)
    runner = llm.engine.core.executor.runner
    model = runner.model
    assert model.kv_sources == {3: 0, 4: 2}  # (layer types: sliding, full, full, sliding, full)
    caches = runner.kv_caches
    assert caches[3] is caches[0] and caches[4] is caches[2]
    assert len({id(c) for c in caches}) == 3
    assert [tuple(c.shape[-2:]) for c in caches] == [(2, 16), (1, 32), (1, 32), (2, 16),
                                                     (1, 32)]
    assert kv_block_bytes(model, 16, torch.float32) == 2 * 16 * (32 + 32 + 32) * 4
    ref = Reference(path)
    prompts = _prompts(llm, "gemma4")
    assert _run(llm, prompts) == [ref.generate(p, imgs) for p, imgs in prompts]


def test_a_placeholder_where_the_processor_places_images_is_refused(vlmserve_cache, tmp_path):
    """BLIP-2's processor puts its query tokens before the prompt itself: an ``<image>`` the
    prompt holds as well is refused in one line before any work (the engine serves on); as
    token ids, the one image token becomes the query tokens, as the text prompt's are."""
    from vlmserve.errors import InvalidRequestError

    llm = LLM(str(build_tiny("blip-2", tmp_path / "blip2")), model_impl="transformers",
              dtype="float32", device="cpu")
    image = make_image(64, 48, seed=3)
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    with pytest.raises(InvalidRequestError, match="leave the image placeholder '<image>' out"):
        llm.generate([{"prompt": "<image> What is this?",
                       "multi_modal_data": {"image": image}}], params, use_tqdm=False)
    tokenizer = llm.get_tokenizer()
    ids = [tokenizer.convert_tokens_to_ids("<image>"), *tokenizer.encode("What is this?")]
    text, as_ids = (llm.generate([{**prompt, "multi_modal_data": {"image": image}}], params,
                                 use_tqdm=False)[0].outputs[0].token_ids
                    for prompt in ({"prompt": "What is this?"}, {"prompt_token_ids": ids}))
    assert as_ids == text and len(text) == 6


def test_the_projector_runs_where_the_forward_runs_it_after_the_features():
    """A model whose forward projects what `get_image_features` gives (Llama 4 in
    transformers 5.17) has the backend project it too; one whose features come projected
    (the same model in 5.2x) does not."""
    from torch import nn

    from vlmserve.models.transformers_backend import _projector_after_features

    class ProjectsInForward(nn.Module):
        def __init__(self):
            super().__init__()
            self.multi_modal_projector = nn.Linear(4, 4)

        def get_image_features(self, pixel_values):
            return pixel_values

        def forward(self, pixel_values):
            return self.multi_modal_projector(self.get_image_features(pixel_values))

    class ProjectsInFeatures(ProjectsInForward):
        def get_image_features(self, pixel_values):
            return self.multi_modal_projector(pixel_values)

        def forward(self, pixel_values):
            return self.multi_modal_projector(pixel_values)

    model = ProjectsInForward()
    assert _projector_after_features(model) is model.multi_modal_projector
    assert _projector_after_features(ProjectsInFeatures()) is None
    assert _projector_after_features(nn.Linear(2, 2)) is None
