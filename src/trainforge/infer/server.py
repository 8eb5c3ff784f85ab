"""``trainforge serve``: an OpenAI-compatible HTTP server over the engine (FastAPI + uvicorn).

Endpoints: ``POST /v1/completions``, ``POST /v1/chat/completions`` (both with
``"stream": true`` as server-sent events ending ``data: [DONE]``), ``GET /v1/models``,
``GET /health``, ``GET /metrics`` (Prometheus text: the monitoring ``Registry``, fed engine
records and exposed through ``prometheus_client``, so metric names, types and help come
from ``monitor/catalog.py`` and appear in ``docs/metrics.md``). Binds 127.0.0.1 unless
told otherwise; with an API key every endpoint but ``/health`` wants ``Authorization:
Bearer KEY``. Needs the ``infer`` extra (fastapi, uvicorn).

The engine steps in its own thread; handlers only submit requests and await the tokens it
hands back (``Request.on_update`` -> ``loop.call_soon_threadsafe``), so the event loop
stays free and ``/health`` answers under load. Errors use OpenAI's envelope
``{"error": {"message", "type", "param", "code"}}``:

- 400 malformed JSON, bad or unsupported parameters, prompt + max_tokens beyond the context
  (code ``context_length_exceeded``); 401 bad or missing key; 404 unknown model or path;
- 413 body larger than ``max_body_bytes`` (refused from Content-Length before reading);
- 429 at the concurrency limit: exactly ``max_concurrent`` requests are admitted (running +
  waiting in the engine + admitted here but still being read), the next is refused before
  its body is read. ``max_concurrent`` may not exceed the engine's own bound
  (``max_batch_size + max_queue``), so the engine's ``QueueFull`` is a backstop only.

A client that disconnects (mid-stream, or while waiting for a non-streamed answer) has its
request aborted; the engine frees its batch row and KV blocks at the next step. The
non-streamed wait watches the connection by awaiting the ASGI ``http.disconnect`` message
(no polling); streamed responses get it from Starlette's disconnect listener. Chat messages are
rendered with a plain template (``role: content`` lines, then ``assistant:``): trainforge
models are not chat-tuned and no Jinja chat template is read.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import time
import uuid
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Callable

from starlette.requests import ClientDisconnect
from starlette.requests import Request as HTTPRequest  # at module level: FastAPI resolves annotations here

from trainforge.errors import ConfigError
from trainforge.infer.engine import Engine, QueueFull, RequestTooLong
from trainforge.infer.request import Request
from trainforge.infer.sampling import SamplingParams


@dataclass
class ServerConfig:
    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None  # None = no authentication
    model_name: str = "trainforge"
    max_body_bytes: int = 1 << 20
    max_concurrent: int = 0  # requests admitted at once (running + waiting); 0 = max_batch_size + max_queue
    default_max_tokens: int = 16  # /v1/completions without max_tokens (OpenAI's default)


class APIError(Exception):
    def __init__(self, status: int, message: str, type_: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


class _Admission:
    """The concurrency limit. A request counts from the moment it is admitted: the engine
    counts it once submitted (``Engine.load``), this counts it in between, while its body is
    read and parsed (awaits, during which other requests are checked). Event-loop only."""

    def __init__(self, engine: Engine, limit: int):
        self.engine, self.limit, self.reading = engine, limit, 0

    def load(self) -> int:
        return self.engine.load() + self.reading

    @contextmanager
    def hold(self):
        """Admit one request or raise 429; yields a release function that the handler calls
        once the engine holds the request (and that runs on exit otherwise)."""
        load = self.load()
        if load >= self.limit:
            raise APIError(429, f"server busy: {load} requests running or waiting (limit {self.limit}); retry later",
                           "rate_limit_error", code="rate_limit_exceeded")
        self.reading += 1
        held = [True]

        def release() -> None:
            if held[0]:
                held[0] = False
                self.reading -= 1

        try:
            yield release
        finally:
            release()


async def _disconnected(request: HTTPRequest) -> None:
    """Return when the client goes away. Once the body is read, the server's ``receive``
    blocks until ``http.disconnect`` (or the response is complete), so this costs one
    suspended task, not a polling loop."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


# -- request parsing -------------------------------------------------------------------------

def _field(body: dict, key: str, types: tuple, default: Any, ok=None, want: str = "") -> Any:
    value = body.get(key, default)
    if value is None:
        return default
    if isinstance(value, bool) and bool not in types or not isinstance(value, types) or (ok and not ok(value)):
        raise APIError(400, f"'{key}' must be {want}, got {value!r}", param=key)
    return value


def sampling_params(body: dict, default_max_tokens: int) -> SamplingParams:
    """OpenAI request fields -> ``SamplingParams`` (``top_k``, ``repetition_penalty`` and
    ``ignore_eos`` are extensions, spelled as vLLM spells them)."""
    num = (int, float)
    if _field(body, "n", (int,), 1) != 1:
        raise APIError(400, "'n' must be 1: send one request per completion", param="n")
    for key in ("logprobs", "top_logprobs", "echo"):
        if body.get(key):
            raise APIError(400, f"'{key}' is not supported by this server", param=key)
    if body.get("best_of") not in (None, 1):
        raise APIError(400, "'best_of' is not supported by this server", param="best_of")
    for key in ("presence_penalty", "frequency_penalty"):
        if _field(body, key, num, 0) != 0:
            raise APIError(400, f"'{key}' is not supported (use 'repetition_penalty')", param=key)
    max_tokens = body.get("max_completion_tokens", body.get("max_tokens", default_max_tokens))
    max_tokens = _field({"max_tokens": max_tokens}, "max_tokens", (int,), default_max_tokens, lambda v: v >= 1,
                        "an integer >= 1")
    stop = body.get("stop")
    if isinstance(stop, str):
        stop = [stop]
    if stop is not None and (not isinstance(stop, list) or len(stop) > 4
                             or not all(isinstance(s, str) and s for s in stop)):
        raise APIError(400, "'stop' must be a non-empty string or a list of at most 4", param="stop")
    return SamplingParams(
        max_new_tokens=max_tokens,
        temperature=float(_field(body, "temperature", num, 1.0, lambda v: 0 <= v <= 2, "a number in [0, 2]")),
        top_p=float(_field(body, "top_p", num, 1.0, lambda v: 0 < v <= 1, "a number in (0, 1]")),
        top_k=_field(body, "top_k", (int,), 0, lambda v: v >= 0, "an integer >= 0"),
        repetition_penalty=float(_field(body, "repetition_penalty", num, 1.0, lambda v: v > 0, "a number > 0")),
        stop=tuple(stop or ()),
        ignore_eos=_field(body, "ignore_eos", (bool,), False),
        seed=_field(body, "seed", (int,), None),
    )


def chat_prompt(messages: Any) -> str:
    """OpenAI chat messages -> one prompt string (``role: content`` lines, then ``assistant:``)."""
    if not isinstance(messages, list) or not messages:
        raise APIError(400, "'messages' must be a non-empty list", param="messages")
    lines = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise APIError(400, f"messages[{i}] must be an object with a 'role'", param="messages")
        content = m.get("content")
        if isinstance(content, list):  # content parts: keep the text ones
            content = "".join(p.get("text", "") for p in content if isinstance(p, dict) and p.get("type") == "text")
        if not isinstance(content, str):
            raise APIError(400, f"messages[{i}].content must be a string", param="messages")
        lines.append(f"{m['role']}: {content}\n")
    return "".join(lines) + "assistant:"


# -- the app ---------------------------------------------------------------------------------

def create_app(engine: Engine, tokenizer, config: ServerConfig | None = None):
    """The FastAPI app. The caller runs ``engine.start()`` (``serve`` does)."""
    from fastapi import FastAPI
    from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
    from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
    from starlette.exceptions import HTTPException

    from trainforge.monitor.registry import Registry
    from trainforge.monitor.sinks import RegistryCollector

    config = config or ServerConfig()
    if tokenizer is None:
        raise ValueError("the server needs a tokenizer (the checkpoint has no tokenizer.json)")
    engine_cap = engine.config.max_batch_size + engine.config.max_queue
    if not 0 <= config.max_concurrent <= engine_cap:
        raise ConfigError(f"max_concurrent={config.max_concurrent}: must be in [0, max_batch_size + max_queue = "
                          f"{engine_cap}]; raise --max_queue or lower --max_concurrent")
    admission = _Admission(engine, config.max_concurrent or engine_cap)
    metrics_registry = Registry(rank=0)
    exposition = CollectorRegistry(auto_describe=False)
    exposition.register(RegistryCollector(metrics_registry))

    app = FastAPI(title="trainforge", docs_url=None, redoc_url=None, openapi_url=None)
    app.add_middleware(_Gate, api_key=config.api_key, registry=metrics_registry)

    @app.exception_handler(APIError)
    async def _api_error(_, e: APIError):
        return JSONResponse(e.body(), status_code=e.status)

    @app.exception_handler(HTTPException)
    async def _http_error(_, e: HTTPException):
        return JSONResponse(APIError(e.status_code, str(e.detail), "invalid_request_error").body(),
                            status_code=e.status_code)

    @app.exception_handler(Exception)
    async def _internal(_, e: Exception):
        return JSONResponse(APIError(500, f"internal error: {type(e).__name__}: {e}", "server_error").body(),
                            status_code=500)

    @app.get("/health")
    async def health():
        return {"status": "ok", "running": len(engine._rows), "waiting": len(engine._waiting)}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": config.model_name, "object": "model", "created": 0,
                                            "owned_by": "trainforge", "max_model_len": engine.max_context}]}

    @app.get("/metrics")
    async def metrics():
        metrics_registry.ingest(engine_record(engine))
        return PlainTextResponse(generate_latest(exposition), media_type=CONTENT_TYPE_LATEST)

    async def read_body(request: HTTPRequest) -> dict:
        length = request.headers.get("content-length")
        if length is not None and length.isdigit() and int(length) > config.max_body_bytes:
            raise APIError(413, f"request body of {length} bytes exceeds the limit of {config.max_body_bytes}",
                           code="request_too_large")
        body = bytearray()
        try:
            async for chunk in request.stream():
                body += chunk
                if len(body) > config.max_body_bytes:
                    raise APIError(413, f"request body exceeds the limit of {config.max_body_bytes} bytes",
                                   code="request_too_large")
        except ClientDisconnect:  # gone before its body arrived: nothing to answer, not a server error
            raise APIError(499, "client disconnected while sending the body") from None
        try:
            data = json.loads(body)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise APIError(400, f"request body is not valid JSON: {e}") from None
        if not isinstance(data, dict):
            raise APIError(400, "request body must be a JSON object")
        model = data.get("model")
        if model is not None and model != config.model_name:
            raise APIError(404, f"model {model!r} does not exist; this server serves {config.model_name!r}",
                           param="model", code="model_not_found")
        return data

    def encode_prompt(prompt: Any) -> list[int]:
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]
        if isinstance(prompt, str):
            return tokenizer.encode(prompt).ids
        if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            return prompt
        raise APIError(400, "'prompt' must be a string, a list of token ids, or a one-element list of either",
                       param="prompt")

    async def run(request: HTTPRequest, ids: list[int], params: SamplingParams, chat: bool, stream: bool,
                  admitted: Callable[[], None]):
        """Submit, then answer: a JSON body, or an SSE stream. ``admitted()`` once the engine
        holds the request (from then on ``Engine.load`` counts it)."""
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue = asyncio.Queue()  # streamed: (text, finished) per engine update
        finished_event = asyncio.Event()  # not streamed: set once, when the request ends

        def on_update(req: Request, new_ids: list[int], text: str, finished: bool) -> None:
            if stream:
                loop.call_soon_threadsafe(queue.put_nowait, (text, finished))
            elif finished:
                loop.call_soon_threadsafe(finished_event.set)

        try:
            req = engine.submit(ids, params, on_update)
        except RequestTooLong as e:
            raise APIError(400, str(e), param="max_tokens", code="context_length_exceeded") from None
        except QueueFull as e:
            raise APIError(429, f"server busy: {e}", "rate_limit_error", code="rate_limit_exceeded") from None
        except ValueError as e:
            raise APIError(400, str(e)) from None
        finally:
            admitted()  # the engine counts it now (or it was refused)
        rid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex[:24]}"
        created = int(time.time())
        obj = "chat.completion" if chat else "text_completion"

        def usage() -> dict:
            n = len(req.output_ids)
            return {"prompt_tokens": len(ids), "completion_tokens": n, "total_tokens": len(ids) + n}

        def observe() -> None:
            metrics_registry.ingest({"ttft_s": req.ttft_s,
                                     "request_s": None if req.finished_s is None else req.finished_s - req.created_s})

        if not stream:
            # Wait for the end or the client leaving, whichever comes first. (Waiting on the
            # token updates with a timeout and checking the connection on timeout never
            # checked it while tokens kept coming, so a gone client's request ran to the end.)
            finished = asyncio.ensure_future(finished_event.wait())
            gone = asyncio.ensure_future(_disconnected(request))
            try:
                await asyncio.wait((finished, gone), return_when=asyncio.FIRST_COMPLETED)
                if not finished.done():
                    raise APIError(499, "client disconnected")
            finally:  # also when this handler is cancelled (server shutdown)
                finished.cancel()
                gone.cancel()
                if not req.done.is_set():
                    engine.abort(req)
            observe()
            choice = {"index": 0, "finish_reason": req.finish_reason, "logprobs": None}
            if chat:
                choice["message"] = {"role": "assistant", "content": req.text}
            else:
                choice["text"] = req.text
            return {"id": rid, "object": obj, "created": created, "model": config.model_name,
                    "choices": [choice], "usage": usage()}

        def chunk(text: str | None, finish: str | None, first: bool = False) -> str:
            if chat:
                delta = {"role": "assistant", "content": ""} if first else ({"content": text} if text else {})
                choice = {"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None}
            else:
                choice = {"index": 0, "text": text or "", "finish_reason": finish, "logprobs": None}
            body = {"id": rid, "object": obj + ".chunk" if chat else obj, "created": created,
                    "model": config.model_name, "choices": [choice]}
            return f"data: {json.dumps(body)}\n\n"

        async def events():
            try:
                if chat:
                    yield chunk(None, None, first=True)
                while True:
                    text, finished = await queue.get()
                    if text:
                        yield chunk(text, None)
                    if finished:
                        observe()
                        yield chunk(None, req.finish_reason)
                        yield "data: [DONE]\n\n"
                        return
            finally:  # also runs when the client goes away and the response task is cancelled
                if not req.done.is_set():
                    engine.abort(req)

        return StreamingResponse(events(), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    @app.post("/v1/completions")
    async def completions(request: HTTPRequest):
        with admission.hold() as admitted:  # before reading anything: the cheapest refusal
            data = await read_body(request)
            if "prompt" not in data:
                raise APIError(400, "'prompt' is required", param="prompt")
            ids = encode_prompt(data["prompt"])
            params = sampling_params(data, config.default_max_tokens)
            return await run(request, ids, params, chat=False, stream=bool(data.get("stream", False)),
                             admitted=admitted)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: HTTPRequest):
        with admission.hold() as admitted:
            data = await read_body(request)
            ids = tokenizer.encode(chat_prompt(data.get("messages"))).ids
            default = max(1, min(256, engine.max_context - len(ids)))
            params = sampling_params(data, default)
            return await run(request, ids, params, chat=True, stream=bool(data.get("stream", False)),
                             admitted=admitted)

    return app


class _Gate:
    """ASGI middleware: API-key check (all paths but /health) and request counting by status.
    Pure ASGI, not ``BaseHTTPMiddleware``, so streamed responses and disconnects pass through."""

    KNOWN = ("/health", "/metrics", "/v1/models", "/v1/completions", "/v1/chat/completions")

    def __init__(self, app, api_key: str | None, registry):
        self.app, self.api_key, self.registry = app, api_key, registry
        self.counts: dict[tuple[str, int], int] = {}

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path = scope["path"]
        status = [500]

        async def counting_send(message):
            if message["type"] == "http.response.start":
                status[0] = message["status"]
            await send(message)

        try:
            if self.api_key and path != "/health":
                auth = dict(scope["headers"]).get(b"authorization", b"").decode("latin-1")
                if not hmac.compare_digest(auth.encode(), f"Bearer {self.api_key}".encode()):
                    body = json.dumps(APIError(401, "missing or wrong API key (Authorization: Bearer KEY)",
                                               code="invalid_api_key").body()).encode()
                    await counting_send({"type": "http.response.start", "status": 401,
                                         "headers": [(b"content-type", b"application/json"),
                                                     (b"content-length", str(len(body)).encode())]})
                    await send({"type": "http.response.body", "body": body})
                    return
            await self.app(scope, receive, counting_send)
        finally:
            key = (path if path in self.KNOWN else "other", status[0])
            self.counts[key] = n = self.counts.get(key, 0) + 1  # one event loop: no lock needed
            self.registry.ingest({f"http_requests {key[0]} {key[1]}": n})


SPEC_KEYS = ("spec_drafted_tokens", "spec_accepted_tokens", "spec_acceptance_rate", "spec_mean_accepted_length")


def engine_record(engine: Engine) -> dict[str, Any]:
    """The engine's state as a metrics record (keys in ``monitor/catalog.py``), read at scrape time."""
    s = engine.stats()
    pool = s["kv_pool"]
    return {"infer_running": s["running"], "infer_waiting": s["waiting"], "kv_blocks_used": pool["blocks_used"],
            "kv_blocks_reserved": pool["blocks_reserved"], "kv_blocks_capacity": pool["blocks_total"],
            "kv_block_utilisation": pool["block_utilisation"], "kv_slot_utilisation": pool["slot_utilisation"],
            "infer_prompt_tokens": s["prompt_tokens"], "infer_generated_tokens": s["generated_tokens"],
            "infer_decode_steps": s["decode_steps"], "infer_rejected": s["rejected"],
            "infer_finished": {r: s[f"finished_{r}"] for r in ("stop", "length", "abort")},
            **{k: v for k, v in s.items() if k in SPEC_KEYS}}


def serve(engine: Engine, tokenizer, config: ServerConfig) -> None:
    """Run the server until interrupted (uvicorn handles SIGINT/SIGTERM)."""
    import uvicorn

    app = create_app(engine, tokenizer, config)
    engine.start()
    try:
        uvicorn.run(app, host=config.host, port=config.port, log_level="info", timeout_graceful_shutdown=5)
    finally:
        engine.stop()
