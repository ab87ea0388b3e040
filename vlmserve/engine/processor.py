"""Admission: user prompt input -> validated `ProcessedPrompt`, before anything is scheduled."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from PIL import Image

from vlmserve.errors import InvalidImageError, InvalidRequestError
from vlmserve.multimodal.image import load_image
from vlmserve.multimodal.inputs import ImageInput, ProcessedPrompt

PromptInput = str | dict[str, Any]
# a source (PIL image, bytes, URL, path) -> RGB; a loader with a `load_all(sources)` method
# (`RestrictedImageLoader`) gets all of a request's sources at once instead
ImageLoader = Callable[[Any], Image.Image]


def _images_of(prompt: dict[str, Any], load: ImageLoader) -> list[Image.Image]:
    mm = prompt.get("multi_modal_data") or {}
    if not isinstance(mm, dict):
        raise InvalidRequestError("multi_modal_data must be a dict like {'image': [...]}")
    unknown = set(mm) - {"image"}
    if unknown:
        raise InvalidRequestError(f"unsupported multi_modal_data key(s): {sorted(unknown)}; "
                                  "only 'image' is supported")
    images = mm.get("image", [])
    if not isinstance(images, (list, tuple)):
        images = [images]
    load_all = getattr(load, "load_all", None)
    if load_all is not None:  # a server's loader: a request's limits over all its images,
        return load_all(list(images))  # checked before any is decoded; names them itself
    loaded = []
    for i, img in enumerate(images):
        try:
            loaded.append(load(img))
        except InvalidImageError as e:
            raise InvalidImageError(f"image {i}: {e}") from None
    return loaded


class InputProcessor:
    """Wraps the model's own input processor (tokenizer + HF image processor)."""

    def __init__(self, model_processor, vocab_size: int, hidden_size: int | None = None) -> None:
        self.model_processor = model_processor
        self.vocab_size = vocab_size
        self.hidden_size = hidden_size  # of image embeddings given encoded (None: unchecked)

    def _encoded(self, prompt: dict[str, Any]) -> ProcessedPrompt:
        """A prompt whose images an encoder service encoded (`vlmserve.MultimodalEncoder`):
        its token ids, positions and embedding rows, taken as they are. Each handle is
        opened here, once: its rows are copied to this process and the producer frees
        them."""
        out = prompt["multi_modal_embeddings"]
        unknown = set(prompt) - {"prompt", "multi_modal_embeddings"}
        if unknown:
            raise InvalidRequestError(f"with multi_modal_embeddings, unexpected prompt "
                                      f"field(s): {sorted(unknown)}")
        if not hasattr(out, "prompt_token_ids") or not hasattr(out, "images"):
            raise InvalidRequestError("multi_modal_embeddings must be an EncoderOutput of "
                                      "vlmserve.MultimodalEncoder")
        if prompt.get("prompt") is not None and prompt["prompt"] != out.prompt:
            out.release()
            raise InvalidRequestError("prompt differs from the prompt multi_modal_embeddings "
                                      "were encoded for")
        images = []
        try:
            for i, img in enumerate(out.images):
                if img.handle is None:
                    raise InvalidRequestError(f"image {i} has no embeddings (an encoder rank "
                                              "that does not deliver results)")
                rows, hidden = tuple(img.handle.shape)
                if rows != img.length or (self.hidden_size and hidden != self.hidden_size):
                    raise InvalidRequestError(
                        f"image {i}: embeddings of shape {tuple(img.handle.shape)}, expected "
                        f"({img.length}, {self.hidden_size or hidden})")
                images.append(ImageInput(img.mm_hash, img.offset, img.length,
                                         torch.empty(0, dtype=torch.uint8),
                                         tuple(img.grid_thw), None,
                                         embeds=img.handle.open("cpu")))
        except Exception:
            out.release()  # the handles not opened yet go back
            raise
        return ProcessedPrompt(out.prompt, list(out.prompt_token_ids), images,
                               out.mrope_positions, out.mrope_delta)

    def process(self, prompt: PromptInput, load: ImageLoader = load_image) -> ProcessedPrompt:
        """Validate and preprocess; `load` turns each image source into a decoded image (a
        server passes one with its limits on paths, URLs and sizes)."""
        if isinstance(prompt, str):
            text, token_ids, images = prompt, None, []
        elif isinstance(prompt, dict) and "multi_modal_embeddings" in prompt:
            return self._checked(self._encoded(prompt))
        elif isinstance(prompt, dict):
            unknown = set(prompt) - {"prompt", "prompt_token_ids", "multi_modal_data"}
            if unknown:
                raise InvalidRequestError(f"unknown prompt field(s): {sorted(unknown)}")
            text, token_ids = prompt.get("prompt"), prompt.get("prompt_token_ids")
            if (text is None) == (token_ids is None):
                raise InvalidRequestError("give exactly one of 'prompt' and 'prompt_token_ids'")
            if token_ids is not None and (not isinstance(token_ids, (list, tuple)) or not all(
                    isinstance(t, int) for t in token_ids)):
                raise InvalidRequestError("prompt_token_ids must be a list of integers")
            images = _images_of(prompt, load)
        else:
            raise InvalidRequestError(f"a prompt must be a str or a dict, got {type(prompt)}")
        if text is not None and not isinstance(text, str):
            raise InvalidRequestError("prompt must be a string")
        return self._checked(self.model_processor.process(
            text, list(token_ids) if token_ids is not None else None, images))

    def _checked(self, processed: ProcessedPrompt) -> ProcessedPrompt:
        if not processed.prompt_token_ids:
            raise InvalidRequestError("the prompt is empty")
        bad = [t for t in processed.prompt_token_ids if not 0 <= t < self.vocab_size]
        if bad:
            raise InvalidRequestError(f"prompt token id {bad[0]} is outside the vocabulary "
                                      f"[0, {self.vocab_size})")
        return processed
