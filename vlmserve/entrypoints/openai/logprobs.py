"""Token log-probabilities in OpenAI's formats: chat (an object per token with its
`top_logprobs`) and completions (the legacy parallel lists, an echoed prompt's first), from
`CompletionOutput.logprobs` and `RequestOutput.prompt_logprobs`; vLLM's `prompt_logprobs`."""

from __future__ import annotations

from collections.abc import Sequence
from itertools import islice

from vlmserve.entrypoints.openai.responses import (
    ChatLogprobs,
    ChatTokenLogprob,
    CompletionLogprobs,
    TopLogprob,
)
from vlmserve.outputs import RequestOutput
from vlmserve.sampling_params import SamplingParams

# JSON has no -inf: a token of probability 0 gets this logprob instead (vLLM's value)
MIN_LOGPROB = -9999.0


def _byte_level_table() -> dict[str, int]:
    """Byte-level BPE's character for each byte (GPT-2's scheme: printable Latin-1 bytes stand
    for themselves, the others for code points from 256 on, in byte order), reversed."""
    kept = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
    chars = {b: chr(b) for b in kept}
    for n, b in enumerate(b for b in range(256) if b not in chars):
        chars[b] = chr(256 + n)
    return {c: b for b, c in chars.items()}


class TokenTexts:
    """A token id's text (its decode alone, special tokens kept) and its bytes: the token's
    own bytes for a byte-level BPE tokenizer (a piece of a multi-byte character included),
    else the UTF-8 of its text. Memoized; ids the tokenizer does not know are ""."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self._memo: dict[int, tuple[str, list[int]]] = {}
        decoder = getattr(getattr(tokenizer, "backend_tokenizer", None), "decoder", None)
        self._bytes_of = (_byte_level_table() if type(decoder).__name__ == "ByteLevel"
                          else None)
        self._added = set(getattr(tokenizer, "added_tokens_decoder", {}) or {})

    def __call__(self, token_id: int) -> tuple[str, list[int]]:
        got = self._memo.get(token_id)
        if got is None:
            got = self._memo[token_id] = self._text_and_bytes(token_id)
        return got

    def _text_and_bytes(self, token_id: int) -> tuple[str, list[int]]:
        try:
            piece = self.tokenizer.convert_ids_to_tokens(token_id)
        except (IndexError, OverflowError, ValueError):
            piece = None
        if piece is None:  # past the tokenizer's vocabulary (a padded embedding's rows)
            return "", []
        text = self.tokenizer.decode([token_id], skip_special_tokens=False)
        table = self._bytes_of
        if table is not None and token_id not in self._added and all(c in table for c in piece):
            return text, [table[c] for c in piece]
        return text, list(text.encode("utf-8", errors="replace"))


def _value(logprob: float) -> float:
    return max(logprob, MIN_LOGPROB)


def chat_logprobs(texts: TokenTexts, token_ids: Sequence[int],
                  logprobs: Sequence[dict[int, float]], top: int) -> ChatLogprobs:
    """Chat's `logprobs` for these tokens: each token's own and its `top` most likely."""
    content = []
    for token, lps in zip(token_ids, logprobs):
        text, raw = texts(token)
        tops = []
        for tid, lp in islice(lps.items(), top):  # the top ones come first (sampler)
            t, b = texts(tid)
            tops.append(TopLogprob(token=t, logprob=_value(lp), bytes=b))
        content.append(ChatTokenLogprob(token=text, logprob=_value(lps[token]), bytes=raw,
                                        top_logprobs=tops))
    return ChatLogprobs(content=content)


def completion_logprobs(texts: TokenTexts, token_ids: Sequence[int],
                        logprobs: Sequence[dict[int, float]], offset: int = 0,
                        out: CompletionLogprobs | None = None
                        ) -> tuple[CompletionLogprobs, int]:
    """Completions' legacy `logprobs` for these tokens (appended to ``out``'s, e.g. an echoed
    prompt's), their text offsets counted from `offset` (the length of the tokens' texts
    before them); and the offset after them."""
    out = out if out is not None else CompletionLogprobs()
    for token, lps in zip(token_ids, logprobs):
        text = texts(token)[0]
        out.tokens.append(text)
        out.token_logprobs.append(_value(lps[token]))
        out.top_logprobs.append({texts(tid)[0]: _value(lp) for tid, lp in lps.items()})
        out.text_offset.append(offset)
        offset += len(text)
    return out, offset


def echoed_prompt_logprobs(texts: TokenTexts, prompt_ids: Sequence[int],
                           prompt_logprobs: Sequence[dict[int, float] | None], top: int
                           ) -> tuple[CompletionLogprobs, int]:
    """Completions' legacy `logprobs` of an echoed prompt (`echo` with `logprobs`): its first
    token without any (None, as OpenAI), each other token's own and its `top` most likely;
    and the offset after them (where the completion's tokens go on)."""
    out = CompletionLogprobs()
    offset = 0
    for token, lps in zip(prompt_ids, prompt_logprobs):
        text = texts(token)[0]
        out.tokens.append(text)
        out.text_offset.append(offset)
        offset += len(text)
        if lps is None:
            out.token_logprobs.append(None)
            out.top_logprobs.append(None)
            continue
        out.token_logprobs.append(_value(lps[token]))
        tops = {texts(tid)[0]: _value(lp) for tid, lp in islice(lps.items(), top)}
        tops.setdefault(text, _value(lps[token]))
        out.top_logprobs.append(tops)
    return out, offset


def prompt_logprobs_json(texts: TokenTexts, prompt_ids: Sequence[int],
                         prompt_logprobs: Sequence[dict[int, float] | None],
                         ranks: Sequence[int | None], top: int) -> list[dict | None]:
    """vLLM's `prompt_logprobs` of a response: per prompt token None (the first) or {token id
    (a string, JSON's keys): {"logprob", "rank", "decoded_token"}}, its `top` most likely
    (ranks 1..top) and the prompt's own token (its rank in the vocabulary)."""
    out: list[dict | None] = []
    for token, lps, rank in zip(prompt_ids, prompt_logprobs, ranks):
        if lps is None:
            out.append(None)
            continue
        entry = {}
        for i, (tid, lp) in enumerate(islice(lps.items(), top)):
            entry[str(tid)] = {"logprob": _value(lp), "rank": rank if tid == token else i + 1,
                               "decoded_token": texts(tid)[0]}
        entry.setdefault(str(token), {"logprob": _value(lps[token]), "rank": rank,
                                      "decoded_token": texts(token)[0]})
        out.append(entry)
    return out


def completion_choice_logprobs(texts: TokenTexts, out: RequestOutput, params: SamplingParams,
                               echo: str | None, offset: int = 0
                               ) -> tuple[CompletionLogprobs | None, int]:
    """A completion choice's legacy `logprobs` for this output (None unless asked): an
    echoed prompt's tokens first (``echo``: its text; in the output that carries the prompt's
    logprobs), then the new tokens', offsets counted from ``offset``; and the offset after."""
    if params.logprobs is None:
        return None, offset
    c, lps = out.outputs[0], None
    if echo is not None and out.prompt_logprobs is not None:
        lps, offset = echoed_prompt_logprobs(texts, out.prompt_token_ids, out.prompt_logprobs,
                                             params.logprobs)
    return completion_logprobs(texts, c.token_ids, c.logprobs, offset, lps)
