"""``trainforge serve``: an OpenAI-compatible HTTP server over the engine (FastAPI + uvicorn).

Endpoints: ``POST /v1/completions``, ``POST /v1/chat/completions`` (both with
``"stream": true`` as server-sent events ending ``data: [DONE]``; ``n`` choices, each its
own engine request; ``logprobs``; ``stream_options.include_usage``: see
``openai_schema.py``), ``POST /tokenize`` and ``POST /detokenize`` (vLLM's shapes),
``GET /v1/models``, ``GET /health``, ``GET /metrics`` (Prometheus text: the monitoring ``Registry``, fed engine
records and exposed through ``prometheus_client``, so metric names, types and help come
from ``monitor/catalog.py`` and appear in ``docs/metrics.md``). Binds 127.0.0.1 unless
told otherwise; with an API key every endpoint but ``/health`` wants ``Authorization:
Bearer KEY``. Needs the ``infer`` extra (fastapi, uvicorn). ``server_extras.py`` has the
port binding (before the model loads), the startup banner and the access log.

The engine steps in its own thread; handlers only submit requests and await the tokens it
hands back (``Request.on_update`` -> ``loop.call_soon_threadsafe``), so the event loop
stays free and ``/health`` answers under load. Errors use OpenAI's envelope
``{"error": {"message", "type", "param", "code"}}``:

- 400 malformed JSON, bad or unsupported parameters (``n`` outside [1, max_batch_size +
  max_queue], ``top_logprobs`` / ``logprobs`` above 20, logprobs with speculative decoding,
  ``stream_options`` without ``stream``: ``param`` names the field), prompt + max_tokens
  beyond the context (code ``context_length_exceeded``); 401 bad or missing key; 404
  unknown model or path;
- 408 body not received within ``read_timeout_s`` of its headers (then the connection
  closes; headers that take longer close the connection without an answer: ``server_limits.py``);
- 413 body larger than ``max_body_bytes`` (refused from Content-Length before reading);
- 400 body nested deeper than ``server_limits.MAX_JSON_DEPTH``;
- 429 at the concurrency limit (a request with ``n`` choices counts n times): exactly
  ``max_concurrent`` requests are admitted (running + waiting in the engine + admitted
  here and being tokenised). A request counts once its whole body has arrived and its fields
  are valid (a bad field is a 400 first, whatever the load), so clients that send slowly hold
  no place; a server already full refuses before reading the body. ``max_concurrent`` may not
  exceed the engine's own bound (``max_batch_size + max_queue``), so the engine's ``QueueFull``
  is a backstop only. ``/tokenize`` and ``/detokenize`` have their own limit,
  ``max_tokenize_concurrent`` (``server_limits.TokenizerPool``);
- 500 (``code: "generation_error"``) when the engine failed the request itself (its sampler
  setup or detokenisation raised; ``Request.error``): only that request fails, the others
  go on. A streamed request that fails after its response began gets an ``{"error": ...}``
  event, then ``data: [DONE]``.

Tokenizer work never runs on the event loop (prompts on its default executor, ``/tokenize``
and ``/detokenize`` on their own threads); text longer than the context times the longest
token's characters is a 400 (``context_length_exceeded``) before it is tokenised; a tokenizer
that fails on one text (a tokenizer.json regex that hits Oniguruma's retry limit panics)
fails that request with a 400.

A client that disconnects (mid-stream, or while waiting for a non-streamed answer) has its
request aborted; the engine frees its batch row and KV blocks at the next step. The
non-streamed wait watches the connection by awaiting the ASGI ``http.disconnect`` message
(no polling); streamed responses get it from Starlette's disconnect listener. Chat messages are
rendered with a plain template (``role: content`` lines, then ``assistant:``): trainforge
models are not chat-tuned and no Jinja chat template is read.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import socket
import time
import uuid
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Callable

from starlette.requests import ClientDisconnect
from starlette.requests import Request as HTTPRequest  # at module level: FastAPI resolves annotations here

from trainforge.errors import ConfigError
from trainforge.infer.engine import Engine, QueueFull, RequestTooLong
from trainforge.infer.openai_schema import (APIError, Choices, TextOffsets, TokenText, chat_logprobs, chat_prompt,
                                            choices_of, completion_logprobs, sampling_params)
from trainforge.infer.request import Request
from trainforge.infer.sampling import SamplingParams
from trainforge.infer.listen import bind_socket
from trainforge.infer.server_extras import Gate, banner, engine_record
from trainforge.infer.server_limits import (TokenizerFailed, TokenizerPool, header_deadline_protocol,
                                            json_depth_error, text_limit, tokenizer_call)

__all__ = ["APIError", "ServerConfig", "chat_prompt", "create_app", "engine_record", "sampling_params", "serve",
           "uvicorn_config"]


@dataclass
class ServerConfig:
    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None  # None = no authentication
    model_name: str = "trainforge"
    max_body_bytes: int = 1 << 20
    max_concurrent: int = 0  # requests admitted at once (running + waiting); 0 = max_batch_size + max_queue
    default_max_tokens: int = 16  # /v1/completions without max_tokens (OpenAI's default)
    access_log: bool = True  # one line per request on the "trainforge.access" logger
    read_timeout_s: float = 30.0  # a request's headers, then its body, must each arrive within this
    max_tokenize_concurrent: int = 2  # /tokenize + /detokenize requests at once; more get 429

    def validate(self) -> None:
        """``ConfigError`` naming the flag if a limit cannot work."""
        if not 0 < self.read_timeout_s <= 3600:
            raise ConfigError(f"--read_timeout_s {self.read_timeout_s}: must be in (0, 3600] seconds (the time a "
                              "client may take to send a request's headers, and again its body)")
        if self.max_tokenize_concurrent < 1:
            raise ConfigError(f"--max_tokenize_concurrent {self.max_tokenize_concurrent}: must be >= 1")
        if self.max_body_bytes < 1:
            raise ConfigError(f"--max_body_bytes {self.max_body_bytes}: must be >= 1")


class _Admission:
    """The concurrency limit. A request counts from the moment it is admitted, once its body
    has arrived and its fields are valid: the engine counts it once submitted
    (``Engine.load``), this counts it in between, while its prompt is tokenised (awaits,
    during which other requests are checked). Event-loop only."""

    def __init__(self, engine: Engine, limit: int):
        self.engine, self.limit, self.admitting = engine, limit, 0

    def load(self) -> int:
        return self.engine.load() + self.admitting

    def check(self) -> None:
        """429 if the server is full now (before a body is read: the cheapest refusal)."""
        load = self.load()
        if load >= self.limit:
            raise APIError(429, f"server busy: {load} requests running or waiting (limit {self.limit}); retry later",
                           "rate_limit_error", code="rate_limit_exceeded")

    @contextmanager
    def hold(self):
        """Admit one request or raise 429; yields a release function that the handler calls
        once the engine holds the request (and that runs on exit otherwise)."""
        self.check()
        self.admitting += 1
        held = [True]

        def release() -> None:
            if held[0]:
                held[0] = False
                self.admitting -= 1

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
    config.validate()
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
    app.add_middleware(Gate, api_key=config.api_key, registry=metrics_registry, access_log=config.access_log)
    token_texts = (TokenText(tokenizer), TokenText(tokenizer, as_ids=True))
    tokenizer_pool = TokenizerPool(config.max_tokenize_concurrent)
    max_chars = text_limit(tokenizer, engine.max_context)

    @app.exception_handler(APIError)
    async def _api_error(_, e: APIError):
        return JSONResponse(e.body(), status_code=e.status, headers=e.headers)

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
        too_deep = json_depth_error(bytes(body))
        if too_deep:
            raise APIError(400, too_deep)
        try:
            data = json.loads(body)
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
        return data

    def check_text(text: str, param: str) -> str:
        """``text`` if it may be tokenised (``server_limits.text_limit``), else a 400: no text
        longer than ``max_chars`` fits the context, and its tokenisation would cost seconds."""
        if max_chars is not None and len(text) > max_chars:
            raise APIError(400, f"'{param}' has {len(text)} characters; at most {max_chars} can fit the context of "
                           f"{engine.max_context} tokens", param=param, code="context_length_exceeded")
        return text

    async def encode(text: str, param: str, pool: TokenizerPool | None = None) -> list[int]:
        """``text``'s token ids, tokenised off the event loop (``pool``'s threads, or the loop's
        default executor); a tokenizer failure on it is this request's 400."""
        try:
            if pool is not None:
                return (await pool.run(tokenizer.encode, text)).ids
            loop = asyncio.get_running_loop()
            return (await loop.run_in_executor(None, tokenizer_call, tokenizer.encode, text)).ids
        except TokenizerFailed as e:
            raise APIError(400, f"the server's tokenizer failed on this text ({e}); check its tokenizer.json "
                           "(a pre-tokenizer or normalizer regex that backtracks too much?)", param=param) from None

    def prompt_of(prompt: Any) -> str | list[int]:
        """The prompt's text or token ids (validated; text is tokenised once admitted)."""
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]
        if isinstance(prompt, str):
            return check_text(prompt, "prompt")
        if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            return prompt
        raise APIError(400, "'prompt' must be a string, a list of token ids, or a one-element list of either",
                       param="prompt")

    async def run(request: HTTPRequest, ids: list[int], params: SamplingParams, chat: bool, choices: Choices,
                  admitted: Callable[[], None]):
        """Submit ``choices.n`` engine requests (one per choice; seed, seed + 1, ... when a
        seed is given, else a fresh one each), then answer: a JSON body, or an SSE stream
        whose chunks carry each choice's ``index``. ``admitted()`` once the engine holds
        them (from then on ``Engine.load`` counts them)."""
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue = asyncio.Queue()  # streamed: (index, new ids, logprobs, text, finished)
        finished_event = asyncio.Event()  # not streamed: set once, when every choice has ended
        n, stream = choices.n, choices.stream
        ended = [0]

        def on_update_for(index: int):
            handed = [0]  # tokens of this choice handed out so far: updates come in order, after the step

            def on_update(req: Request, new_ids: list[int], text: str, finished: bool) -> None:
                lps = req.logprobs[handed[0]:handed[0] + len(new_ids)] if want_lp else None
                handed[0] += len(new_ids)
                if stream:
                    loop.call_soon_threadsafe(queue.put_nowait, (index, new_ids, lps, text, finished))
                elif finished:
                    loop.call_soon_threadsafe(end_one)
            return on_update

        def end_one() -> None:
            ended[0] += 1
            if ended[0] == n:
                finished_event.set()

        want_lp = params.logprobs is not None
        token_text = token_texts[choices.tokens_as_ids]
        if want_lp and engine.drafter is not None:
            raise APIError(400, "'logprobs' is not supported with speculative decoding; serve without "
                           "--speculative to get logprobs", param="logprobs")
        if n > 1 and admission.load() - 1 + n > admission.limit:  # this request already counts once
            raise APIError(429, f"server busy: n={n} choices do not fit the {admission.limit - admission.load() + 1} "
                           "free places; retry later or lower 'n'", "rate_limit_error", code="rate_limit_exceeded")
        reqs: list[Request] = []
        try:
            for i in range(n):
                p = params if params.seed is None or i == 0 else dataclasses.replace(params, seed=params.seed + i)
                reqs.append(engine.submit(ids, p, on_update_for(i)))
        except (RequestTooLong, QueueFull, ValueError) as e:
            for r in reqs:
                engine.abort(r)
            if isinstance(e, RequestTooLong):
                raise APIError(400, str(e), param="max_tokens", code="context_length_exceeded") from None
            if isinstance(e, QueueFull):
                raise APIError(429, f"server busy: {e}", "rate_limit_error", code="rate_limit_exceeded") from None
            raise APIError(400, str(e)) from None
        finally:
            admitted()  # the engine counts them now (or they were refused)
        rid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex[:24]}"
        created = int(time.time())
        obj = "chat.completion" if chat else "text_completion"

        def usage() -> dict:
            out = sum(len(r.output_ids) for r in reqs)
            request.scope.setdefault("state", {})["tokens"] = (len(ids), out)  # for the access log
            return {"prompt_tokens": len(ids), "completion_tokens": out, "total_tokens": len(ids) + out}

        def observe(req: Request) -> None:
            metrics_registry.ingest({"ttft_s": req.ttft_s,
                                     "request_s": None if req.finished_s is None else req.finished_s - req.created_s})

        def abort_all() -> None:
            for r in reqs:
                if not r.done.is_set():
                    engine.abort(r)

        def failure(req: Request) -> APIError:
            return APIError(500, f"generation failed: {req.error}", "server_error", code="generation_error")

        def logprobs_of(token_ids: list[int], lps: list | None, offsets: TextOffsets | None) -> dict | None:
            if lps is None:
                return None
            if chat:
                return chat_logprobs(token_text, token_ids, lps)
            return completion_logprobs(token_text, token_ids, lps, offsets(token_ids))

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
                abort_all()
            failed = next((r for r in reqs if r.finish_reason == "error"), None)
            if failed is not None:
                raise failure(failed)
            out = []
            for i, req in enumerate(reqs):
                observe(req)
                lp = logprobs_of(req.output_ids, req.logprobs if want_lp else None, TextOffsets(tokenizer))
                choice = {"index": i, "finish_reason": req.finish_reason, "logprobs": lp}
                if chat:
                    choice["message"] = {"role": "assistant", "content": req.text}
                else:
                    choice["text"] = req.text
                out.append(choice)
            return {"id": rid, "object": obj, "created": created, "model": config.model_name, "choices": out,
                    "usage": usage()}

        def chunk(choice_list: list[dict], usage_body: dict | None = None) -> str:
            body = {"id": rid, "object": obj + ".chunk" if chat else obj, "created": created,
                    "model": config.model_name, "choices": choice_list}
            if choices.include_usage:  # OpenAI: null on every chunk but the last
                body["usage"] = usage_body
            return f"data: {json.dumps(body)}\n\n"

        def choice(index: int, text: str | None, finish: str | None, lp: dict | None = None,
                   first: bool = False) -> dict:
            if chat:
                delta = {"role": "assistant", "content": ""} if first else ({"content": text} if text else {})
                return {"index": index, "delta": delta, "finish_reason": finish, "logprobs": lp}
            return {"index": index, "text": text or "", "finish_reason": finish, "logprobs": lp}

        async def events():
            offsets = [TextOffsets(tokenizer) for _ in range(n)]
            try:
                if chat:
                    for i in range(n):
                        yield chunk([choice(i, None, None, first=True)])
                left = n
                while left:
                    index, new_ids, lps, text, finished = await queue.get()
                    if text or (lps and new_ids):
                        yield chunk([choice(index, text, None, logprobs_of(new_ids, lps, offsets[index]))])
                    if finished and reqs[index].finish_reason == "error":  # the headers are out: an error event
                        yield f"data: {json.dumps(failure(reqs[index]).body())}\n\n"
                        break
                    if finished:
                        left -= 1
                        observe(reqs[index])
                        yield chunk([choice(index, None, reqs[index].finish_reason)])
                if left == 0 and choices.include_usage:
                    yield chunk([], usage())
                else:
                    usage()  # the access log's token counts
                yield "data: [DONE]\n\n"
            finally:  # also runs when the client goes away and the response task is cancelled
                abort_all()

        return StreamingResponse(events(), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    # Each handler: refuse at once if full; read the body (not counted: a slow client holds no
    # place); validate every field (400 whatever the load); then admit and tokenise.
    @app.post("/v1/completions")
    async def completions(request: HTTPRequest):
        admission.check()
        data = await read_body(request)
        if "prompt" not in data:
            raise APIError(400, "'prompt' is required", param="prompt")
        prompt = prompt_of(data["prompt"])
        params = sampling_params(data, config.default_max_tokens)
        choices = choices_of(data, engine_cap)
        with admission.hold() as admitted:
            ids = await encode(prompt, "prompt") if isinstance(prompt, str) else prompt
            return await run(request, ids, params, chat=False, choices=choices, admitted=admitted)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: HTTPRequest):
        admission.check()
        data = await read_body(request)
        text = check_text(chat_prompt(data.get("messages")), "messages")
        sampling_params(data, 1, chat=True)  # every field checked before admission; max_tokens' default needs ids
        choices = choices_of(data, engine_cap)
        with admission.hold() as admitted:
            ids = await encode(text, "messages")
            default = max(1, min(256, engine.max_context - len(ids)))
            params = sampling_params(data, default, chat=True)
            return await run(request, ids, params, chat=True, choices=choices, admitted=admitted)

    # vLLM's /tokenize and /detokenize (same shapes), behind the API key like the rest; their own
    # threads and limit (server_limits.TokenizerPool), so a flood of large texts queues nothing else.
    @app.post("/tokenize")
    async def tokenize(request: HTTPRequest):
        tokenizer_pool.check()
        data = await read_body(request)
        if "messages" in data:
            text, param = chat_prompt(data["messages"]), "messages"
        elif isinstance(data.get("prompt"), str):
            text, param = data["prompt"], "prompt"
        else:
            raise APIError(400, "give 'prompt' (a string) or 'messages' (a chat)", param="prompt")
        check_text(text, param)
        with tokenizer_pool.slot():
            ids = await encode(text, param, tokenizer_pool)
        # A JSONResponse, not a dict: FastAPI's jsonable_encoder took 184 ms per 250,000 ids on the loop.
        return JSONResponse({"count": len(ids), "max_model_len": engine.max_context, "tokens": ids})

    @app.post("/detokenize")
    async def detokenize(request: HTTPRequest):
        tokenizer_pool.check()
        data = await read_body(request)
        ids = data.get("tokens")
        V = engine.model.cfg.vocab_size
        if not isinstance(ids, list) or not all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < V
                                                for t in ids):
            raise APIError(400, f"'tokens' must be a list of token ids in [0, {V})", param="tokens")
        with tokenizer_pool.slot():
            try:
                return {"prompt": await tokenizer_pool.run(tokenizer.decode, ids)}
            except TokenizerFailed as e:
                raise APIError(400, f"the server's tokenizer failed on these ids ({e})", param="tokens") from None

    return app


def uvicorn_config(app, config: ServerConfig, **kw):
    """uvicorn's settings for ``app``: the header deadline of ``config.read_timeout_s``
    (``server_limits.header_deadline_protocol``), uvicorn's own access log off (the gate's
    line has the duration and the token counts), 5 s to finish streams on shutdown."""
    import uvicorn

    return uvicorn.Config(app, log_level="warning", access_log=False, timeout_graceful_shutdown=5,
                          http=header_deadline_protocol(config.read_timeout_s), **kw)


def serve(engine: Engine, tokenizer, config: ServerConfig, sock: socket.socket | None = None) -> None:
    """Run the server on ``sock`` (bound by ``bind_socket``; bound here from ``config`` if
    None) until interrupted (uvicorn handles SIGINT/SIGTERM). Logs the banner first."""
    import uvicorn

    from trainforge.log import get_logger

    sock = sock or bind_socket(config.host, config.port)
    app = create_app(engine, tokenizer, config)
    host, port = sock.getsockname()[:2]
    shown = f"[{host}]" if ":" in host else host
    server = uvicorn.Server(uvicorn_config(app, config))
    get_logger().info(banner(engine, config, f"http://{shown}:{port}"))
    engine.start()
    try:
        server.run(sockets=[sock])
    finally:
        engine.stop()
        sock.close()
