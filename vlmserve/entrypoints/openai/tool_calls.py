"""Tool calls (OpenAI's `tools` and `tool_choice`) as structured outputs: which calls a
request asks for (`tool_call_mode`: a named function or "required"; "auto" needs a parser of
the model's own tool-call format, which this server does not have), the JSON schema its
answer is held to (`tool_call_schema`), and the answer read back as calls, whole
(`tool_calls_of`) or as its text grows (`RequiredCalls`, for streams)."""

from __future__ import annotations

import json
import re
import uuid
from typing import TYPE_CHECKING, Any, Literal

from pydantic import BaseModel, Field

from vlmserve.errors import InvalidSamplingParamsError
from vlmserve.sampling_params import StructuredOutputsParams

if TYPE_CHECKING:
    from vlmserve.entrypoints.openai.protocol import FunctionDefinition, NamedToolChoice, Tool


def call_id() -> str:
    return f"call-{uuid.uuid4().hex}"


class FunctionCall(BaseModel):
    name: str
    arguments: str  # JSON


class ToolCall(BaseModel):
    id: str = Field(default_factory=call_id)
    type: Literal["function"] = "function"
    function: FunctionCall


def tool_call_mode(tools: list[Tool] | None, tool_choice: str | NamedToolChoice | None
                   ) -> str | FunctionDefinition | None:
    """How the answer calls tools: None (text), "required" (one call or more, of any of
    ``tools``), or the named function it must call. "auto" (the model decides; the default
    with tools) is a 400, as vLLM's without --tool-call-parser."""
    choice = tool_choice or ("auto" if tools else "none")
    if choice == "none":
        return None
    if not tools:
        name = f'"{choice}"' if isinstance(choice, str) else (
            f"{{function {choice.function.name!r}}}")
        raise InvalidSamplingParamsError(f"tool_choice {name} needs tools")
    if choice == "auto":
        raise InvalidSamplingParamsError(
            'tool_choice "auto" (the default with tools) needs a parser of the model\'s '
            'tool calls, which this server does not have: set tool_choice to "required", '
            'a named function, or "none"')
    if choice == "required":
        return "required"
    names = {t.function.name: t.function for t in tools}
    if choice.function.name not in names:
        raise InvalidSamplingParamsError(
            f"tool_choice names function {choice.function.name!r}, which is not among "
            f"the tools ({', '.join(names)})")
    return names[choice.function.name]


def _arguments_schema(fn: FunctionDefinition) -> dict[str, Any]:
    return fn.parameters if fn.parameters is not None else {"type": "object"}


def tool_call_schema(mode: str | FunctionDefinition, tools: list[Tool]
                     ) -> StructuredOutputsParams:
    """What the answer is held to: the named function's arguments, or ("required") vLLM's
    list of {name, parameters} of the tools; compact JSON (", " and ": " between items, no
    other whitespace)."""
    if mode == "required":
        return StructuredOutputsParams(json={"type": "array", "minItems": 1, "items": {
            "anyOf": [{"type": "object", "properties": {
                "name": {"type": "string", "enum": [t.function.name]},
                "parameters": _arguments_schema(t.function)},
                "required": ["name", "parameters"]} for t in tools]}},
            disable_any_whitespace=True)
    return StructuredOutputsParams(json=_arguments_schema(mode), disable_any_whitespace=True)


def tool_calls_of(mode: str | FunctionDefinition, text: str) -> list[ToolCall] | None:
    """The tool calls an answer made under ``mode`` (its text held to `tool_call_schema`);
    None when the text is not a whole call (cut at max_tokens)."""
    if not isinstance(mode, str):
        try:
            json.loads(text)
        except ValueError:
            return None
        return [ToolCall(function=FunctionCall(name=mode.name, arguments=text))]
    try:
        calls = json.loads(text)
        return [ToolCall(function=FunctionCall(name=c["name"],
                                               arguments=json.dumps(c["parameters"])))
                for c in calls]
    except (ValueError, KeyError, TypeError):
        return None


class RequiredCalls:
    """Tool-call deltas from the text of a "required" answer as it grows: its grammar makes
    it `[{"name": "F", "parameters": ARGS}, ...]` (compact JSON), so a call begins with that
    head (its id and name then go out) and its ARGS are sent as they come, up to where the
    value closes."""

    HEAD = re.compile(r'\{"name": "((?:[^"\\]|\\.)*)", "parameters": ')

    def __init__(self) -> None:
        self.text = ""
        self.begun = 0  # calls whose id and name went out
        self.count = 0  # calls whose arguments are complete
        self._pos = 0  # where the next head may start
        self._args: int | None = None  # where the current call's ARGS start
        self._sent = self._scan = 0  # ARGS sent, scanned (offsets in `text`)
        self._depth, self._in_str, self._esc = 0, False, False

    def feed(self, text: str) -> list[dict]:
        self.text += text
        out: list[dict] = []
        while True:
            if self._args is None:
                m = self.HEAD.search(self.text, self._pos)
                if m is None:
                    return out
                out.append({"index": self.count, "id": call_id(), "type": "function",
                            "function": {"name": json.loads(f'"{m.group(1)}"'),
                                         "arguments": ""}})
                self.begun += 1
                self._args = self._sent = self._scan = m.end()
                self._depth, self._in_str, self._esc = 0, False, False
            end = self._value_end()
            stop = self._scan if end is None else end
            if stop > self._sent:
                out.append({"index": self.count,
                            "function": {"arguments": self.text[self._sent:stop]}})
                self._sent = stop
            if end is None:
                return out
            self.count += 1
            self._args, self._pos = None, end

    def _value_end(self) -> int | None:
        """Where the current ARGS value ends, if it has (scanning on from the last call)."""
        for i in range(self._scan, len(self.text)):
            ch = self.text[i]
            self._scan = i + 1
            if self._in_str:
                self._esc, self._in_str = (False, True) if self._esc else (
                    ch == "\\", ch != '"')
            elif ch == '"':
                self._in_str = True
            elif ch in "{[":
                self._depth += 1
            elif ch in "}]":
                if self._depth == 0:  # the call's own brace after a scalar
                    self._scan = i
                    return i
                self._depth -= 1
                if self._depth == 0:
                    return i + 1
        return None
