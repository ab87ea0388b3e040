"""Tool calls (OpenAI's `tools` and `tool_choice`): which calls a request asks for
(`tool_call_mode`: a named function or "required", held to a JSON schema by structured
outputs, `tool_call_schema`; or "auto", the model's own choice in its own format, read by a
parser: `--enable-auto-tool-choice --tool-call-parser hermes`), and the answer read back as
calls, whole (`tool_calls_of`) or as its text grows (`RequiredCalls`, `HermesCalls`, for
streams)."""

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


# the models' tool-call formats `--tool-call-parser` knows
TOOL_CALL_PARSERS = ("hermes",)


def tool_call_mode(tools: list[Tool] | None, tool_choice: str | NamedToolChoice | None,
                   auto: bool = False) -> str | FunctionDefinition | None:
    """How the answer calls tools: None (text), "required" (one call or more, of any of
    ``tools``), the named function it must call, or "auto" (the model decides; the default
    with tools), which needs the server's parser (``auto``), else a 400, as vLLM's without
    --enable-auto-tool-choice."""
    choice = tool_choice or ("auto" if tools else "none")
    if choice == "none":
        return None
    if not tools:
        name = f'"{choice}"' if isinstance(choice, str) else (
            f"{{function {choice.function.name!r}}}")
        raise InvalidSamplingParamsError(f"tool_choice {name} needs tools")
    if choice == "auto":
        if auto:
            return "auto"
        raise InvalidSamplingParamsError(
            'tool_choice "auto" (the default with tools) needs a parser of the model\'s '
            'tool calls, which this server was not started with (--enable-auto-tool-choice '
            '--tool-call-parser): set tool_choice to "required", a named function, or "none"')
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
        except (ValueError, RecursionError):
            return None
        return [ToolCall(function=FunctionCall(name=mode.name, arguments=text))]
    try:
        calls = json.loads(text)
        return [ToolCall(function=FunctionCall(name=c["name"],
                                               arguments=json.dumps(c["parameters"])))
                for c in calls]
    except (ValueError, KeyError, TypeError, RecursionError):
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


def _hermes_call(body: str) -> ToolCall | None:
    """One call's JSON, {"name": ..., "arguments": {...}}, as a `ToolCall` (None if it is
    not one)."""
    try:
        obj = json.loads(body)
    except (ValueError, RecursionError):  # not JSON, or nested deeper than it can be read
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    return ToolCall(function=FunctionCall(name=obj["name"], arguments=args if isinstance(
        args, str) else json.dumps(args, ensure_ascii=False)))


class HermesCalls:
    """Calls in the Hermes format (Qwen's): ``<tool_call>{"name": F, "arguments": ARGS}
    </tool_call>``, anywhere in the text, as it grows: the text around them is content (less
    a possible start of a tag at the end, held back), each call goes out whole once its tag
    closes (at the end of the output, an unclosed one too); a tag whose body is no call stays
    content."""

    OPEN, CLOSE = "<tool_call>", "</tool_call>"

    def __init__(self) -> None:
        self._buf = ""
        self._inside = False
        self.count = 0  # calls sent

    def feed(self, text: str, final: bool = False) -> tuple[str, list[dict]]:
        """The content and the tool-call deltas ({index, id, type, function}) ``text``
        completes (``final``: the output's end)."""
        self._buf += text
        content: list[str] = []
        calls: list[dict] = []
        while True:
            if not self._inside:
                i = self._buf.find(self.OPEN)
                if i < 0:
                    keep = 0 if final else next((k for k in range(len(self.OPEN) - 1, 0, -1)
                                                 if self._buf.endswith(self.OPEN[:k])), 0)
                    cut = len(self._buf) - keep
                    content.append(self._buf[:cut])
                    self._buf = self._buf[cut:]
                    return "".join(content), calls
                content.append(self._buf[:i])
                self._buf, self._inside = self._buf[i + len(self.OPEN):], True
            j = self._buf.find(self.CLOSE)
            if j < 0 and not final:
                return "".join(content), calls
            body = self._buf if j < 0 else self._buf[:j]
            call = _hermes_call(body.strip())
            if call is None:
                content.append(self.OPEN + body + ("" if j < 0 else self.CLOSE))
            else:
                calls.append({"index": self.count, "id": call.id, "type": "function",
                              "function": call.function.model_dump()})
                self.count += 1
            self._buf = "" if j < 0 else self._buf[j + len(self.CLOSE):]
            self._inside = False


def auto_calls_of(text: str) -> tuple[str | None, list[ToolCall]]:
    """An "auto" answer's content (None when it only called tools) and its calls."""
    content, calls = HermesCalls().feed(text, final=True)
    return (None if calls and not content.strip() else content), [
        ToolCall(id=c["id"], function=FunctionCall(**c["function"])) for c in calls]
