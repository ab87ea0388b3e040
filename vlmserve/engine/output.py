"""Detokenize outputs incrementally, apply stop strings, build `RequestOutput`s."""

from __future__ import annotations

from dataclasses import dataclass

from tokenizers import Tokenizer

from vlmserve.outputs import CompletionOutput, RequestOutput
from vlmserve.request import Request


@dataclass
class _DetokState:
    text: str = ""
    prefix_offset: int = 0
    read_offset: int = 0
    num_tokens: int = 0  # output tokens reflected in `text`
    stop_reason: str | None = None  # set when a stop string ended the request


class OutputProcessor:
    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self._states: dict[str, _DetokState] = {}
        # the Rust tokenizer directly: the transformers wrapper costs ~10 us per call, which
        # adds up to milliseconds per step at large batch (same text when it does no cleanup)
        # (a private copy: preprocessing threads tokenize with the shared one concurrently)
        backend = getattr(tokenizer, "backend_tokenizer", None)
        cleanup = getattr(tokenizer, "clean_up_tokenization_spaces", False)
        self._fast_decode = None
        if backend is not None and not cleanup:
            self._fast_decode = Tokenizer.from_str(backend.to_str()).decode

    def add(self, request_id: str) -> None:
        self._states[request_id] = _DetokState()

    def drop(self, request_id: str) -> None:
        self._states.pop(request_id, None)

    def _decode(self, ids: list[int], skip: bool) -> str:
        if self._fast_decode is not None:
            return self._fast_decode(ids, skip_special_tokens=skip)
        return self.tokenizer.decode(ids, skip_special_tokens=skip)

    def update(self, req: Request) -> bool:
        """Take in the request's new tokens; True if a stop string was hit (the caller then
        finishes the request)."""
        st = self._states[req.request_id]
        ids = req.output_token_ids
        sp = req.sampling_params
        skip = sp.skip_special_tokens
        before = len(st.text)
        while st.num_tokens < len(ids):
            st.num_tokens += 1
            window = ids[st.prefix_offset:st.num_tokens]
            prefix = self._decode(ids[st.prefix_offset:st.read_offset], skip)
            full = self._decode(window, skip)
            if len(full) > len(prefix) and not full.endswith("\ufffd"):
                st.text += full[len(prefix):]
                st.prefix_offset, st.read_offset = st.read_offset, st.num_tokens
        if sp.stop and self._apply_stop(st, sp, before):
            return True
        return False

    def _apply_stop(self, st: _DetokState, sp, before: int) -> bool:
        longest = max(len(s) for s in sp.stop)
        search_from = max(0, before - longest + 1)
        hits = [(st.text.find(s, search_from), s) for s in sp.stop]
        hits = [(i, s) for i, s in hits if i >= 0]
        if not hits:
            return False
        idx, s = min(hits)
        st.text = st.text[: idx + len(s)] if sp.include_stop_str_in_output else st.text[:idx]
        st.stop_reason = s
        return True

    def flush(self, req: Request) -> None:
        """At finish, emit any bytes held back waiting for a complete character."""
        st = self._states[req.request_id]
        if st.stop_reason is not None:
            return
        ids = req.output_token_ids
        skip = req.sampling_params.skip_special_tokens
        prefix = self._decode(ids[st.prefix_offset:st.read_offset], skip)
        full = self._decode(ids[st.prefix_offset:], skip)
        if len(full) > len(prefix):
            st.text += full[len(prefix):]
            st.prefix_offset = st.read_offset = len(ids)

    def make_output(self, req: Request) -> RequestOutput:
        st = self._states[req.request_id]
        finished = req.status.finished
        reason = req.status.value if finished else None
        return RequestOutput(
            request_id=req.request_id,
            prompt=req.prompt,
            prompt_token_ids=req.prompt_token_ids,
            outputs=[CompletionOutput(0, st.text, list(req.output_token_ids), reason)],
            finished=finished,
        )
