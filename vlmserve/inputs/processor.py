"""Admission: user prompt input -> validated `ProcessedPrompt`, before anything is scheduled."""

from __future__ import annotations

import hashlib
import threading
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from PIL import Image

from vlmserve.errors import InvalidImageError, InvalidRequestError, InvalidSamplingParamsError
from vlmserve.layers.grammar import check_structured
from vlmserve.models.metadata import text_config
from vlmserve.models.registry import resolve_model_class
from vlmserve.multimodal.image import load_image
from vlmserve.multimodal.inputs import ImageInput, PreparedImage, ProcessedPrompt
from vlmserve.multimodal.video import Video, load_video
from vlmserve.sampling_params import SamplingParams
from vlmserve.transfer.handles import ROW_DTYPES

PromptInput = str | dict[str, Any]
# a source (PIL image, bytes, URL, path) -> RGB; a loader with a `load_all(sources)` method
# (`RestrictedImageLoader`) gets all of a request's sources at once instead
ImageLoader = Callable[[Any], Image.Image]


def _sources(prompt: dict[str, Any], kind: str) -> list:
    """The prompt's ``multi_modal_data[kind]`` as a list (one item or a list of them)."""
    mm = prompt.get("multi_modal_data") or {}
    if not isinstance(mm, dict):
        raise InvalidRequestError("multi_modal_data must be a dict like {'image': [...]}")
    unknown = set(mm) - {"image", "video"}
    if unknown:
        raise InvalidRequestError(f"unsupported multi_modal_data key(s): {sorted(unknown)}; "
                                  "'image' and 'video' are supported")
    items = mm.get(kind, [])
    if kind == "video" and (isinstance(items, list) and items and _is_frame(items[0])
                            or isinstance(items, tuple) and len(items) == 2
                            and isinstance(items[1], dict)):
        return [items]  # one video: its frames, or (frames, metadata)
    return list(items) if isinstance(items, (list, tuple)) else [items]


def _video(src: Any, load: Any, i: int, pixels_before: int = 0) -> Video:
    """Video ``i`` of a prompt: frames, or a file decoded (by a server's loader, under its
    limits, when ``load`` has one: the request's pixel limit less ``pixels_before``, what
    its images and earlier videos hold)."""
    try:
        if isinstance(src, (bytes, bytearray, memoryview, str)) and hasattr(load, "load_video"):
            return load.load_video(src, pixels_before)
        return load_video(src)
    except InvalidImageError as e:
        raise InvalidImageError(f"video {i}: {e}") from None


def _is_frame(x: Any) -> bool:
    return isinstance(x, Image.Image) or len(getattr(x, "shape", ())) == 3


def _images_of(prompt: dict[str, Any], load: ImageLoader) -> list[Image.Image]:
    images = _sources(prompt, "image")
    load_all = getattr(load, "load_all", None)
    if load_all is not None:  # a server's loader: a request's limits over all its images,
        return load_all(list(images))  # checked before any is decoded; names them itself
    loaded = []
    for n, img in enumerate(images, 1):  # numbered as a server's loader numbers them
        try:
            loaded.append(load(img))
        except InvalidImageError as e:
            raise InvalidImageError(f"image {n} of the request: {e}") from None
    return loaded


def _source_key(src: Any) -> str | None:
    """A cache key for an image source whose content it names: a data URL or encoded bytes
    (a path or a PIL image: none, its content may change)."""
    if isinstance(src, str) and src[:5].lower() == "data:":
        return "s" + hashlib.sha256(src.encode()).hexdigest()
    if isinstance(src, (bytes, bytearray, memoryview)):
        return "b" + hashlib.sha256(src).hexdigest()
    return None


class PreparedImageCache:
    """Processed images (content hash, resized pixels) by the source they came from, least
    recently used dropped beyond ``max_bytes`` of pixels: a chat that sends the same images
    every turn is decoded, hashed and resized once. Thread-safe."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes, self.bytes = max_bytes, 0
        self._items: OrderedDict[str, PreparedImage] = OrderedDict()
        self._lock = threading.Lock()
        self.hits = self.misses = 0

    def get_all(self, keys: list[str | None]) -> list[PreparedImage] | None:
        """Every key's image, or None if any is missing."""
        with self._lock:
            found = [self._items.get(k) if k is not None else None for k in keys]
            if any(f is None for f in found):
                self.misses += 1
                return None
            for k in keys:
                self._items.move_to_end(k)
            self.hits += 1
            return found  # type: ignore[return-value]

    def put(self, key: str | None, image: PreparedImage) -> None:
        size = image.pixels.numel()
        if key is None or size > self.max_bytes:
            return
        with self._lock:
            if key in self._items:
                return
            self._items[key] = image
            self.bytes += size
            while self.bytes > self.max_bytes:
                self.bytes -= self._items.popitem(last=False)[1].pixels.numel()


def client_rows_key(rows: torch.Tensor, encoder_meta: tuple[int, ...]) -> str:
    """The key of embedding rows a client sent (the encoder cache's and the prefix cache's):
    their dtype, shape, grid and bytes, marked as a client's, in a namespace of their own
    (content hashes are bare hex digests)."""
    h = hashlib.sha256(f"client rows {rows.dtype} {list(rows.shape)} {list(encoder_meta)}"
                       .encode())
    h.update(rows.contiguous().view(-1).view(torch.uint8).numpy())
    return "client-" + h.hexdigest()


class InputProcessor:
    """Wraps the model's own input processor (tokenizer + HF image processor).
    ``image_cache_bytes`` > 0 keeps that many bytes of processed images by source (data URLs
    and fetched bytes) when the model's processor can take them (`prepare`)."""

    def __init__(self, model_processor, vocab_size: int, hidden_size: int | None = None,
                 image_cache_bytes: int = 0) -> None:
        self.model_processor = model_processor
        self.vocab_size = vocab_size
        self.hidden_size = hidden_size  # of image embeddings given encoded (None: unchecked)
        self.image_cache = (PreparedImageCache(image_cache_bytes) if image_cache_bytes > 0
                            and hasattr(model_processor, "prepare") else None)

    @classmethod
    def for_model(cls, model_path, hf_config, model_processor=None,
                  mm_processor_kwargs: dict | None = None, image_cache_bytes: int = 0
                  ) -> InputProcessor:
        """The engine's admission preprocessing for the checkpoint at `model_path` (config
        `hf_config`), as every front end, preprocessing process and encoder builds it: the
        model's input processor (`model_processor`, else built with `mm_processor_kwargs`),
        its vocabulary (token ids and logit biases checked against it) and the width of its
        image embedding rows (rows given encoded checked against it)."""
        model_cls = resolve_model_class(hf_config)
        if model_processor is None:
            model_processor = model_cls.input_processor_cls(model_path, hf_config,
                                                            mm_processor_kwargs)
        return cls(model_processor, text_config(hf_config).vocab_size,
                   model_cls.image_row_width(hf_config), image_cache_bytes)

    def _images(self, prompt: dict[str, Any], load: ImageLoader, options: Any) -> list:
        """The prompt's images, loaded; from the cache of processed images when every one
        of them is there (the request's pixel limit still checked), else all loaded (each
        then processed with ``options``, the model processor's `image_options`, and kept)."""
        cache = self.image_cache
        sources = _sources(prompt, "image")
        keys = [_source_key(src) for src in sources] if cache is not None else []
        if options is not None:  # processed otherwise than the engine's way: another entry
            keys = [k and f"{k} {options}" for k in keys]
        if cache is None or not sources or None in keys:
            return _images_of(prompt, load)
        found = cache.get_all(keys)
        if found is not None:
            limit = getattr(load, "max_request_pixels", None)
            total = sum(p.source_pixels for p in found)
            if limit is not None and total > limit:
                raise InvalidImageError(
                    f"the request's {len(found)} images hold {total} pixels in all, which "
                    f"exceeds the limit of {limit} (--max-request-pixels)")
            return found
        prepared = [self.model_processor.prepare(img, options)
                    for img in _images_of(prompt, load)]
        for key, p in zip(keys, prepared, strict=True):
            cache.put(key, p)
        return prepared

    def _encoded(self, prompt: dict[str, Any]) -> ProcessedPrompt:
        """A prompt whose images an encoder service encoded (`vlmserve.MultimodalEncoder`, or
        a client): trusted for nothing but its rows. Its token ids, positions, each image's
        offset, length and grid must be what this server computes for its prompt and grids
        (`described_prompt` of the model's processor); each handle must declare rows of a
        dtype the engine takes and of [length, width], and hold exactly those. Each handle is
        opened here, once: its rows are copied to this process and the producer frees them.
        The rows are keyed by their own bytes (`client_rows_key`), never by the hash they
        came with: rows sent for an image never stand in for that image's own rows in the
        encoder cache or the prefix cache."""
        out = prompt["multi_modal_embeddings"]
        unknown = set(prompt) - {"prompt", "multi_modal_embeddings"}
        if unknown:
            raise InvalidRequestError(f"with multi_modal_embeddings, unexpected prompt "
                                      f"field(s): {sorted(unknown)}")
        if not hasattr(out, "prompt_token_ids") or not hasattr(out, "images"):
            raise InvalidRequestError("multi_modal_embeddings must be an EncoderOutput of "
                                      "vlmserve.MultimodalEncoder")
        try:
            if prompt.get("prompt") is not None and prompt["prompt"] != out.prompt:
                raise InvalidRequestError("prompt differs from the prompt "
                                          "multi_modal_embeddings were encoded for")
            expected = self._expected_layout(out)
            images = []
            for i, (img, want) in enumerate(zip(out.images, expected.images, strict=True)):
                rows = self._client_rows(i, img)
                images.append(ImageInput(client_rows_key(rows, want.encoder_meta), want.offset,
                                         want.length, torch.empty(0, dtype=torch.uint8),
                                         want.encoder_meta, None, embeds=rows))
        except Exception:
            out.release()  # the handles not opened yet go back
            raise
        return ProcessedPrompt(expected.prompt, expected.prompt_token_ids, images,
                               expected.prompt_positions, expected.position_offset)

    def _expected_layout(self, out: Any) -> ProcessedPrompt:
        """What this server computes for an `EncoderOutput`'s prompt and its images' grids;
        `InvalidRequestError` naming the first thing ``out`` says otherwise."""
        bad = InvalidRequestError
        ids = list(out.prompt_token_ids)
        metas = [tuple(img.encoder_meta) for img in out.images]
        want = self.model_processor.described_prompt(
            out.prompt, None if out.prompt is not None else ids, metas)
        if ids != want.prompt_token_ids:
            raise bad(f"multi_modal_embeddings: prompt_token_ids ({len(ids)}) are not the "
                      f"prompt's tokens with its images' placeholders expanded as this server "
                      f"expands them for encoder_meta {[list(m) for m in metas]} "
                      f"({len(want.prompt_token_ids)})")
        for i, (img, w) in enumerate(zip(out.images, want.images, strict=True)):
            for name in ("offset", "length"):
                if getattr(img, name) != getattr(w, name):
                    raise bad(f"multi_modal_embeddings: image {i}: {name} "
                              f"{getattr(img, name)}: this server computes {getattr(w, name)} "
                              f"for its prompt and encoder_meta {list(w.encoder_meta)}")
        seen: dict[str, tuple] = {}
        for i, img in enumerate(out.images):
            first = seen.setdefault(img.mm_hash, (i, img.length, tuple(img.encoder_meta)))
            if first[1:] != (img.length, tuple(img.encoder_meta)):
                raise bad(f"multi_modal_embeddings: images {first[0]} and {i} have one mm_hash "
                          "but different lengths or grids")
        got, expected = out.prompt_positions, want.prompt_positions
        if (got is None) != (expected is None) or expected is not None and (
                tuple(got.shape) != tuple(expected.shape) or not torch.equal(got, expected)):
            raise bad(f"multi_modal_embeddings: prompt_positions "
                      f"{None if got is None else list(got.shape)} are not the positions this "
                      f"server computes for the prompt "
                      f"({None if expected is None else list(expected.shape)})")
        if out.position_offset != want.position_offset:
            raise bad(f"multi_modal_embeddings: position_offset {out.position_offset}: this "
                      f"server computes {want.position_offset}")
        return want

    def _client_rows(self, i: int, img: Any) -> torch.Tensor:
        """Image ``i``'s rows from its handle: declared as [length, width] of a float dtype
        (checked before anything is allocated) and holding exactly that; any failure to read
        them is this request's `InvalidRequestError`."""
        h = img.handle
        if h is None:
            raise InvalidRequestError(f"image {i} has no embeddings (an encoder rank that does "
                                      "not deliver results)")
        width = self.hidden_size or (h.shape[-1] if h.shape else 0)
        if h.dtype not in ROW_DTYPES:
            raise InvalidRequestError(f"image {i}: embeddings of dtype {h.dtype!r}: one of "
                                      f"{', '.join(ROW_DTYPES)}")
        if tuple(h.shape) != (img.length, width):
            raise InvalidRequestError(f"image {i}: embeddings of shape {list(h.shape)}: this "
                                      f"server takes [{img.length}, {width}] (its rows, the "
                                      "model's width)")
        try:
            return h.open("cpu")
        except Exception as e:  # noqa: BLE001 - reading the client's handle failed
            raise InvalidRequestError(f"image {i}: its embeddings cannot be read: {e}") from None

    def process(self, prompt: PromptInput, load: ImageLoader = load_image) -> ProcessedPrompt:
        """Validate and preprocess; `load` turns each image source into a decoded image (a
        server passes one with its limits on paths, URLs and sizes)."""
        options, videos = None, []
        if isinstance(prompt, str):
            text, token_ids, images = prompt, None, []
        elif isinstance(prompt, dict) and "multi_modal_embeddings" in prompt:
            return self._checked(self._encoded(prompt))
        elif isinstance(prompt, dict):
            unknown = set(prompt) - {"prompt", "prompt_token_ids", "multi_modal_data",
                                     "mm_processor_kwargs"}
            if unknown:
                raise InvalidRequestError(f"unknown prompt field(s): {sorted(unknown)}")
            options = self.model_processor.image_options(prompt.get("mm_processor_kwargs"))
            text, token_ids = prompt.get("prompt"), prompt.get("prompt_token_ids")
            if (text is None) == (token_ids is None):
                raise InvalidRequestError("give exactly one of 'prompt' and 'prompt_token_ids'")
            if token_ids is not None and (not isinstance(token_ids, (list, tuple)) or not all(
                    isinstance(t, int) for t in token_ids)):
                raise InvalidRequestError("prompt_token_ids must be a list of integers")
            images = self._images(prompt, load, options)
            sources = _sources(prompt, "video")
            if sources and not getattr(self.model_processor, "takes_videos", False):
                raise InvalidRequestError("this model does not take video inputs")
            used = sum(img.source_pixels if isinstance(img, PreparedImage)
                       else img.width * img.height for img in images)
            for i, v in enumerate(sources):  # one pixel budget for the request
                videos.append(_video(v, load, i, used))
                used += int(np.prod(videos[-1].frames.shape[:3]))
        else:
            raise InvalidRequestError(f"a prompt must be a str or a dict, got {type(prompt)}")
        if text is not None and not isinstance(text, str):
            raise InvalidRequestError("prompt must be a string")
        ids = list(token_ids) if token_ids is not None else None
        if videos:
            return self._checked(self.model_processor.process(text, ids, images, options,
                                                              videos=videos))
        return self._checked(self.model_processor.process(text, ids, images, options))

    def check_sampling(self, params: SamplingParams) -> None:
        """`params.validate()`, its logit biases and stop token ids name tokens of the
        vocabulary, and its structured output's grammar parses (and can match)."""
        params.validate()
        bad = [t for t in params.logit_bias if t >= self.vocab_size]
        if bad:
            raise InvalidSamplingParamsError(f"logit_bias token id {bad[0]} is outside the "
                                             f"vocabulary [0, {self.vocab_size})")
        bad = [t for t in params.stop_token_ids if t >= self.vocab_size]
        if bad:
            raise InvalidSamplingParamsError(f"stop_token_ids: token id {bad[0]} is outside "
                                             f"the vocabulary [0, {self.vocab_size})")
        if params.structured_outputs is not None:
            check_structured(params.structured_outputs)

    def _checked(self, processed: ProcessedPrompt) -> ProcessedPrompt:
        if not processed.prompt_token_ids:
            raise InvalidRequestError("the prompt is empty")
        bad = [t for t in processed.prompt_token_ids if not 0 <= t < self.vocab_size]
        if bad:
            raise InvalidRequestError(f"prompt token id {bad[0]} is outside the vocabulary "
                                      f"[0, {self.vocab_size})")
        return processed
