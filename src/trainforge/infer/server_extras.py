"""The parts of ``trainforge serve`` around the endpoints: the startup banner, the ASGI
gate (API key, request counts by status, one access-log line per request) and the engine
record /metrics exposes. The port is bound before anything loads by ``listen.py``."""

from __future__ import annotations

import hmac
import json
import time
from typing import Any

from trainforge.infer.openai_schema import APIError
from trainforge.log import get_logger

ACCESS_LOGGER = "trainforge.access"


ENDPOINTS = ("POST /v1/completions", "POST /v1/chat/completions", "GET /v1/models", "POST /tokenize",
             "POST /detokenize", "GET /health", "GET /metrics", "GET /version", "GET /docs")


def banner(engine, config, url: str) -> str:
    """The startup block: where, what, how much (``serve`` logs it once the port is bound)."""
    stats = engine.stats()
    pool = engine.pool
    dtype = str(engine.model.norm.weight.dtype).removeprefix("torch.")
    quant = ", ".join(f"{k} x{n}" for k, n in stats["quant_kernels"].items()) or "none"
    spec = f", speculative k={engine.lookahead}" if engine.drafter is not None else ""
    limit = config.max_concurrent or engine.config.max_batch_size + engine.config.max_queue
    lines = [
        f"trainforge serve: running on {url}",
        f"  model {config.model_name!r}: dtype {dtype}, quantization {quant}{spec}",
        f"  max batch {engine.config.max_batch_size}, queue {engine.config.max_queue}, {limit} requests at once "
        f"(more get 429); context {engine.max_context} tokens",
        f"  KV pool {pool.usable_blocks} blocks x {pool.block_size} tokens = {pool.usable_blocks * pool.block_size} "
        f"token slots, {stats['kv_pool_bytes'] / 2**20:.1f} MiB",
        f"  API key {'on (Authorization: Bearer KEY)' if config.api_key else 'off'}; access log "
        f"{'on' if config.access_log else 'off (--no_access_log)'}",
        f"  endpoints: {', '.join(ENDPOINTS)}",
    ]
    return "\n".join(lines)


class Gate:
    """ASGI middleware: API-key check (all paths but ``OPEN``), request counting by status,
    and an access-log line per request (method, path, status, ms, tokens, which the
    handler leaves in ``scope["state"]["tokens"]``). Pure ASGI, not ``BaseHTTPMiddleware``,
    so streamed responses and disconnects pass through; a streamed response is logged when
    it ends, with its whole duration."""

    KNOWN = ("/health", "/metrics", "/v1/models", "/v1/completions", "/v1/chat/completions", "/tokenize",
             "/detokenize", "/version", "/docs", "/openapi.json")
    # No key: a load balancer's probe, and the API's description (nothing of the model's; a
    # browser opening /docs cannot send the header, and the page fetches /openapi.json).
    OPEN = ("/health", "/docs", "/openapi.json")

    def __init__(self, app, api_key: str | None, registry, access_log: bool = True):
        self.app, self.api_key, self.registry = app, api_key, registry
        self.log = get_logger(ACCESS_LOGGER) if access_log else None
        self.counts: dict[tuple[str, int], int] = {}

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path = scope["path"]
        status = [500]
        t0 = time.perf_counter()
        state = scope.setdefault("state", {})

        async def counting_send(message):
            if message["type"] == "http.response.start":
                status[0] = message["status"]
            await send(message)

        try:
            if self.api_key and path not in self.OPEN:
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
            if self.log is not None:
                ms = (time.perf_counter() - t0) * 1e3
                tokens = state.get("tokens")
                what = f" prompt={tokens[0]} completion={tokens[1]} tokens" if tokens else ""
                client = scope.get("client") or ("-", 0)
                self.log.info(f"{client[0]} {scope['method']} {path} {status[0]} {ms:.1f} ms{what}")


def document_api_key(app) -> None:
    """Declare the gate's bearer key in ``/openapi.json`` (every path but ``Gate.OPEN``), so
    the ``/docs`` page offers "Authorize" and its "Try it out" requests carry the key."""
    generate = app.openapi

    def openapi() -> dict:
        if app.openapi_schema is None:
            schema = generate()  # FastAPI caches it in app.openapi_schema; annotated in place, once
            schema.setdefault("components", {})["securitySchemes"] = {
                "api_key": {"type": "http", "scheme": "bearer", "description": "the server's --api_key"}}
            for path, operations in schema["paths"].items():
                for operation in operations.values():
                    if path not in Gate.OPEN:
                        operation["security"] = [{"api_key": []}]
        return app.openapi_schema

    app.openapi = openapi


SPEC_KEYS = ("spec_drafted_tokens", "spec_accepted_tokens", "spec_acceptance_rate", "spec_mean_accepted_length")


def engine_record(engine) -> dict[str, Any]:
    """The engine's state as a metrics record (keys in ``monitor/catalog.py``), read at scrape time."""
    s = engine.stats()
    pool = s["kv_pool"]
    return {"infer_running": s["running"], "infer_waiting": s["waiting"], "kv_blocks_used": pool["blocks_used"],
            "kv_blocks_reserved": pool["blocks_reserved"], "kv_blocks_capacity": pool["blocks_total"],
            "kv_block_utilisation": pool["block_utilisation"], "kv_slot_utilisation": pool["slot_utilisation"],
            "infer_prompt_tokens": s["prompt_tokens"], "infer_generated_tokens": s["generated_tokens"],
            "infer_decode_steps": s["decode_steps"], "infer_rejected": s["rejected"],
            "infer_finished": {r: s[f"finished_{r}"] for r in ("stop", "length", "abort", "error")},
            **{k: v for k, v in s.items() if k in SPEC_KEYS}}
