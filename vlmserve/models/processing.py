"""What every model's input processor shares: the checkpoint's config and tokenizer (one
thread at a time), its HF image processor (the PIL backend where torchvision is missing), the
chat template, the settings every image hash includes, and the host-independent rescale +
normalize of uint8 pixels on the device."""

from __future__ import annotations

import json
import threading
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from vlmserve.errors import InvalidRequestError

if TYPE_CHECKING:
    from transformers import PretrainedConfig


# apply_chat_template's own arguments: not template variables a request may set
_RESERVED_TEMPLATE_KWARGS = frozenset({
    "conversation", "messages", "tools", "documents", "tokenize", "chat_template",
    "add_generation_prompt", "continue_final_message", "return_dict", "tokenizer_kwargs",
    "return_assistant_tokens_mask", "padding", "truncation", "max_length", "return_tensors"})


@dataclass(frozen=True)
class ChatTemplateOptions:
    """How a chat is rendered (vLLM's names): another Jinja template than the model's
    (`chat_template`), no generation prompt at the end, the last (assistant) message continued
    instead of closed (`continue_final_message`), variables for the template (`kwargs`).
    Contradictory or reserved settings raise `InvalidRequestError`."""

    chat_template: str | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    kwargs: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.continue_final_message and self.add_generation_prompt:
            raise InvalidRequestError(
                "continue_final_message and add_generation_prompt cannot both be true (the "
                "last message is continued: no new one begins)")
        reserved = sorted(set(self.kwargs) & _RESERVED_TEMPLATE_KWARGS)
        if reserved:
            raise InvalidRequestError(f"chat_template_kwargs may not set {', '.join(reserved)}"
                                      " (arguments of the rendering itself)")


def check_tokenizer(tokenizer: Any, source: str | Path) -> None:
    """Refuse a tokenizer transformers made of a folder without tokenizer files (an empty
    vocabulary: the model would run on nonsense), in one line naming the folder."""
    if len(tokenizer) < 2:
        raise ValueError(f"{str(source)!r} has no tokenizer files (tokenizer.json, "
                         "tokenizer_config.json, ...): name a folder or Hugging Face id that has "
                         "them with --tokenizer")


def load_image_processor(path: Path, pil_class: str, trust_remote_code: bool = False):
    """``AutoImageProcessor``; without torchvision, transformers' PIL class ``pil_class``."""
    import transformers
    from transformers import AutoImageProcessor

    try:
        return AutoImageProcessor.from_pretrained(path, local_files_only=True,
                                                  trust_remote_code=trust_remote_code)
    except ImportError:
        return getattr(transformers, pil_class).from_pretrained(path, local_files_only=True)


class HFInputProcessor:
    """Base of the model input processors. Subclasses set ``PIL_IMAGE_PROCESSOR`` (the
    transformers class used without torchvision) and add what their images need."""

    PIL_IMAGE_PROCESSOR = ""

    def __init__(self, model_path: str | Path, hf_config: PretrainedConfig | None = None,
                 mm_processor_kwargs: dict[str, Any] | None = None, *,
                 tokenizer: str | Path | None = None, trust_remote_code: bool = False,
                 dtype: torch.dtype | None = None) -> None:
        """``tokenizer``: a folder to read the tokenizer and chat template from instead of
        the model's (``--tokenizer``); ``trust_remote_code``: transformers may run the
        checkpoint's own config, tokenizer and image processor classes (the user said so);
        ``dtype``: the model's (these processors send uint8 pixels, converted on the device:
        unused)."""
        from transformers import AutoConfig, AutoTokenizer

        self.model_path = Path(model_path)
        if hf_config is None:
            hf_config = AutoConfig.from_pretrained(self.model_path, local_files_only=True,
                                                   trust_remote_code=trust_remote_code)
        self.hf_config = hf_config
        self.tokenizer = AutoTokenizer.from_pretrained(
            self.model_path if tokenizer is None else tokenizer, local_files_only=True,
            trust_remote_code=trust_remote_code)
        check_tokenizer(self.tokenizer, self.model_path if tokenizer is None else tokenizer)
        # the engine checks prompt lengths itself (admission): no tokenizer warning about a
        # "sequence length longer than the maximum" in the server's log
        self.tokenizer.model_max_length = 1 << 62
        self._tokenizer_lock = threading.Lock()
        self.image_processor = load_image_processor(self.model_path, self.PIL_IMAGE_PROCESSOR,
                                                    trust_remote_code)
        # the engine's own (`mm_processor_kwargs`): a subclass that takes options applies them
        self.image_options(mm_processor_kwargs)

    def image_options(self, kwargs: dict[str, Any] | None) -> Any:
        """A request's `mm_processor_kwargs`, checked, as the options its images are
        processed with (None: the engine's). This model's image processor takes none."""
        if kwargs:
            raise InvalidRequestError(f"mm_processor_kwargs: this model's image processor "
                                      f"takes no options, got {sorted(kwargs)}")
        return None

    def hash_extra(self, **more: Any) -> str:
        """What decides an image's embedding besides its pixels: the model, the image
        processor's settings and ``more``; every content hash includes it."""
        settings = {k: v for k, v in self.image_processor.to_dict().items()
                    if k not in ("image_processor_type", "processor_class", "_processor_class")}
        return json.dumps({"model": str(self.model_path.resolve()), "processor": settings,
                           **more}, sort_keys=True, default=str)

    def apply_chat_template(self, messages: list[dict], tools: list[dict] | None = None,
                            options: ChatTemplateOptions | None = None) -> str:
        """Render HF-style messages (string content or text/image parts) as a prompt, with
        the tools (OpenAI's function definitions) where the template shows them, under
        ``options`` (`ChatTemplateOptions`; default: the model's template, a generation
        prompt at the end)."""
        o = options or ChatTemplateOptions()
        return self.tokenizer.apply_chat_template(
            messages, tools=tools, tokenize=False, chat_template=o.chat_template,
            add_generation_prompt=o.add_generation_prompt,
            continue_final_message=o.continue_final_message, **o.kwargs)

    def token_ids(self, prompt: str | None, prompt_token_ids: list[int] | None) -> list[int]:
        """The prompt's token ids: ``prompt`` tokenized, or ``prompt_token_ids`` as given."""
        if (prompt is None) == (prompt_token_ids is None):
            raise InvalidRequestError("give exactly one of prompt and prompt_token_ids")
        if prompt is None:
            return list(prompt_token_ids)
        with self._tokenizer_lock:  # HF fast tokenizers are not safe to share across threads
            return list(self.tokenizer.encode(prompt))


@dataclass(frozen=True)
class NormalizedPixels:
    """An image processor's rescale and normalize, run where the pixels are (the device, at
    encode time), in the HF backend's own float32 operations and order, so bit-identical to
    its ``pixel_values``: the PIL backend rescales in float64, rounds to float32, then
    normalizes; the torchvision backend folds the rescale into the mean and std,
    ``(x - mean / factor) / (std / factor)``."""

    rescale_factor: float | None  # None: no rescale
    mean: tuple[float, ...] | None  # None: no normalize
    std: tuple[float, ...] | None
    fused: bool  # the torchvision backend's order

    @classmethod
    def settings_of(cls, ip: Any) -> dict[str, Any]:
        """These fields from an HF image processor."""
        return dict(rescale_factor=float(ip.rescale_factor) if ip.do_rescale else None,
                    mean=tuple(map(float, ip.image_mean)) if ip.do_normalize else None,
                    std=tuple(map(float, ip.image_std)) if ip.do_normalize else None,
                    fused=hasattr(ip, "_fuse_mean_std_and_rescale_factor"))

    def normalized(self, images: torch.Tensor) -> torch.Tensor:
        """``[B, H, W, 3]`` uint8 -> ``[B, 3, H, W]`` float32."""
        x = images.permute(0, 3, 1, 2)
        if self.mean is not None:
            mean, std = self._mean_std(x.device)
            if self.rescale_factor is None or self.fused:
                x = x.to(torch.float32, copy=True)
            else:
                x = (x.to(torch.float64) * self.rescale_factor).to(torch.float32)
            return x.sub_(mean).div_(std)  # x is a fresh float32 copy: in place
        if self.rescale_factor is not None:
            x = (x.to(torch.float64) * self.rescale_factor if not self.fused
                 else x * self.rescale_factor)
        return x.to(torch.float32)

    @lru_cache(maxsize=8)  # noqa: B019 (few devices, a handful of instances)
    def _mean_std(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        mean = torch.tensor(self.mean, dtype=torch.float32)
        std = torch.tensor(self.std, dtype=torch.float32)
        if self.fused and self.rescale_factor is not None:
            mean, std = mean * (1.0 / self.rescale_factor), std * (1.0 / self.rescale_factor)
        return mean.view(-1, 1, 1).to(device), std.view(-1, 1, 1).to(device)
