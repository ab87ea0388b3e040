"""Reasoning models' thinking apart from their answer (`--reasoning-parser`, vLLM's): the text
inside ``<think>`` ... ``</think>`` goes to the message's `reasoning` (and, for older
clients, `reasoning_content`), the rest is its content.

One rule serves Qwen3(-VL) Thinking and DeepSeek-R1 alike, whichever way their templates
open the thinking: an answer is reasoning from its start when its prompt ends inside an open
``<think>`` (the template wrote the tag: Qwen3-VL-Thinking, R1's newer template) or when its
text begins with ``<think>``; then it is reasoning up to ``</think>`` (all of it when cut off
before) and content after. A prompt whose thinking the template closed (Qwen3 with
``enable_thinking: false``) or that never opened it gives content only. Whitespace at the
start of either part is dropped.
"""

from __future__ import annotations

REASONING_PARSERS = ("qwen3", "deepseek_r1")
OPEN, CLOSE = "<think>", "</think>"


def prompt_opens_thinking(prompt: str | None) -> bool:
    """Whether ``prompt`` ends inside a ``<think>`` its own text opened."""
    if not prompt:
        return False
    return prompt.rfind(OPEN) > prompt.rfind(CLOSE)


def _partial_tag(text: str, tag: str) -> int:
    """Characters at the end of ``text`` that may begin ``tag`` (held back in a stream)."""
    return next((k for k in range(min(len(tag) - 1, len(text)), 0, -1)
                 if text.endswith(tag[:k])), 0)


class ReasoningSplitter:
    """An answer's text, as it grows, split into (reasoning, content) deltas."""

    def __init__(self, prompt_opened: bool) -> None:
        # "start": not known yet whether the answer opens with <think>; "reasoning";
        # "content"
        self._state = "reasoning" if prompt_opened else "start"
        self._buf = ""
        self._at_start = True  # of the current part: its leading whitespace is dropped

    def feed(self, text: str, final: bool = False) -> tuple[str, str]:
        self._buf += text
        reasoning, content = [], []
        while True:
            if self._state == "start":
                head = self._buf.lstrip()
                if head.startswith(OPEN):
                    self._buf, self._state, self._at_start = head[len(OPEN):], "reasoning", True
                    continue
                if OPEN.startswith(head) and not final:  # "", "<", "<thi", ...: wait
                    return "", ""
                self._state = "content"
            if self._state == "reasoning":
                i = self._buf.find(CLOSE)
                if i < 0:
                    keep = 0 if final else _partial_tag(self._buf, CLOSE)
                    reasoning.append(self._take(len(self._buf) - keep))
                    break
                reasoning.append(self._take(i))  # the buffer now starts at the tag
                self._buf, self._state, self._at_start = (self._buf[len(CLOSE):], "content",
                                                          True)
                continue
            content.append(self._take(len(self._buf)))
            break
        return "".join(reasoning), "".join(content)

    def _take(self, n: int) -> str:
        """The next ``n`` characters of the buffer (less leading whitespace of a part)."""
        out, self._buf = self._buf[:n], self._buf[n:]
        if self._at_start:
            out = out.lstrip()
            self._at_start = not out
        return out


def split_reasoning(text: str, prompt_opened: bool) -> tuple[str | None, str | None]:
    """A whole answer's (reasoning, content), None for a part it does not have."""
    reasoning, content = ReasoningSplitter(prompt_opened).feed(text, final=True)
    started = prompt_opened or text.lstrip().startswith(OPEN)
    return (reasoning if started else None), (content or None if started else content)
