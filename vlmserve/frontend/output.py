"""Detokenize outputs incrementally, apply stop strings, build `RequestOutput`s (with the
tokens' log-probabilities for requests that asked)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from tokenizers import Tokenizer

from vlmserve.outputs import CompletionOutput, RequestOutput
from vlmserve.request import Request, RequestStatus


@dataclass(slots=True)
class _DetokState:
    text: str = ""
    prefix_offset: int = 0
    read_offset: int = 0
    prefix_text: str | None = ""  # decode of ids[prefix_offset:read_offset]; None: not yet
    num_tokens: int = 0  # output tokens reflected in `text`
    stop_reason: str | None = None  # set when a stop string ended the request
    sent_chars: int = 0  # delta outputs: text and tokens already reported
    sent_tokens: int = 0
    sent_prompt_logprobs: bool = False  # delta outputs: the prompt's logprobs go once
    logprob_sum: float = 0.0  # the sampled tokens' logprobs summed (`cumulative_logprob`)
    num_summed: int = 0  # over this many tokens


class OutputProcessor:
    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self._states: dict[str, _DetokState] = {}
        # text of single tokens (at most the vocabulary), by skip_special_tokens: most prefix
        # windows are the one token read last
        self._token_text: tuple[dict[int, str], dict[int, str]] = ({}, {})
        # the Rust tokenizer directly: the transformers wrapper costs ~10 us per call, which
        # adds up to milliseconds per step at large batch (same text when it does no cleanup)
        # (a private copy: preprocessing threads tokenize with the shared one concurrently)
        backend = getattr(tokenizer, "backend_tokenizer", None)
        cleanup = getattr(tokenizer, "clean_up_tokenization_spaces", False)
        self._fast_decode = None
        self._id_to_token = None
        self._special_ids: set[int] = set()
        if backend is not None and not cleanup:
            fast = Tokenizer.from_str(backend.to_str())
            self._fast_decode = fast.decode
            self._id_to_token = fast.id_to_token
            self._special_ids = {i for i, t in fast.get_added_tokens_decoder().items()
                                 if t.special}

    def add(self, request_id: str) -> None:
        self._states[request_id] = _DetokState()

    def drop(self, request_id: str) -> None:
        self._states.pop(request_id, None)

    def _decode(self, ids: list[int], skip: bool) -> str:
        if len(ids) == 1:
            memo = self._token_text[skip]
            text = memo.get(ids[0])
            if text is None:
                text = memo[ids[0]] = self._decode_uncached(ids, skip)
            return text
        return self._decode_uncached(ids, skip)

    def _decode_uncached(self, ids: list[int], skip: bool) -> str:
        if self._fast_decode is not None:
            return self._fast_decode(ids, skip_special_tokens=skip)
        return self.tokenizer.decode(ids, skip_special_tokens=skip)

    def _dropped(self, token: int, skip: bool) -> bool:
        """Whether the tokenizer leaves this id out before decoding (an id it does not know,
        or a special token while skipping those), so that it changes no decoded text. Only
        known for the Rust tokenizer, whose decode filters ids before its decoder runs."""
        if self._id_to_token is None:
            return False
        return (skip and token in self._special_ids) or self._id_to_token(token) is None

    def update(self, req: Request) -> bool:
        """Take in the request's new tokens; True if a stop string was hit (the caller then
        finishes the request).

        The text grows by the decode of the window ids[prefix_offset:] past the decode of
        ids[prefix_offset:read_offset], once that is a complete character. A token the
        tokenizer drops leaves the window's decode as it was, so it cannot advance the text
        and is not decoded at all."""
        sp = req.sampling_params
        if self._at_end_only(sp):
            return False  # `flush` decodes the whole output once
        st = self._states[req.request_id]
        ids = req.output_token_ids
        skip = sp.skip_special_tokens
        before = len(st.text)
        while st.num_tokens < len(ids):
            token = ids[st.num_tokens]
            st.num_tokens += 1
            if self._dropped(token, skip):
                continue
            if st.prefix_text is None:
                st.prefix_text = self._decode(ids[st.prefix_offset:st.read_offset], skip)
            prefix = st.prefix_text
            full = self._decode(ids[st.prefix_offset:st.num_tokens], skip)
            if len(full) > len(prefix) and not full.endswith("\ufffd"):
                st.text += full[len(prefix):]
                st.prefix_offset, st.read_offset = st.read_offset, st.num_tokens
                st.prefix_text = None
        # stop strings count from min_tokens on (in the text that came since, as vLLM's)
        return bool(sp.stop) and len(ids) >= sp.min_tokens and self._apply_stop(st, sp, before)

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

    @staticmethod
    def _at_end_only(sp) -> bool:
        """Nothing reads this request's text before it finishes (final output only, no stop
        strings to look for): one decode of the whole output at the end replaces the
        incremental one (the text the incremental decode converges to; a few us per request
        instead of a few us per token)."""
        return sp.output_kind == "final_only" and not sp.stop

    def flush(self, req: Request) -> None:
        """At finish, emit any bytes held back waiting for a complete character."""
        st = self._states[req.request_id]
        if st.stop_reason is not None:
            return
        ids = req.output_token_ids
        skip = req.sampling_params.skip_special_tokens
        if self._at_end_only(req.sampling_params):
            st.text = self._decode_uncached(ids, skip)
            st.num_tokens = st.prefix_offset = st.read_offset = len(ids)
            return
        prefix = self._decode(ids[st.prefix_offset:st.read_offset], skip)
        full = self._decode(ids[st.prefix_offset:], skip)
        if len(full) > len(prefix):
            st.text += full[len(prefix):]
            st.prefix_offset = st.read_offset = len(ids)
            st.prefix_text = None

    def process(self, req: Request, on_stop: Callable[[Request], None]
                ) -> RequestOutput | None:
        """Take in a request's new tokens and return its output if one is due. A stop string
        found in the text calls `on_stop(req)`, which must finish the request (status
        `FINISHED_STOPPED`). A finished request's state is dropped."""
        if self.update(req):
            on_stop(req)
            assert req.status is RequestStatus.FINISHED_STOPPED
        if req.status.finished:
            self.flush(req)
            out = self.make_output(req)
            self.drop(req.request_id)
            return out
        if req.sampling_params.output_kind != "final_only":
            return self.make_output(req)
        return None

    def make_output(self, req: Request) -> RequestOutput:
        """The request's output now: all of it, or for `output_kind="delta"` what is new
        since the last one (then counted as reported)."""
        st = self._states[req.request_id]
        sp = req.sampling_params
        finished = req.status.finished
        text, token_ids, logprobs = st.text, req.output_token_ids, req.output_logprobs
        if sp.output_kind == "delta":
            # held back: the characters a stop string found by a later token could still cut
            # (one starts at most len(stop) - 1 characters before the text it completes)
            upto = len(text)
            if sp.stop and not finished:
                upto = max(st.sent_chars, upto - max(map(len, sp.stop)) + 1)
            text = text[st.sent_chars:upto]
            token_ids = token_ids[st.sent_tokens:]
            logprobs = None if logprobs is None else logprobs[st.sent_tokens:]
            st.sent_chars, st.sent_tokens = upto, len(req.output_token_ids)
        else:
            token_ids = list(token_ids)
            logprobs = None if logprobs is None else list(logprobs)
        cumulative = None
        if req.output_logprobs is not None:  # the whole output's, for delta outputs too
            lps, ids = req.output_logprobs, req.output_token_ids
            for i in range(st.num_summed, min(len(lps), len(ids))):
                st.logprob_sum += lps[i][ids[i]]
            st.num_summed = max(st.num_summed, min(len(lps), len(ids)))
            cumulative = st.logprob_sum
        prompt_logprobs = ranks = None
        if req.prompt_logprobs is not None and (sp.output_kind != "delta"
                                                or not st.sent_prompt_logprobs):
            prompt_logprobs, ranks = req.prompt_logprobs, req.prompt_logprob_ranks
            st.sent_prompt_logprobs = True
        return RequestOutput(
            request_id=req.request_id,
            prompt=req.prompt,
            prompt_token_ids=req.prompt_token_ids,
            outputs=[CompletionOutput(0, text, token_ids, req.status.value if finished else None,
                                      logprobs, cumulative)],
            finished=finished,
            prompt_logprobs=prompt_logprobs,
            prompt_logprob_ranks=ranks,
        )
