"""OpenAI-style chat messages -> Hugging Face chat-template messages plus image (and video)
sources."""

from __future__ import annotations

from typing import Any

from PIL import Image

from vlmserve.errors import InvalidRequestError

_ROLES = {"system", "user", "assistant", "tool"}
# passed on to the chat template as they are (an assistant's tool calls, a tool's answer)
_TOOL_FIELDS = ("tool_calls", "tool_call_id")


def parse_chat_messages(messages: list[dict[str, Any]]
                        ) -> tuple[list[dict[str, Any]], list, list]:
    """Returns the messages with `image_url` parts (and the Python API's `image` and vLLM's
    `image_pil`) turned into `{"type": "image"}` and the image sources (URLs, data URLs or
    paths, loaded later at admission; PIL images) in order, and the
    videos (`video_url` parts' URLs, or the Python API's `{"type": "video", "video": ...}`)
    in order."""
    if not isinstance(messages, list) or not messages:
        raise InvalidRequestError("messages must be a non-empty list")
    out, images, videos = [], [], []
    for i, msg in enumerate(messages):
        if not isinstance(msg, dict) or msg.get("role") not in _ROLES:
            raise InvalidRequestError(f"message {i} needs a role among {sorted(_ROLES)}")
        content = msg.get("content")
        extra = {k: msg[k] for k in _TOOL_FIELDS if msg.get(k) is not None}
        if content is None and "tool_calls" in extra:  # an assistant's call, no text
            content = ""
        if isinstance(content, str):
            out.append({"role": msg["role"], "content": content, **extra})
            continue
        if not isinstance(content, list):
            raise InvalidRequestError(f"message {i}: content must be a string or a list of parts")
        parts = []
        for part in content:
            kind = part.get("type") if isinstance(part, dict) else None
            if kind == "text":
                parts.append({"type": "text", "text": str(part.get("text", ""))})
            elif kind in ("image_url", "video_url"):
                url = part.get(kind)
                url = url.get("url") if isinstance(url, dict) else url
                if not isinstance(url, str) or not url:
                    raise InvalidRequestError(f"message {i}: {kind} part without a url")
                (images if kind == "image_url" else videos).append(url)
                parts.append({"type": kind.removesuffix("_url")})
            elif kind == "image":  # a PIL image or source given directly (Python API)
                images.append(part.get("image"))
                parts.append({"type": "image"})
            elif kind == "image_pil":  # vLLM's: a PIL image (Python API)
                image = part.get("image_pil")
                if not isinstance(image, Image.Image):
                    raise InvalidRequestError(f"message {i}: an image_pil part holds a PIL "
                                              f"image, got {type(image).__name__}")
                images.append(image)
                parts.append({"type": "image"})
            elif kind == "video":  # frames given directly (Python API; `as_video`'s forms)
                videos.append(part.get("video"))
                parts.append({"type": "video"})
            else:
                raise InvalidRequestError(f"message {i}: unsupported content part type {kind!r}")
        out.append({"role": msg["role"], "content": parts, **extra})
    return out, images, videos
