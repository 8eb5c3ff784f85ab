"""``trainforge serve``: an OpenAI-compatible HTTP server over the engine (FastAPI + uvicorn).

Endpoints, one handler each: ``POST /v1/completions`` and ``POST /v1/chat/completions``
(``server_generate.py``: ``"stream": true`` as server-sent events ending ``data: [DONE]``;
``n`` choices, each its own engine request; ``logprobs``; ``stream_options.include_usage``),
``POST /tokenize`` and ``POST /detokenize`` (``server_tokenize.py``, vLLM's shapes),
``GET /v1/models``, ``GET /version``, ``GET /health``, ``GET /metrics`` (``server_info.py``).
Request bodies are pydantic models (``server_protocol.py``), so ``GET /openapi.json`` and
the ``GET /docs`` page describe every field. The handlers share one ``ServerState``
(``server_state.py``: engine, tokenizer, limits, metrics) held in ``app.state.server``.

Binds 127.0.0.1 unless told otherwise; with an API key every endpoint but ``/health``,
``/docs`` and ``/openapi.json`` wants ``Authorization: Bearer KEY`` (the API's description
holds nothing of the model's, and a browser opening ``/docs`` cannot send the header).
Needs the ``infer`` extra (fastapi, uvicorn). ``server_extras.py`` has the startup banner
and the access log, ``listen.py`` the port binding (before the model loads).

Errors use OpenAI's envelope ``{"error": {"message", "type", "param", "code"}}``
(``server_body.py`` maps every refusal to it):

- 400 malformed JSON, a body that fails its model or an unsupported parameter (``n``
  outside [1, max_batch_size + max_queue], ``top_logprobs`` / ``logprobs`` above 20,
  logprobs with speculative decoding, ``stream_options`` without ``stream``: ``param``
  names the field; never FastAPI's 422), prompt + max_tokens beyond the context (code
  ``context_length_exceeded``); 401 bad or missing key; 404 unknown model or path;
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
"""

from __future__ import annotations

import socket
from dataclasses import dataclass

from trainforge.errors import ConfigError
from trainforge.infer.engine import Engine
from trainforge.infer.listen import bind_socket
from trainforge.infer.openai_schema import APIError
from trainforge.infer.server_extras import Gate, banner, document_api_key, engine_record
from trainforge.infer.server_limits import header_deadline_protocol

__all__ = ["APIError", "ServerConfig", "create_app", "engine_record", "serve", "uvicorn_config"]


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
    model_created: float | None = None  # /v1/models' "created" (Unix s, e.g. the checkpoint's mtime); None = load time

    def validate(self) -> None:
        """``ConfigError`` naming the flag if a limit cannot work."""
        if not 0 < self.read_timeout_s <= 3600:
            raise ConfigError(f"--read_timeout_s {self.read_timeout_s}: must be in (0, 3600] seconds (the time a "
                              "client may take to send a request's headers, and again its body)")
        if self.max_tokenize_concurrent < 1:
            raise ConfigError(f"--max_tokenize_concurrent {self.max_tokenize_concurrent}: must be >= 1")
        if self.max_body_bytes < 1:
            raise ConfigError(f"--max_body_bytes {self.max_body_bytes}: must be >= 1")


def create_app(engine: Engine, tokenizer, config: ServerConfig | None = None):
    """The FastAPI app: one ``ServerState`` (``app.state.server``), the gate (API key,
    request counts, access log), the error envelope, and the routers of
    ``server_generate``, ``server_tokenize`` and ``server_info``. The caller runs
    ``engine.start()`` (``serve`` does)."""
    from fastapi import FastAPI

    import trainforge
    from trainforge.infer import server_generate, server_info, server_tokenize
    from trainforge.infer.server_body import install_error_handlers
    from trainforge.infer.server_state import ServerState

    config = config or ServerConfig()
    config.validate()
    if tokenizer is None:
        raise ValueError("the server needs a tokenizer (the checkpoint has no tokenizer.json)")
    engine_cap = engine.config.max_batch_size + engine.config.max_queue
    if not 0 <= config.max_concurrent <= engine_cap:
        raise ConfigError(f"max_concurrent={config.max_concurrent}: must be in [0, max_batch_size + max_queue = "
                          f"{engine_cap}]; raise --max_queue or lower --max_concurrent")
    state = ServerState(engine, tokenizer, config)
    app = FastAPI(title="trainforge serve", version=trainforge.__version__, redoc_url=None,
                  description="OpenAI-compatible completions over a trainforge model, with continuous batching. "
                              "Errors use OpenAI's envelope {\"error\": {\"message\", \"type\", \"param\", \"code\"}}.")
    app.state.server = state
    app.add_middleware(Gate, api_key=config.api_key, registry=state.metrics, access_log=config.access_log)
    install_error_handlers(app)
    if config.api_key:
        document_api_key(app)
    for module in (server_generate, server_tokenize, server_info):
        app.include_router(module.router)
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
