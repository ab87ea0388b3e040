"""Admission-time processing for the transformers backend: the checkpoint's own HF processor.

A model without a native class is served through its transformers implementation
(`models/transformers_backend.py`), and its prompts go through its own `AutoProcessor`, the
whole pipeline, as `transformers` users run it: the processor expands each image's
placeholder into the tokens the model expects (image tokens, and for some models row and
column markers or start and end tokens between them) and makes the image's tensors.

The engine knows an image by one contiguous span of the prompt (`MultiModalFeature`): here
it is the image's *span*, from its first image token to its last, markers included. The
encoder gives a row for every token of the span: the model's image features at image tokens,
the text embedding of any other token (`TransformersVLM.encode_images`), so the span merges,
chunks and caches like any image.

The image's tensors (the HF image processor's output for that image alone) travel packed
as one uint8 tensor of their bytes (`models/transformers_packing`).
"""

from __future__ import annotations

import hashlib
import inspect
import json
import math
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from PIL import Image

from vlmserve.errors import InvalidImageError, InvalidRequestError
from vlmserve.models.processing import HFInputProcessor, check_tokenizer
from vlmserve.models.transformers_families import hf_model_class, positions_from_one
from vlmserve.models.transformers_packing import pack_image
from vlmserve.multimodal.hashing import hash_image
from vlmserve.multimodal.inputs import ImageInput, PreparedImage, ProcessedPrompt

if TYPE_CHECKING:
    from transformers import PretrainedConfig

# models whose processor takes a prompt's images as a flat list (nested: pages)
_FLAT_IMAGES = frozenset({"got_ocr2"})
# outputs of a processor that are about the text, never an image's tensors
_TEXT_KEYS = frozenset({"input_ids", "attention_mask", "token_type_ids", "mm_token_type_ids",
                        "labels"})
def image_token_id_of(hf_config) -> int | None:
    """The id of the image placeholder token in a config (its several spellings)."""
    for name in ("image_token_id", "image_token_index", "image_token"):
        tid = getattr(hf_config, name, None)
        if isinstance(tid, int):
            return tid
    return None


def _packed(images: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The pixel transform of packed images: their bytes as they are (the model reads them)."""
    return images.reshape(-1)


# images go to the processor as height x width x 3 arrays said to be channels-last: an image
# 1 or 3 pixels high (or wide) would otherwise read as channels-first ([3, W, 3] as a
# 3-channel W x 3 image) to some image processors, and a PIL image so described is read the
# wrong way round by others (transformers 5.17's torchvision ones make it channels-first)
_CHANNELS_LAST = {"input_data_format": "channels_last"}


def _as_pil(images: list) -> list:
    """Arrays (in lists, as the processor takes them) as PIL images."""
    return [_as_pil(x) if isinstance(x, list) else Image.fromarray(x) for x in images]


class TransformersInputProcessor(HFInputProcessor):
    """Prompt + images -> `ProcessedPrompt` through the checkpoint's own `AutoProcessor`."""

    def __init__(self, model_path: str | Path, hf_config: PretrainedConfig | None = None,
                 mm_processor_kwargs: dict | None = None, *,
                 tokenizer: str | Path | None = None, trust_remote_code: bool = False,
                 dtype: torch.dtype | None = None) -> None:
        """``tokenizer``: a folder to read the tokenizer from instead of the model's
        (``--tokenizer``); ``trust_remote_code``: the checkpoint's own processor classes may
        run (the user said so); ``dtype``: the model's, which an image's floating tensors
        are carried in (`pack_image`)."""
        import threading

        from transformers import AutoConfig, AutoProcessor, AutoTokenizer

        self.model_path = Path(model_path)
        if hf_config is None:
            hf_config = AutoConfig.from_pretrained(self.model_path, local_files_only=True,
                                                   trust_remote_code=trust_remote_code)
        self.hf_config = hf_config
        parts = {} if tokenizer is None else {"tokenizer": AutoTokenizer.from_pretrained(
            tokenizer, local_files_only=True, trust_remote_code=trust_remote_code)}
        self.processor = AutoProcessor.from_pretrained(
            self.model_path, local_files_only=True, trust_remote_code=trust_remote_code,
            **parts)
        self.tokenizer = getattr(self.processor, "tokenizer", None)
        self.image_processor = getattr(self.processor, "image_processor", None)
        if self.tokenizer is None or self.image_processor is None:
            raise ValueError(f"{type(self.processor).__name__} of {model_path} has no tokenizer "
                             "or no image processor")
        check_tokenizer(self.tokenizer, model_path if tokenizer is None else tokenizer)
        self.tokenizer.model_max_length = 1 << 62
        self._tokenizer_lock = threading.Lock()  # the processor calls the tokenizer
        tid = image_token_id_of(hf_config)
        if tid is None:
            raise ValueError(f"{model_path}: its config names no image token id")
        self.image_token_id = tid
        self.pixel_transform = _packed
        self.float_dtype = dtype
        # the engine's own options, given to every call of the processor (an operator's;
        # a request may set none: `image_options`)
        self.engine_kwargs = dict(mm_processor_kwargs or {})
        self._hash_extra = self.hash_extra(engine=self.engine_kwargs)
        self._max_image_tokens: int | None = None
        self.rope_index = rope_index_of(hf_config)
        self._typed_rope_index = self.rope_index is not None and \
            "mm_token_type_ids" in inspect.signature(self.rope_index).parameters
        self.first_position = 1 if positions_from_one(hf_config) else 0
        self._flat_images = hf_config.model_type in _FLAT_IMAGES
        self._arrays: bool | None = None  # (`takes_arrays`)
        self._own_placement: bool | None = None  # (`places_images_itself`)
        self._channels_last = {} if "input_data_format" in self.engine_kwargs else \
            _CHANNELS_LAST

    def hash_extra(self, **more: Any) -> str:
        settings = {k: v for k, v in self.image_processor.to_dict().items()
                    if k not in ("image_processor_type", "processor_class", "_processor_class")}
        return json.dumps({"model": str(self.model_path.resolve()), "processor": settings,
                           "backend": "transformers", **more}, sort_keys=True, default=str)

    def apply_chat_template(self, messages, tools=None, options=None) -> str:
        """The processor's chat template where it has one (the multimodal one), else the
        tokenizer's."""
        from vlmserve.models.processing import ChatTemplateOptions

        o = options or ChatTemplateOptions()
        owner = self.processor if getattr(self.processor, "chat_template", None) else \
            self.tokenizer
        return owner.apply_chat_template(
            messages, tools=tools, tokenize=False, chat_template=o.chat_template,
            add_generation_prompt=o.add_generation_prompt,
            continue_final_message=o.continue_final_message, **o.kwargs)

    @property
    def max_image_tokens(self) -> int:
        """Most tokens one image's span can take: the span of a probe image at each of a few
        sizes the image processor accepts (its largest, squares and long strips), the
        largest of them."""
        if self._max_image_tokens is None:
            try:  # an image as a chat shows it, or (no chat template) one image token
                text, ids = self.apply_chat_template([{"role": "user", "content": [
                    {"type": "image"}, {"type": "text", "text": "x"}]}]), None
            except ValueError:
                text, ids = None, [self.image_token_id]
            side = _largest_side(self.image_processor)
            sizes = [(side, side), (side, max(side // 4, 28)), (max(side // 4, 28), side),
                     (224, 224)]
            spans = []
            for w, h in sizes:
                image = Image.new("RGB", (w, h), (127, 127, 127))
                spans.append(self.process(text, ids, [image]).images[0].length)
            self._max_image_tokens = max(spans)
        return self._max_image_tokens

    @property
    def places_images_itself(self) -> bool:
        """Whether the processor puts each image's tokens into the prompt itself whatever
        the text says (BLIP-2 puts its query tokens first), so that an image placeholder in
        the prompt would be one image token too many: a probe image with and without one."""
        if self._own_placement is None:
            token = self.tokenizer.convert_ids_to_tokens(self.image_token_id)
            probe = [np.full((224, 224, 3), 127, np.uint8)]
            counts = []
            for text in ("x", f"{token}x"):
                try:
                    ids = self._call(text=[text], images=self._batch(probe))["input_ids"]
                except Exception:  # a processor that wants its placeholder
                    counts.append(None)
                    continue
                counts.append(int((ids[0] == self.image_token_id).sum()))
            self._own_placement = None not in counts and 0 < counts[0] < counts[1]
        return self._own_placement

    def prepare(self, image: Image.Image, options: None = None) -> PreparedImage:
        """An image's content hash and its pixels as they are (the HF processor resizes it
        when the prompt is processed)."""
        rgb = image if image.mode == "RGB" else image.convert("RGB")
        array = np.array(rgb)
        return PreparedImage(hash_image(array, self._hash_extra), torch.from_numpy(array),
                             image.width * image.height)

    def pixel_tokens(self, shape: Sequence[int], encoder_meta: Sequence[int]) -> int:
        raise InvalidImageError("the transformers backend takes images, not pixels "
                                "preprocessed elsewhere")

    def described_prompt(self, prompt, prompt_token_ids, encoder_metas) -> ProcessedPrompt:
        raise InvalidRequestError("the transformers backend takes images, not embeddings "
                                  "encoded elsewhere (multi_modal_embeddings)")

    def process(self, prompt: str | None, prompt_token_ids: list[int] | None,
                images: Sequence[Image.Image | PreparedImage], options: None = None
                ) -> ProcessedPrompt:
        """The HF processor on the prompt and its images: token ids as it expands them, and
        for each image its span (first to last image token), its tensors and hash. A prompt
        of token ids holds one image token per image: each is replaced by what the processor
        makes of that token and its image alone."""
        if not images:
            if prompt is None:
                ids = self.token_ids(prompt, prompt_token_ids)
            else:
                try:  # the processor's own tokenization (some add tokens of their own)
                    ids = self._call(text=[prompt])["input_ids"][0].tolist()
                except InvalidRequestError:  # a processor that wants images: its tokenizer's
                    ids = self.token_ids(prompt, None)
            return ProcessedPrompt(prompt, ids, position_offset=self.first_position)
        prepared = [img if isinstance(img, PreparedImage) else self.prepare(img)
                    for img in images]
        arrays = [p.pixels.numpy() for p in prepared]
        # each image's tensors as the processor makes them for that image alone: from the
        # call that expanded it where it was the call's only image, else from its own (and
        # its count of image tokens); a processor that says how many images share the prompt
        # (their features depend on it: LLaVA-OneVision tiles an image only when alone) gives
        # each image's share of the prompt's call
        counts = None
        if prompt is None:
            ids, alone = self._expanded(list(prompt_token_ids), arrays)
        else:
            if self.places_images_itself and \
                    self.image_token_id in self.token_ids(prompt, None):
                raise InvalidRequestError(
                    f"{self.hf_config.model_type}'s processor places each image's tokens "
                    "itself: leave the image placeholder "
                    f"{self.tokenizer.convert_ids_to_tokens(self.image_token_id)!r} out of "
                    "the prompt")
            out = self._call(text=[prompt], images=self._batch(arrays))
            ids = out["input_ids"][0].tolist()
            if len(arrays) == 1:
                alone = [_image_tensors_of(out)]
            elif "batch_num_images" in out:
                alone = _each_image(_image_tensors_of(out), len(arrays))
            else:
                alone, counts = zip(*(self._image_alone(a) for a in arrays), strict=True)
        spans = self._spans(ids, [p.pixels.shape[:2] for p in prepared], counts)
        image_inputs, grids = [], []
        for p, tensors, (start, end) in zip(prepared, alone, spans, strict=True):
            if "image_grid_thw" in tensors:
                grids.append(tensors["image_grid_thw"])
            data, meta = pack_image(tensors, ids[start:end], self.image_token_id,
                                    self.float_dtype)
            mm_hash = p.mm_hash
            if "batch_num_images" in tensors and int(tensors["batch_num_images"][0]) > 1:
                mm_hash = hashlib.sha256(f"{mm_hash} among several".encode()).hexdigest()
            image_inputs.append(ImageInput(mm_hash=mm_hash, offset=start, length=end - start,
                                           pixels=data, encoder_meta=meta,
                                           transform=self.pixel_transform))
        positions, offset = None, self.first_position
        if self.rope_index is not None:
            positions, offset = self._positions(ids, torch.cat(grids) if grids else None)
        return ProcessedPrompt(prompt, ids, images=image_inputs, prompt_positions=positions,
                               position_offset=offset)

    def _batch(self, images: list[np.ndarray]) -> list:
        """One prompt's images as the processor takes them: a list per prompt, or (a
        processor that reads nested lists as pages of one document, GOT-OCR 2's) flat."""
        return images if self._flat_images else [images]

    def _call(self, **kwargs: Any) -> Any:
        """The HF processor (one thread at a time); what it refuses is the request's error.
        Images (height x width x 3 arrays) are given as arrays said to be channels-last
        (`_CHANNELS_LAST`, unless the operator said otherwise), or as PIL images to a
        processor that takes no arrays (`takes_arrays`)."""
        images = kwargs.get("images")
        if images is not None:
            kwargs = {**self._channels_last, **kwargs} if self.takes_arrays else \
                {**kwargs, "images": _as_pil(images)}
        return self._run(kwargs)

    @property
    def takes_arrays(self) -> bool:
        """Whether the processor takes images as arrays (Idefics 2's takes PIL images only,
        through `load_image`): a probe image, tried once."""
        if self._arrays is None:
            token = self.tokenizer.convert_ids_to_tokens(self.image_token_id)
            probe = self._batch([np.full((224, 224, 3), 127, np.uint8)])
            try:
                self._run({**self._channels_last, "text": [token], "images": probe})
                self._arrays = True
            except TypeError:
                self._arrays = False
            except Exception:  # refused for another reason: the arrays were read
                self._arrays = True
        return self._arrays

    def _run(self, kwargs: dict[str, Any]) -> Any:
        with self._tokenizer_lock:
            try:
                return self.processor(return_tensors="pt", **kwargs, **self.engine_kwargs)
            except (ValueError, IndexError) as e:  # placeholders and images that disagree
                raise InvalidRequestError(f"the model's processor refused the prompt and its "
                                          f"image(s): {e}") from None

    def _expanded(self, ids: list[int], images: list[np.ndarray]
                  ) -> tuple[list[int], list[dict[str, torch.Tensor]]]:
        """Token ids with each image token (one per image) replaced by the processor's
        expansion of that token with its image, and each image's tensors from that call."""
        where = [i for i, t in enumerate(ids) if t == self.image_token_id]
        if len(where) != len(images):
            raise InvalidRequestError(f"the prompt has {len(where)} image token(s) for "
                                      f"{len(images)} image(s): give one per image")
        token = "" if self.places_images_itself else \
            self.tokenizer.convert_ids_to_tokens(self.image_token_id)
        out: list[int] = []
        tensors = []
        prev = 0
        for at, image in zip(where, images, strict=True):
            one = self._call(text=[token], images=self._batch([image]),
                             add_special_tokens=False)
            out += ids[prev:at] + one["input_ids"][0].tolist()
            tensors.append(_image_tensors_of(one))
            prev = at + 1
        return out + ids[prev:], tensors

    def _positions(self, token_ids: list[int], grids: torch.Tensor | None
                   ) -> tuple[torch.Tensor, int]:
        """The prompt's multi-axis positions [rows, len] by the model's own
        ``get_rope_index`` (``grids``: its images' ``image_grid_thw``), and the offset of
        the tokens after it."""
        ids = torch.tensor([token_ids])
        kwargs = {} if grids is None else {"image_grid_thw": grids}
        if self._typed_rope_index:
            types = torch.zeros_like(ids, dtype=torch.int32)
            types[ids == self.image_token_id] = 1
            video = getattr(self.hf_config, "video_token_id", None)
            if video is not None:
                types[ids == video] = 2
            kwargs["mm_token_type_ids"] = types
        positions, deltas = self.rope_index(ids, attention_mask=torch.ones_like(ids), **kwargs)
        return positions[:, 0, :].contiguous(), int(deltas.reshape(-1)[0])

    def _image_alone(self, image: np.ndarray) -> tuple[dict[str, torch.Tensor], int | None]:
        """The processor's tensors for ``image`` alone and its count of image tokens: the
        processor on its placeholder text and the image (it may give the image processor
        options of its own: Pixtral's patch size is its merged patch), else the image
        processor's tensors and no count."""
        token = getattr(self.processor, "image_token", None)
        if isinstance(token, str):
            try:
                out = self._call(text=[token], images=self._batch([image]),
                                 add_special_tokens=False)
                count = int((out["input_ids"][0] == self.image_token_id).sum())
                return _image_tensors_of(out), count
            except InvalidRequestError:
                pass
        return self._image_tensors(image), None

    def _image_tensors(self, image: np.ndarray) -> dict[str, torch.Tensor]:
        """The image processor's tensors for ``image`` alone, with the options the processor
        gives it (its own defaults and the engine's)."""
        try:
            kwargs = self.processor._merge_kwargs(**self.engine_kwargs)["images_kwargs"]
        except (AttributeError, TypeError, KeyError):
            kwargs = dict(self.engine_kwargs)
        kwargs.pop("return_tensors", None)
        images = [image] if self.takes_arrays else _as_pil([image])
        if self.takes_arrays:
            kwargs = {**self._channels_last, **kwargs}
        return _image_tensors_of(self.image_processor(images=images, return_tensors="pt",
                                                      **kwargs))

    def _spans(self, ids: list[int], sizes: list[tuple[int, int]],
               counts: Sequence[int | None] | None = None) -> list[tuple[int, int]]:
        """Each image's [start, end) in ``ids``: its image tokens, in order (one image: all
        of them), by each image's count (``counts``, or the count the processor says each
        image takes; from a processor that cannot say, one unbroken run of image tokens per
        image)."""
        where = [i for i, t in enumerate(ids) if t == self.image_token_id]
        if len(sizes) == 1 and where:
            return [(where[0], where[-1] + 1)]
        if counts is not None and (None in counts or sum(counts) != len(where)):
            counts = None
        count_of = getattr(self.processor, "_get_num_multimodal_tokens", None)
        if counts is None and count_of is not None:
            try:
                counts = list(count_of(image_sizes=[list(s) for s in sizes],
                                       **self.engine_kwargs)["num_image_tokens"])
            except (TypeError, KeyError, ValueError, AttributeError):
                counts = None
        if counts is None or sum(counts) != len(where):
            runs = _runs(where)
            if len(runs) != len(sizes):
                raise InvalidRequestError(
                    f"the prompt has {len(where)} image tokens in {len(runs)} runs for "
                    f"{len(sizes)} image(s): give each image one placeholder")
            return runs
        spans, at = [], 0
        for n in counts:
            spans.append((where[at], where[at + n - 1] + 1))
            at += n
        return spans


def rope_index_of(hf_config) -> Any:
    """The model's own ``get_rope_index`` (multi-axis rotary positions of a prompt), bound
    to a weightless instance of its base model that holds the config alone; None for a
    model of 1-D positions."""
    import importlib


    cls = hf_model_class(hf_config)
    module = importlib.import_module(cls.__module__)
    base = getattr(module, cls.__name__.replace("ForConditionalGeneration", "Model"), None)
    if base is None or not hasattr(base, "get_rope_index"):
        return None
    holder = base.__new__(base)
    torch.nn.Module.__init__(holder)
    holder.config = hf_config
    return holder.get_rope_index


def _image_tensors_of(out: Any) -> dict[str, torch.Tensor]:
    """The image tensors of a processor's (or image processor's) output."""
    return {k: v for k, v in out.items() if isinstance(v, torch.Tensor) and k not in _TEXT_KEYS}


def _each_image(tensors: dict[str, torch.Tensor], n: int) -> list[dict[str, torch.Tensor]]:
    """The tensors of a call on one prompt's ``n`` images, stacked by image (a processor
    that gives `batch_num_images`), as each image's: its slice, and the prompt's count."""
    return [{k: v[i:i + 1] if k != "batch_num_images" else v for k, v in tensors.items()}
            for i in range(n)]


def _runs(where: list[int]) -> list[tuple[int, int]]:
    """Maximal runs of consecutive indices in ``where`` as [start, end)."""
    runs: list[tuple[int, int]] = []
    for i in where:
        if runs and runs[-1][1] == i:
            runs[-1] = (runs[-1][0], i + 1)
        else:
            runs.append((i, i + 1))
    return runs


def _largest_side(ip: Any) -> int:
    """The side of the largest square image an image processor keeps at its size (at most
    4096): its longest edge, or for processors sized by a pixel count (Qwen's
    ``min_pixels``/``max_pixels``) the square of that many pixels."""
    size = getattr(ip, "size", None) or {}
    get = size.get if isinstance(size, dict) else (lambda k, d=None: getattr(size, k, d))
    if getattr(ip, "temporal_patch_size", None) or getattr(ip, "max_pixels", None):
        pixels = getattr(ip, "max_pixels", None) or get("longest_edge")
        return min(math.isqrt(int(pixels)), 4096) if pixels else 1024
    for key in ("longest_edge", "height", "shortest_edge"):
        if get(key):
            return min(int(get(key)), 4096)
    return 1024
