"""What a request must fit to ever be served: the engine's limits, checked by the front ends
before a request reaches the engine core (and by the scheduler at admission)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class AdmissionLimits:
    """The limits a request must fit to ever be served (see `check`)."""

    max_model_len: int
    max_num_batched_tokens: int
    enable_chunked_prefill: bool
    max_kv_tokens: int  # the whole KV cache
    max_num_encoder_tokens: int
    encoder_cache_rows: int
    whole_images: bool = False  # each image computed in one step (images read both ways)

    def check_max_tokens(self, num_prompt_tokens: int, max_tokens: int) -> str | None:
        """Why `max_tokens` output tokens cannot follow the prompt within the context length,
        or None (the server's check of a max_tokens a client asked for, as vLLM's; otherwise
        a request just stops at the context length)."""
        n, room = num_prompt_tokens, self.max_model_len - num_prompt_tokens
        if n + max_tokens <= self.max_model_len:
            return None
        return (f"max_tokens of {max_tokens} is too large: the prompt is {n} tokens (images "
                f"included) and the model's maximum context length is {self.max_model_len}, "
                f"so at most {room} output tokens fit")

    def check(self, num_prompt_tokens: int, image_lengths: list[int],
              names: list[str] | None = None) -> str | None:
        """Why a prompt of this many tokens with images (encoder items: an image, a video,
        a Qwen3-VL temporal patch) of these lengths can never be served, or None; `names`:
        what a message calls each item ("video 0"; default "image N", N its place)."""
        n = num_prompt_tokens
        if n + 1 > self.max_model_len:
            return (f"prompt is {n} tokens (images included); with at least one output token it "
                    f"exceeds the model's maximum context length of {self.max_model_len}")
        if not self.enable_chunked_prefill and n > self.max_num_batched_tokens:
            return (f"prompt is {n} tokens, more than max_num_batched_tokens="
                    f"{self.max_num_batched_tokens} with chunked prefill disabled")
        if n + 1 > self.max_kv_tokens:
            return f"prompt is {n} tokens, more than the whole KV cache holds"
        for i, length in enumerate(image_lengths):
            name = (names[i] if names else "") or f"image {i}"
            if length > self.max_num_encoder_tokens:
                return (f"{name} becomes {length} tokens, more than the per-step encoder "
                        f"budget of {self.max_num_encoder_tokens} (--max-num-encoder-tokens)")
            if self.whole_images and length > self.max_num_batched_tokens:
                return (f"{name} becomes {length} tokens, more than a step computes "
                        f"(max_num_batched_tokens={self.max_num_batched_tokens}), and this "
                        "model's images are computed whole in one step")
            if length > self.encoder_cache_rows:
                return (f"{name} becomes {length} tokens, more than the encoder cache "
                        f"capacity of {self.encoder_cache_rows} (--mm-cache-gb)")
        return None
