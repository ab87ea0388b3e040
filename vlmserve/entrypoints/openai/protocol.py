"""Requests and errors of the OpenAI API (the subset we serve, with vLLM's extensions);
responses.py has the responses and stream chunks."""

from __future__ import annotations

import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, field_validator, model_validator

from vlmserve.entrypoints.openai.tool_calls import tool_call_mode, tool_call_schema
from vlmserve.errors import InvalidSamplingParamsError
from vlmserve.models.processing import ChatTemplateOptions
from vlmserve.sampling_params import (
    MAX_LOGPROBS,
    MAX_N,
    SamplingParams,
    StructuredOutputsParams,
)

_PART_TYPES = ("text", "image_url", "video_url")
# OpenAI parameters we do not implement, with the values that ask for nothing (those pass): a
# request that sets one to anything else gets a 400 naming it, not silence.
_UNSUPPORTED: dict[str, tuple[Any, ...]] = {
    "functions": (None, []), "function_call": (None, "none"),
    "best_of": (None, 1),
    "suffix": (None, ""),
    "audio": (None,),
    "modalities": (None, ["text"]), "prediction": (None,), "reasoning_effort": (None,),
    "web_search_options": (None,),
}
# the most prompts one /v1/completions request may batch, and choices in all (prompts x n)
MAX_PROMPTS = 1024
# the most log-probabilities per token /v1/completions gives (OpenAI's limit)
MAX_COMPLETION_LOGPROBS = 5
# accepted and without effect on the output (bookkeeping fields of OpenAI's API)
_NO_EFFECT = ("user", "metadata", "store", "service_tier", "parallel_tool_calls")


def _same(value: Any, ok: Any) -> bool:
    """`value` is `ok` in JSON's terms: 0 and 0.0 alike, but `false` is not 0."""
    if ok is None or isinstance(ok, bool) or isinstance(value, bool):
        return value is ok
    if isinstance(ok, int):
        return type(value) in (int, float) and value == ok
    return value == ok


def random_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


class OpenAIModel(BaseModel):
    """Strict types where OpenAI's schema is strict: `true` is no integer, `"yes"` no
    boolean, a string no number."""

    model_config = ConfigDict(extra="ignore", strict=True)


# ---- errors -------------------------------------------------------------------------------


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | int | None = None


class ErrorResponse(BaseModel):
    error: ErrorInfo


# ---- requests -----------------------------------------------------------------------------


class ImageURL(OpenAIModel):
    url: str
    detail: Literal["auto", "low", "high"] | None = None


class TextPart(OpenAIModel):
    type: Literal["text"]
    text: str


class ImageURLPart(OpenAIModel):
    type: Literal["image_url"]
    image_url: ImageURL


class VideoURL(OpenAIModel):
    url: str


class VideoURLPart(OpenAIModel):
    """vLLM's extension: a video file (data URL, path, or http(s) URL as images allow)."""
    type: Literal["video_url"]
    video_url: VideoURL


class ChatMessage(OpenAIModel):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart | ImageURLPart | VideoURLPart] | None = None
    tool_calls: list[dict[str, Any]] | None = None  # an assistant's earlier tool calls
    tool_call_id: str | None = None  # a tool's answer: to which call

    @model_validator(mode="before")
    @classmethod
    def _check_parts(cls, data: Any) -> Any:
        content = data.get("content") if isinstance(data, dict) else None
        if isinstance(content, list):
            for part in content:
                kind = part.get("type") if isinstance(part, dict) else None
                if kind not in _PART_TYPES:
                    raise ValueError(f"unsupported content part type {kind!r}; supported: "
                                     f"{', '.join(_PART_TYPES)}")
        return data

    @property
    def num_chars(self) -> int:
        """Characters of text (image URLs not counted)."""
        return len(self.text)

    @property
    def text(self) -> str:
        """The message's text (its text parts joined)."""
        if isinstance(self.content, list):
            return "".join(p.text for p in self.content if isinstance(p, TextPart))
        return self.content or ""

    def to_dict(self) -> dict[str, Any]:
        """The message as `parse_chat_messages` takes it."""
        role = "system" if self.role == "developer" else self.role
        extra = {k: v for k, v in (("tool_calls", self.tool_calls),
                                   ("tool_call_id", self.tool_call_id)) if v is not None}
        if isinstance(self.content, list):
            return {"role": role, "content": [p.model_dump(exclude_none=True)
                                              for p in self.content], **extra}
        return {"role": role, "content": self.content or "", **extra}


class StreamOptions(OpenAIModel):
    include_usage: bool = False


class JSONSchema(OpenAIModel):
    name: str | None = None
    description: str | None = None
    json_schema: dict[str, Any] = Field(alias="schema")
    strict: bool | None = None


class ResponseFormat(OpenAIModel):
    """OpenAI's: plain text, any JSON object, or JSON that follows a schema."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JSONSchema | None = None

    @model_validator(mode="after")
    def _schema_given(self) -> ResponseFormat:
        if self.type == "json_schema" and self.json_schema is None:
            raise ValueError("response_format of type json_schema needs its json_schema "
                             "(with a schema)")
        return self


class StructuredOutputs(OpenAIModel):
    """vLLM's `structured_outputs` (`StructuredOutputsParams`' fields)."""

    model_config = ConfigDict(extra="forbid", strict=True)

    json_: dict[str, Any] | str | None = Field(None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool | None = None


class FunctionDefinition(OpenAIModel):
    name: str = Field(min_length=1)
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema of the arguments
    strict: bool | None = None


class Tool(OpenAIModel):
    type: Literal["function"]
    function: FunctionDefinition


class FunctionName(OpenAIModel):
    name: str


class NamedToolChoice(OpenAIModel):
    type: Literal["function"]
    function: FunctionName


class _SamplingRequest(OpenAIModel):
    # an argument OpenAI does not know is refused, as OpenAI does
    model_config = ConfigDict(extra="forbid", strict=True)

    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    n: int | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None  # token id (a JSON key: a string) -> bias
    # extensions (vLLM's names)
    prompt_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    repetition_penalty: float | None = None
    min_p: float | None = None
    min_tokens: int | None = None
    ignore_eos: bool | None = False
    stop_token_ids: list[int] | None = None
    skip_special_tokens: bool | None = True
    include_stop_str_in_output: bool | None = False
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = None
    # vLLM's older names of structured outputs
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None

    @model_validator(mode="before")
    @classmethod
    def _reject_unsupported(cls, data: Any) -> Any:
        if isinstance(data, dict):
            data = dict(data)
            for name in list(data):
                if name in _NO_EFFECT:
                    data.pop(name)
                elif name in _UNSUPPORTED:
                    value = data.pop(name)
                    if not any(_same(value, ok) for ok in _UNSUPPORTED[name]):
                        raise ValueError(f"parameter {name!r} is not supported by this "
                                         f"server, got {value!r}")
        return data

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    @property
    def num_logprobs(self) -> int | None:
        """`SamplingParams.logprobs`: how many top log-probabilities per token (None: no
        logprobs at all)."""
        return None

    @property
    def num_prompt_logprobs(self) -> int | None:
        """`SamplingParams.prompt_logprobs` (vLLM's `prompt_logprobs`; not in streams, as
        vLLM)."""
        if self.prompt_logprobs is not None and self.stream:
            raise InvalidSamplingParamsError(
                "prompt_logprobs is not available with stream=true (it comes with the whole "
                "response)")
        return self.prompt_logprobs

    def structured(self) -> StructuredOutputsParams | None:
        """What the output must match, from whichever of response_format,
        structured_outputs and the guided_* fields the request set (at most one of them)."""
        given: list[tuple[str, dict[str, Any]]] = []
        fmt = self.response_format
        if fmt is not None and fmt.type == "json_object":
            given.append(("response_format", {"json_object": True}))
        elif fmt is not None and fmt.type == "json_schema":
            given.append(("response_format", {"json": fmt.json_schema.json_schema}))
        if self.structured_outputs is not None:
            so = self.structured_outputs.model_dump(exclude_none=True)
            given.append(("structured_outputs", {k.rstrip("_"): v for k, v in so.items()}))
        for kind in ("json", "regex", "choice", "grammar"):
            value = getattr(self, f"guided_{kind}")
            if value is not None:
                given.append((f"guided_{kind}", {kind: value}))
        if not given:
            return None
        if len(given) > 1:
            raise InvalidSamplingParamsError(
                "give at most one of response_format (json_object, json_schema), "
                f"structured_outputs and guided_*; got {', '.join(n for n, _ in given)}")
        return StructuredOutputsParams(**given[0][1])

    def sampling_params(self, defaults: dict[str, Any] | None = None) -> SamplingParams:
        """Raises `InvalidSamplingParamsError` naming a bad value. A field left unset takes
        its value from ``defaults`` (the model's generation config), else OpenAI's default;
        no max_tokens: None (the server's default, or up to the context length). A stream
        takes delta outputs, a non-streamed request only its final one."""
        defaults = defaults or {}

        def given(name: str, fallback: Any) -> Any:
            value = getattr(self, name)
            return defaults.get(name, fallback) if value is None else value
        if self.n is not None and not 1 <= self.n <= MAX_N:
            raise InvalidSamplingParamsError(f"n must be in [1, {MAX_N}], got {self.n}")
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        bias = {}
        for key, value in (self.logit_bias or {}).items():
            if not (key.isascii() and key.isdigit()):
                raise InvalidSamplingParamsError(
                    f"logit_bias keys must be token ids (non-negative integers), got {key!r}")
            bias[int(key)] = value
        return SamplingParams(
            max_tokens=self.max_tokens,
            temperature=given("temperature", 1.0), top_p=given("top_p", 1.0),
            top_k=given("top_k", -1),
            seed=self.seed, stop=stop, ignore_eos=bool(self.ignore_eos),
            stop_token_ids=self.stop_token_ids or [],
            skip_special_tokens=self.skip_special_tokens is not False,
            include_stop_str_in_output=bool(self.include_stop_str_in_output),
            logprobs=self.num_logprobs, prompt_logprobs=self.num_prompt_logprobs,
            output_kind="delta" if self.stream else "final_only",
            presence_penalty=self.presence_penalty or 0.0,
            frequency_penalty=self.frequency_penalty or 0.0,
            repetition_penalty=given("repetition_penalty", 1.0), min_p=given("min_p", 0.0),
            logit_bias=bias, min_tokens=self.min_tokens or 0,
            structured_outputs=self.structured())


class _ChatFields(OpenAIModel):
    """vLLM's extensions of a chat request: the chat template's (`ChatTemplateOptions`) and
    the image processor's options for its images (`mm_processor_kwargs`: for the Qwen
    models min_pixels / max_pixels)."""

    model_config = ConfigDict(extra="forbid", strict=True)  # as the requests it is part of

    add_generation_prompt: bool | None = True
    continue_final_message: bool | None = False
    chat_template_kwargs: dict[str, Any] | None = None
    mm_processor_kwargs: dict[str, Any] | None = None

    def template_options(self, chat_template: str | None) -> ChatTemplateOptions:
        """These fields with the server's template (None: the model's)."""
        return ChatTemplateOptions(chat_template, self.add_generation_prompt is not False,
                                   bool(self.continue_final_message),
                                   self.chat_template_kwargs or {})


class ChatCompletionRequest(_SamplingRequest, _ChatFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None
    logprobs: bool | None = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    echo: bool | None = False  # vLLM's: an assistant message continued comes back whole

    @property
    def echoed(self) -> str | None:
        """With `echo`, the text the answer continues: the last message's, when it is the
        assistant's (`continue_final_message`), as vLLM's."""
        last = self.messages[-1]
        return last.text if self.echo and last.role == "assistant" else None

    # set by the server: whether it reads "auto" calls (--enable-auto-tool-choice)
    _auto_tool_choice: bool = PrivateAttr(False)
    # and, with --reasoning-parser, whether the answer starts inside the prompt's <think>
    # (None: no thinking read out of it)
    _reasoning: bool | None = PrivateAttr(None)

    @property
    def tool_call_mode(self) -> str | FunctionDefinition | None:
        """How the answer calls tools (`tool_calls.tool_call_mode`)."""
        return tool_call_mode(self.tools, self.tool_choice, self._auto_tool_choice)

    def structured(self) -> StructuredOutputsParams | None:
        mode = self.tool_call_mode
        if mode is None or mode == "auto":  # the model's own format, free
            return super().structured()
        if super().structured() is not None:
            raise InvalidSamplingParamsError(
                "tool calls and response_format / structured outputs cannot be combined")
        return tool_call_schema(mode, self.tools)

    @model_validator(mode="after")
    def _max_tokens(self) -> ChatCompletionRequest:
        if self.max_completion_tokens is not None:
            self.max_tokens = self.max_completion_tokens
        return self

    @property
    def num_logprobs(self) -> int | None:
        if self.top_logprobs and not self.logprobs:  # as OpenAI: a 400, not ignored
            raise InvalidSamplingParamsError(
                f"top_logprobs needs logprobs set to true, got top_logprobs={self.top_logprobs}")
        return (self.top_logprobs or 0) if self.logprobs else None


class CompletionRequest(_SamplingRequest):
    prompt: str | list[int] | list[str] | list[list[int]]
    logprobs: int | None = Field(None, ge=0, le=MAX_COMPLETION_LOGPROBS)
    echo: bool | None = False  # the prompt before the completion (and its logprobs, if asked)
    # extension: the prompt's images encoded by an encoder server (`POST /v1/encode` with
    # this prompt), as it answered: token ids, positions, images with embedding handles
    multi_modal_embeddings: dict[str, Any] | None = None

    @property
    def num_logprobs(self) -> int | None:
        return self.logprobs

    @property
    def num_prompt_logprobs(self) -> int | None:
        """Also what `echo` with `logprobs` needs: the prompt tokens' logprobs."""
        given = super().num_prompt_logprobs
        if not self.echo or self.logprobs is None:
            return given
        return max(self.logprobs, given or 0)

    @property
    def prompts(self) -> list[str | list[int]]:
        """The prompts (a batch: a list of strings or of token-id lists; its choices come
        prompt by prompt, ``n`` each, indexed in that order, as OpenAI's)."""
        p = self.prompt
        return p if isinstance(p, list) and p and not isinstance(p[0], int) else [p]

    @field_validator("prompt")
    @classmethod
    def _not_empty(cls, prompt: Any) -> Any:
        if isinstance(prompt, list) and not prompt:
            raise ValueError("give a prompt (text, token ids, or a list of them)")
        return prompt

    @model_validator(mode="after")
    def _prompts(self) -> CompletionRequest:
        if len(self.prompts) * (self.n or 1) > MAX_PROMPTS:
            raise ValueError(f"prompt: at most {MAX_PROMPTS} choices in all (prompts times "
                             f"n), got {len(self.prompts)} x {self.n or 1}")
        return self


class TokenizeRequest(_ChatFields):
    """vLLM's `POST /tokenize`: a text prompt, or chat messages (rendered by the chat template,
    images expanded to their rows as the engine runs them)."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    tools: list[Tool] | None = None
    return_token_strs: bool | None = False

    @model_validator(mode="after")
    def _one_input(self) -> TokenizeRequest:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give exactly one of prompt and messages")
        return self


class DetokenizeRequest(OpenAIModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    model: str | None = None
    tokens: list[int]
