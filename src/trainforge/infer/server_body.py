"""How a POST body reaches a handler of ``trainforge serve``, and how every refusal is put
in OpenAI's envelope ``{"error": {"message", "type", "param", "code"}}``.

``body_route(precheck)`` is the ``route_class`` of the POST routers. Before FastAPI parses
and validates the body against the endpoint's pydantic model, its handler

1. runs ``precheck`` (429 at once when the server, or the tokenizer pool, is full: the
   cheapest refusal, before a byte of the body is read);
2. reads the body itself: 413 beyond ``max_body_bytes`` (from Content-Length before
   reading, else while reading), 408 when it has not all arrived ``read_timeout_s`` after
   the headers (``Connection: close``); FastAPI's own read has neither bound;
3. refuses JSON nested deeper than ``server_limits.MAX_JSON_DEPTH`` (400), JSON that does
   not parse or is not an object (400), and a ``model`` other than the served one (404);
4. hands FastAPI the parsed body (``Request._body`` / ``_json``, Starlette's caches) with
   ``Content-Type: application/json``: the body is JSON whatever its Content-Type says, as
   before (``curl -d`` sends ``application/x-www-form-urlencoded``).

``install_error_handlers`` maps ``APIError``, Starlette's ``HTTPException`` (404 unknown
path, 405), any other exception (500), and FastAPI's ``RequestValidationError`` (a body
that fails its pydantic model: FastAPI's default is a 422 in its own format) to the
envelope: a 400 whose ``param`` and message name the field.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any, Callable

from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from fastapi.routing import APIRoute
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect
from starlette.requests import Request as HTTPRequest

from trainforge.infer.openai_schema import APIError
from trainforge.infer.server_limits import json_depth_error
from trainforge.infer.server_protocol import INVALID, RULE
from trainforge.infer.server_state import ServerState, state_of


async def read_json(request: HTTPRequest, state: ServerState) -> tuple[bytes, dict]:
    """The body, within the size and time limits, parsed: a JSON object naming no other model."""
    config = state.config
    length = request.headers.get("content-length")
    if length is not None and length.isdigit() and int(length) > config.max_body_bytes:
        raise APIError(413, f"request body of {length} bytes exceeds the limit of {config.max_body_bytes}",
                       code="request_too_large")
    body = bytearray()
    try:
        async with asyncio.timeout(config.read_timeout_s):  # a client trickling its body holds nothing for long
            async for chunk in request.stream():
                body += chunk
                if len(body) > config.max_body_bytes:
                    raise APIError(413, f"request body exceeds the limit of {config.max_body_bytes} bytes",
                                   code="request_too_large")
    except ClientDisconnect:  # gone before its body arrived: nothing to answer, not a server error
        raise APIError(499, "client disconnected while sending the body") from None
    except TimeoutError:
        raise APIError(408, f"request body not received within {config.read_timeout_s:g} s (the server's "
                       "--read_timeout_s)", code="request_timeout", headers={"Connection": "close"}) from None
    raw = bytes(body)
    too_deep = json_depth_error(raw)
    if too_deep:
        raise APIError(400, too_deep)
    try:
        data = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise APIError(400, f"request body is not valid JSON: {e}") from None
    except RecursionError:  # a backstop: the depth check above comes first
        raise APIError(400, "request body nests too deeply") from None
    if not isinstance(data, dict):
        raise APIError(400, "request body must be a JSON object")
    model = data.get("model")
    if model is not None and model != config.model_name:
        shown = repr(model) if isinstance(model, str) and len(model) <= 100 else "(not a short string)"
        raise APIError(404, f"model {shown} does not exist; this server serves {config.model_name!r}",
                       param="model", code="model_not_found")
    return raw, data


def _as_json(request: HTTPRequest, raw: bytes, data: dict) -> HTTPRequest:
    """``request`` with its body already read and parsed, declared JSON (module docstring, 4.).
    The scope is copied, not rebuilt: ``scope["state"]`` (the access log's token counts)
    stays the same dict."""
    headers = [(k, v) for k, v in request.scope["headers"] if k != b"content-type"]
    parsed = HTTPRequest({**request.scope, "headers": [*headers, (b"content-type", b"application/json")]},
                         request.receive)
    parsed._body, parsed._json = raw, data  # Starlette's caches: FastAPI's body() / json() read these
    return parsed


def body_route(precheck: Callable[[ServerState], None]) -> type[APIRoute]:
    """An ``APIRoute`` class whose handler does steps 1-4 of the module docstring, then
    FastAPI's (validation against the endpoint's model, the endpoint, the response)."""

    class LimitedBodyRoute(APIRoute):
        def get_route_handler(self) -> Callable:
            validate_and_run = super().get_route_handler()

            async def handler(request: HTTPRequest):
                state = state_of(request)
                precheck(state)
                raw, data = await read_json(request, state)
                return await validate_and_run(_as_json(request, raw, data))

            return handler

    return LimitedBodyRoute


def _path(loc: tuple) -> str:
    """("messages", 0, "role") -> "messages[0].role"."""
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out


def validation_error(errors: list[dict[str, Any]]) -> APIError:
    """The first error of a body that failed its pydantic model, as a 400 naming the field:
    ``param`` is the field (for one inside a list, the list: ``messages``; inside an object,
    its own name: ``include_usage``), the message its path and what it must be."""
    e = errors[0]
    loc = tuple(p for p in e.get("loc", ()) if p != "body")
    ctx = e.get("ctx") or {}
    if e.get("type") == RULE:  # a rule between fields: the message names them
        return APIError(400, e["msg"], param=ctx.get("param"))
    if not loc:
        return APIError(400, f"request body: {e.get('msg')}")
    path = _path(loc)
    param = str(loc[0]) if any(isinstance(p, int) for p in loc) else str(loc[-1])
    if e.get("type") == "missing":
        message = f"'{path}' is required"
    elif e.get("type") == INVALID:
        message = f"'{path}' {e['msg']}"
    else:  # pydantic's own wording
        message = f"'{path}': {e.get('msg')}"
    more = len(errors) - 1
    return APIError(400, message + (f" (and {more} more error{'s' * (more > 1)})" if more else ""), param=param)


def install_error_handlers(app) -> None:
    @app.exception_handler(APIError)
    async def _api_error(_, e: APIError):
        return JSONResponse(e.body(), status_code=e.status, headers=e.headers)

    @app.exception_handler(RequestValidationError)
    async def _invalid_body(_, e: RequestValidationError):
        error = validation_error(list(e.errors()))
        return JSONResponse(error.body(), status_code=error.status)

    @app.exception_handler(HTTPException)
    async def _http_error(_, e: HTTPException):
        return JSONResponse(APIError(e.status_code, str(e.detail), "invalid_request_error").body(),
                            status_code=e.status_code)

    @app.exception_handler(Exception)
    async def _internal(_, e: Exception):
        return JSONResponse(APIError(500, f"internal error: {type(e).__name__}: {e}", "server_error").body(),
                            status_code=500)
