"""Response bodies and stream chunks of the OpenAI API (the subset we serve), vLLM's
extensions among them (`prompt_logprobs`, tokenize / detokenize)."""

from __future__ import annotations

import time
from typing import Any, Literal

from pydantic import BaseModel, Field

from vlmserve.entrypoints.openai.tool_calls import ToolCall


class UsageInfo(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int

    @classmethod
    def of(cls, prompt_tokens: int, completion_tokens: int) -> UsageInfo:
        return cls(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                   total_tokens=prompt_tokens + completion_tokens)


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None
    tool_calls: list[ToolCall] | None = None
    # a reasoning model's thinking (--reasoning-parser): vLLM's field, and its older name
    reasoning: str | None = None
    reasoning_content: str | None = None


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]  # the `top_logprobs` most likely, most likely first


class ChatLogprobs(BaseModel):
    """A chat choice's (or chunk's) log-probabilities, one entry per token."""

    content: list[ChatTokenLogprob] | None = None
    refusal: list[ChatTokenLogprob] | None = None


class CompletionLogprobs(BaseModel):
    """/v1/completions' (legacy) log-probabilities: parallel lists, one entry per token;
    `top_logprobs` maps token text to logprob (the `logprobs` most likely and the sampled
    token); `text_offset` is where each token's text starts in the completion's text."""

    tokens: list[str] = Field(default_factory=list)
    # None for an echoed prompt's first token (nothing predicts it)
    token_logprobs: list[float | None] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)


class ChatChoice(BaseModel):
    index: int = 0
    message: AssistantMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None


# vLLM's `prompt_logprobs` in a response: per prompt token None (the first) or {token id:
# {"logprob", "rank", "decoded_token"}}, the `prompt_logprobs` most likely and the prompt's own
PromptLogprobs = list[dict[str, dict[str, Any]] | None]


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChoice]
    usage: UsageInfo
    prompt_logprobs: PromptLogprobs | None = None


class DeltaMessage(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None
    tool_calls: list[dict[str, Any]] | None = None  # {index, id, type, function: {...}}
    reasoning: str | None = None
    reasoning_content: str | None = None


class ChatChunkChoice(BaseModel):
    index: int = 0
    delta: DeltaMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: UsageInfo | None = None


class CompletionChoice(BaseModel):
    index: int = 0
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    prompt_logprobs: PromptLogprobs | None = None


class CompletionResponse(BaseModel):
    """Also the stream chunk of /v1/completions (OpenAI uses the same object there)."""

    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "vlmserve"
    max_model_len: int | None = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeResponse(BaseModel):
    prompt: str
