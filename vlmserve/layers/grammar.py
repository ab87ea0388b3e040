"""Structured outputs: a request's output held to a JSON schema, a regular expression, a choice
or a grammar (`StructuredOutputsParams`), with xgrammar.

The front end checks the grammar's size against the engine's limits (`check_grammar_limits`)
and its text (`check_structured`: a 400 naming the problem, no tokenizer needed). The engine
core has it compiled against the tokenizer in a compile process when the request arrives
(layers/grammar_compile.py: `GrammarCompiler`, under a deadline and a memory limit, compiled
grammars cached by their text) and admits the request once compiled. The worker that
samples (rank 0 under tensor parallelism: its tokens are everyone's) takes that compile and,
before each sampling of the request, fills the request's row of a bitmask of allowed tokens
from a matcher that has accepted every token sampled so far (`RequestGrammar`,
`fill_bitmasks`); `apply_bitmask` masks the logits. xgrammar is imported only when a request
asks for structured output.
"""

from __future__ import annotations

import json
import logging
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any

import torch

from vlmserve.errors import InvalidSamplingParamsError
from vlmserve.sampling_params import StructuredOutputsParams
from vlmserve.utils import to_device

if TYPE_CHECKING:
    from vlmserve.config import StructuredOutputsConfig

logger = logging.getLogger(__name__)


def _xgrammar():
    try:
        import xgrammar
    except ImportError as e:  # pragma: no cover - a dependency of the package
        raise InvalidSamplingParamsError(
            "structured outputs need the xgrammar package (pip install xgrammar)") from e
    return xgrammar


def _choice_ebnf(choices: list[str]) -> str:
    """A grammar whose language is exactly ``choices`` (JSON string escapes are GBNF's)."""
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


def _grammar(xgr, spec: tuple[str, str, bool]):
    """The xgrammar `Grammar` of a `StructuredOutputsParams.spec` (no tokenizer)."""
    kind, text, any_whitespace = spec
    if kind == "json":
        return xgr.Grammar.from_json_schema(text, any_whitespace=any_whitespace)
    if kind == "json_object":  # any JSON object (OpenAI's JSON mode; vLLM's too)
        return xgr.Grammar.from_json_schema('{"type": "object"}', any_whitespace=any_whitespace)
    if kind == "regex":
        return xgr.Grammar.from_regex(text)
    if kind == "choice":
        return xgr.Grammar.from_ebnf(_choice_ebnf(json.loads(text)))
    return xgr.Grammar.from_ebnf(text)


def _nesting(value: Any, limit: int) -> int:
    """How deeply ``value`` (a JSON value, or its text) nests objects and arrays, counted
    without recursion and only up to ``limit`` + 1 (a text may be malformed: its brackets
    outside strings are counted)."""
    if isinstance(value, str):
        depth = deepest = 0
        in_string = escaped = False
        for ch in value:
            if in_string:
                if escaped:
                    escaped = False
                elif ch == "\\":
                    escaped = True
                elif ch == '"':
                    in_string = False
            elif ch == '"':
                in_string = True
            elif ch in "[{":
                depth += 1
                if depth > deepest:
                    deepest = depth
                    if deepest > limit:
                        break
            elif ch in "]}":
                depth -= 1
        return deepest
    deepest = 0
    stack = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, dict | list):
            deepest = max(deepest, depth)
            if deepest > limit:
                break
            stack.extend((v, depth + 1) for v in (item.values() if isinstance(item, dict)
                                                  else item))
    return deepest


def check_grammar_limits(params: StructuredOutputsParams, limits: StructuredOutputsConfig
                         ) -> None:
    """Raise `InvalidSamplingParamsError` naming the limit and its option if ``params`` asks
    for more than ``limits`` allow (bytes, a JSON schema's nesting, choices): checked before
    the grammar is parsed or compiled."""
    def check_bytes(what: str, text: str) -> None:
        size = len(text.encode())
        if size > limits.max_grammar_bytes:
            raise InvalidSamplingParamsError(
                f"structured outputs: {what} {size} bytes, more than the limit of "
                f"{limits.max_grammar_bytes} (--max-grammar-bytes)")

    if params.choice is not None:
        if len(params.choice) > limits.max_grammar_choices:
            raise InvalidSamplingParamsError(
                f"structured outputs: {len(params.choice)} choices, more than the limit of "
                f"{limits.max_grammar_choices} (--max-grammar-choices)")
        check_bytes("the choices are", json.dumps(params.choice, ensure_ascii=False))
    elif params.json is not None:
        what = "the JSON schema (of tool calls: all tools' schemas) is"
        if isinstance(params.json, str):  # its size first: a long text is refused at once
            check_bytes(what, params.json)
        if _nesting(params.json, limits.max_grammar_nesting) > limits.max_grammar_nesting:
            raise InvalidSamplingParamsError(
                f"structured outputs: the JSON schema nests objects and arrays more than "
                f"{limits.max_grammar_nesting} deep (--max-grammar-nesting)")
        if not isinstance(params.json, str):
            check_bytes(what, json.dumps(params.json, ensure_ascii=False))
    elif params.regex is not None:
        check_bytes("the regex is", params.regex)
    elif params.grammar is not None:
        check_bytes("the grammar is", params.grammar)


def check_structured(params: StructuredOutputsParams) -> None:
    """Raise `InvalidSamplingParamsError` naming the problem if ``params`` cannot be compiled
    (a schema xgrammar cannot hold to, a regular expression or grammar that does not parse)
    or can match nothing (a regular expression of no string: the output could never end)."""
    xgr = _xgrammar()
    kind, text, _ = params.spec
    try:
        _grammar(xgr, params.spec)
    except Exception as e:  # noqa: BLE001 - xgrammar's parse errors have no common base
        msg = str(e).strip().splitlines()
        raise InvalidSamplingParamsError(
            f"structured outputs: invalid {kind}: {msg[0] if msg else type(e).__name__}"
        ) from None
    if kind == "regex" and regex_matches_nothing(text):
        raise InvalidSamplingParamsError(
            f"structured outputs: the regex {text[:80]!r} matches nothing (no output could "
            "ever match it)")


def regex_matches_nothing(pattern: str) -> bool:
    """Whether a regular expression matches no string at all, as Python's `re` reads it (a
    character class that excludes every character, such as ``[^\\s\\S]``, in every way
    through the expression). False where it cannot tell: only a sure "nothing" is said."""
    import re
    from re import _constants as c
    from re import _parser

    try:
        parsed = _parser.parse(pattern)
    except (re.error, RecursionError, OverflowError, ValueError):
        return False
    pairs = [{c.CATEGORY_DIGIT, c.CATEGORY_NOT_DIGIT}, {c.CATEGORY_SPACE, c.CATEGORY_NOT_SPACE},
             {c.CATEGORY_WORD, c.CATEGORY_NOT_WORD}]

    def class_empty(items: list) -> bool:
        if not items or items[0][0] is not c.NEGATE:
            return False  # a class of some characters matches them
        cats = {av for op, av in items if op is c.CATEGORY}
        if any(pair <= cats for pair in pairs):
            return True
        spans = sorted((av, av) if op is c.LITERAL else av for op, av in items[1:]
                       if op in (c.LITERAL, c.RANGE))
        reach = -1
        for lo, hi in spans:
            if lo > reach + 1:
                return False
            reach = max(reach, hi)
        return reach >= 0x10FFFF

    def empty(seq) -> bool:
        for op, av in seq:
            if op is c.IN and class_empty(av):
                return True
            if op is c.BRANCH and all(empty(alt) for alt in av[1]):
                return True
            if op is c.SUBPATTERN and empty(av[3]):
                return True
            if op is c.ATOMIC_GROUP and empty(av):
                return True
            if op in (c.MAX_REPEAT, c.MIN_REPEAT, c.POSSESSIVE_REPEAT) and av[0] > 0 and empty(
                    av[2]):
                return True
        return False

    try:
        return empty(parsed)
    except RecursionError:
        return False


class RequestGrammar:
    """One request's matcher: `catch_up` accepts the request's output tokens not accepted yet
    (all of them after a preemption: the matcher is rebuilt with the request's state);
    `fill_bitmasks` then writes the tokens allowed next of a step's requests. A token the
    matcher refuses (the request went on after its grammar was complete: ignore_eos,
    min_tokens) ends the constraint, with a warning."""

    def __init__(self, request_id: str, compiled: Future) -> None:
        self.request_id = request_id
        self.compiled = compiled
        self.matcher: Any = None
        self._accepted = 0
        self.active = True

    def catch_up(self, output_tokens: list[int]) -> bool:
        """Accept the tokens not accepted yet; whether the request's next token is
        constrained (False once its grammar has ended, or the constraint was dropped)."""
        if not self.active:
            return False
        if self.matcher is None:
            try:
                compiled = self.compiled.result()
            except Exception as e:  # noqa: BLE001 - the core admits only compiled grammars
                return self._stop(f"its grammar did not compile: {e}")
            self.matcher = _xgrammar().GrammarMatcher(compiled)
        for tok in output_tokens[self._accepted:]:
            if not self.matcher.accept_token(tok):
                return self._stop(f"token {tok} does not match its grammar")
            self._accepted += 1
        return not self.matcher.is_terminated() or self._stop(None)

    def _stop(self, why: str | None) -> bool:
        if why is not None:
            logger.warning("request %s goes on without structured output: %s",
                           self.request_id, why)
        self.active = False
        return False


_BATCH: Any = None


def fill_bitmasks(grammars: list[RequestGrammar], rows: list[int], bitmask: torch.Tensor
                  ) -> None:
    """Rows ``rows`` of ``bitmask`` with the tokens each of ``grammars`` (caught up) allows
    next, on xgrammar's own threads (a row costs tens of microseconds at a vocabulary of
    150,000: a batch's rows side by side)."""
    global _BATCH
    if _BATCH is None:
        _BATCH = _xgrammar().BatchGrammarMatcher()
    _BATCH.batch_fill_next_token_bitmask([g.matcher for g in grammars], bitmask, rows)


def allocate_bitmask(rows: int, vocab_size: int) -> torch.Tensor:
    """A host bitmask [rows, ceil(vocab / 32)] int32 with every token allowed."""
    return torch.full((rows, -(-vocab_size // 32)), -1, dtype=torch.int32)


_SHIFTS: dict[torch.device, torch.Tensor] = {}


def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor,
                  rows: list[int] | None = None) -> torch.Tensor:
    """``logits`` [N, vocab] with the tokens whose bit is 0 in ``bitmask`` ([len(rows), words]
    int32 on the host, for logits rows ``rows``, all of them if None; bit j of word w is
    token 32 w + j) at -inf, in place; returns ``logits``."""
    device = logits.device
    shifts = _SHIFTS.get(device)
    if shifts is None:
        shifts = _SHIFTS[device] = torch.arange(32, dtype=torch.int32, device=device)
    words = to_device(bitmask, device)
    banned = ((words.unsqueeze(-1) >> shifts) & 1).view(words.shape[0], -1)[
        :, :logits.shape[1]] == 0
    if rows is None or len(rows) == logits.shape[0]:
        return logits.masked_fill_(banned, float("-inf"))
    index = to_device(torch.tensor(rows, dtype=torch.int64), device)
    return logits.index_copy_(0, index, logits.index_select(0, index).masked_fill_(
        banned, float("-inf")))
