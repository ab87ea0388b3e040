"""`/openapi.json` of the LLM server: FastAPI's schema plus the request and response bodies
its endpoints parse themselves (msgspec, then the pydantic models of protocol.py)."""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel
from pydantic.json_schema import models_json_schema

from vlmserve.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    ErrorResponse,
    TokenizeRequest,
)
from vlmserve.entrypoints.openai.responses import (
    ChatCompletionChunk,
    ChatCompletionResponse,
    CompletionResponse,
    DetokenizeResponse,
    ModelList,
    TokenizeResponse,
)

_ERROR_STATUSES = {
    400: "Invalid request: not JSON, an unknown argument, a bad value or image, a prompt too long",
    401: "Missing or wrong API key (`--api-key`)",
    404: "Unknown model: this server serves one",
    413: "Request body larger than `--max-request-bytes`",
    503: "The server is shutting down, or its engine core is dead",
}


def openapi_schema(app: FastAPI, model_names: tuple[str, ...]) -> dict[str, Any]:
    """`/openapi.json`: FastAPI's, plus what it cannot see because the endpoints parse their
    bodies themselves (msgspec, then the pydantic models): request bodies and responses."""
    if app.openapi_schema is not None:
        return app.openapi_schema
    schema = get_openapi(title=app.title, version=app.version, description=app.description,
                         routes=app.routes)
    refs, defs = models_json_schema(
        [(ChatCompletionRequest, "validation"), (CompletionRequest, "validation"),
         (ChatCompletionResponse, "serialization"), (CompletionResponse, "serialization"),
         (ChatCompletionChunk, "serialization"), (ModelList, "serialization"),
         (ErrorResponse, "serialization"), (TokenizeRequest, "validation"),
         (DetokenizeRequest, "validation"), (TokenizeResponse, "serialization"),
         (DetokenizeResponse, "serialization")],
        ref_template="#/components/schemas/{model}")
    components = defs.get("$defs", {})
    for req in (ChatCompletionRequest, CompletionRequest, TokenizeRequest,
                DetokenizeRequest):  # any other model: 404
        props = components[refs[req, "validation"]["$ref"].rsplit("/", 1)[1]]["properties"]
        props["model"] = {"anyOf": [{"enum": list(model_names)}, {"type": "null"}],
                          "title": "Model", "default": None}
    schema.setdefault("components", {}).setdefault("schemas", {}).update(components)

    def body(model: type[BaseModel], mode: str = "serialization") -> dict[str, Any]:
        return {"application/json": {"schema": refs[model, mode]}}

    def events(chunk: type[BaseModel]) -> dict[str, Any]:
        """Each server-sent event: `data: CHUNK`, an error, or `data: [DONE]` at the end."""
        return {"text/event-stream": {"schema": {
            "type": "object", "required": ["data"], "properties": {"data": {
                "type": "string", "if": {"const": "[DONE]"}, "else": {
                    "contentMediaType": "application/json", "contentSchema": {
                        "anyOf": [refs[chunk, "serialization"],
                                  refs[ErrorResponse, "serialization"]]}}}}}}}

    errors = {str(status): {"description": text, "content": body(ErrorResponse)}
              for status, text in _ERROR_STATUSES.items()}
    paths = schema["paths"]
    for path, req, resp, chunk in (
            ("/v1/chat/completions", ChatCompletionRequest, ChatCompletionResponse,
             ChatCompletionChunk),
            ("/v1/completions", CompletionRequest, CompletionResponse, CompletionResponse)):
        paths[path]["post"]["requestBody"] = {"required": True,
                                              "content": body(req, "validation")}
        paths[path]["post"]["responses"] = {"200": {
            "description": "The completion; with `stream: true`, server-sent events of chunks "
                           "ending in `data: [DONE]`",
            "content": {**body(resp), **events(chunk)}},
            **errors}
    for path, req, resp, text in (
            ("/tokenize", TokenizeRequest, TokenizeResponse,
             "The prompt's token ids as the engine runs it (images expanded), their count"),
            ("/detokenize", DetokenizeRequest, DetokenizeResponse, "The tokens' text")):
        paths[path]["post"]["requestBody"] = {"required": True,
                                              "content": body(req, "validation")}
        paths[path]["post"]["responses"] = {"200": {"description": text,
                                                    "content": body(resp)}, **errors}
    paths["/v1/models"]["get"]["responses"] = {
        "200": {"description": "The served model", "content": body(ModelList)},
        "401": errors["401"]}
    paths["/health"]["get"]["responses"] = {
        "200": {"description": "Serving", "content": {"application/json": {"schema": {
            "type": "object", "properties": {"status": {"const": "ok"}}}}}},
        "503": errors["503"]}
    paths["/metrics"]["get"]["responses"] = {"200": {
        "description": "Prometheus text format", "content": {"text/plain": {"schema": {
            "type": "string"}}}}}
    app.openapi_schema = schema
    return schema
