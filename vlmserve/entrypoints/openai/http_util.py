"""HTTP plumbing both servers share (the LLM server and `serve --role encoder`): bearer-key
check, bounded request bodies, and errors in OpenAI's format for every failure."""

from __future__ import annotations

import asyncio
import logging
import secrets
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from vlmserve.entrypoints.args import ServerConfig
from vlmserve.entrypoints.openai.protocol import ErrorInfo, ErrorResponse

logger = logging.getLogger(__name__)


_NO_KEY = "invalid or missing API key: send `Authorization: Bearer KEY`"
# what --api-key guards besides the endpoints that check it themselves: the server's
# internals (process ids, cache counters) and its schema; /health, /ping, /version and
# /metrics stay open for probes and scrapers, as vLLM's
KEYED_PATHS = frozenset({"/stats", "/docs", "/docs/oauth2-redirect", "/redoc",
                         "/openapi.json"})


def _key_ok(given: str, api_key: str) -> bool:
    return secrets.compare_digest(given.encode(), f"Bearer {api_key}".encode())


def check_bearer(request: Request, api_key: str | None) -> None:
    """A 401 unless the request carries `Authorization: Bearer <api_key>` (if a key is set)."""
    if api_key is None:
        return
    if not _key_ok(request.headers.get("authorization", ""), api_key):
        raise ApiError(401, _NO_KEY, code="invalid_api_key")


def require_key(app: FastAPI, api_key: str | None, paths: frozenset[str] = KEYED_PATHS
                ) -> None:
    """With a key, requests to ``paths`` need it (a 401 in OpenAI's format otherwise):
    FastAPI's own /docs and /openapi.json included. A plain ASGI check of the path, so no
    other request (a stream) pays for it."""
    if api_key is None:
        return

    class KeyedPaths:
        def __init__(self, inner: Any) -> None:
            self.inner = inner

        async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
            if scope["type"] == "http" and scope["path"] in paths:
                given = dict(scope["headers"]).get(b"authorization", b"")
                if not _key_ok(given.decode("latin-1"), api_key):
                    await error_response(401, _NO_KEY, code="invalid_api_key")(
                        scope, receive, send)
                    return
            await self.inner(scope, receive, send)

    app.add_middleware(KeyedPaths)


async def read_body(request: Request, cfg: ServerConfig) -> bytearray:
    """The request's body, at most `--max-request-bytes` (a 413 beyond), arriving within
    `--request-body-timeout` (a 408 after)."""
    limit = cfg.max_request_bytes
    too_large = ApiError(413, f"request body exceeds the limit of {limit} bytes",
                         code="request_too_large")
    size = request.headers.get("content-length", "")
    if size.isdigit() and int(size) > limit:
        raise too_large
    body = bytearray()

    async def read() -> None:
        async for chunk in request.stream():
            body.extend(chunk)
            if len(body) > limit:
                raise too_large

    timeout = cfg.request_body_timeout
    try:
        await asyncio.wait_for(read(), timeout)
    except TimeoutError:
        raise ApiError(408, f"the request body did not arrive within {timeout:g} s "
                            "(--request-body-timeout)", code="request_timeout") from None
    return body


class ApiError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None,
                 code: str | None = None, type: str = "invalid_request_error") -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.type = (
            status, message, param, code, type)


def error_response(status: int, message: str, param: str | None = None,
                   code: str | None = None, type: str = "invalid_request_error") -> JSONResponse:
    body = ErrorResponse(error=ErrorInfo(message=message, type=type, param=param, code=code))
    return JSONResponse(body.model_dump(), status_code=status)


def validation_message(errors: list[Any]) -> tuple[str, str | None]:
    parts, param = [], None
    for e in errors[:3]:
        loc = ".".join(str(x) for x in e.get("loc", ()) if x != "body")
        msg = str(e.get("msg", "invalid value")).removeprefix("Value error, ")
        if e.get("type") == "extra_forbidden":
            msg = "unrecognized request argument"
        parts.append(f"{loc}: {msg}" if loc else msg)
        param = param or loc or None
    return "; ".join(parts), param


def install_error_handlers(app: FastAPI) -> None:
    """Every error as an OpenAI-format body: `ApiError`s with their status, invalid bodies
    and parameters a 400 naming the field, Starlette's own (404, 405 with `Allow`), and
    anything unexpected a 500 that names only the exception's type (logged here)."""

    @app.exception_handler(ApiError)
    async def _api_error(_: Request, e: ApiError) -> JSONResponse:
        return error_response(e.status, e.message, e.param, e.code, e.type)

    @app.exception_handler(ValidationError)
    @app.exception_handler(RequestValidationError)
    async def _validation(_: Request, e: ValidationError | RequestValidationError) -> JSONResponse:
        message, param = validation_message(list(e.errors()))
        return error_response(400, message, param)

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, e: StarletteHTTPException) -> JSONResponse:
        response = error_response(e.status_code, str(e.detail))
        response.headers.update(e.headers or {})  # a 405's `Allow`
        return response

    @app.exception_handler(Exception)
    async def _internal(_: Request, e: Exception) -> JSONResponse:
        logger.error("internal error: %r", e)
        return error_response(500, f"internal server error: {type(e).__name__}",
                              type="server_error")
