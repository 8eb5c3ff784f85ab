"""What every handler of ``trainforge serve`` shares: the engine, the tokenizer, the limits
and the metrics, held by one ``ServerState`` per app (``app.state.server``). The handlers
(``server_generate.py``, ``server_tokenize.py``, ``server_info.py``) are plain functions
that read it from the request; nothing here is a closure over ``create_app``'s locals.

Everything here runs on the event loop's thread (the engine's callbacks reach it through
``loop.call_soon_threadsafe``), so the counters need no lock.
"""

from __future__ import annotations

import asyncio
import time
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

from trainforge.infer.openai_schema import APIError, TokenText
from trainforge.infer.server_limits import TokenizerFailed, TokenizerPool, text_limit, tokenizer_call

if TYPE_CHECKING:
    from starlette.requests import Request as HTTPRequest

    from trainforge.infer.engine import Engine
    from trainforge.infer.request import Request
    from trainforge.infer.server import ServerConfig


class Admission:
    """The concurrency limit. A request counts from the moment it is admitted, once its body
    has arrived and its fields are valid: the engine counts it once submitted
    (``Engine.load``), this counts it in between, while its prompt is tokenised (awaits,
    during which other requests are checked)."""

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


class ServerState:
    """One app's engine, tokenizer, limits and metrics. ``created`` is the Unix time the app
    was made (``serve`` makes it right after the weights are loaded) unless the config
    gives the model's own time (``ServerConfig.model_created``)."""

    def __init__(self, engine: Engine, tokenizer, config: ServerConfig):
        from prometheus_client import CollectorRegistry

        from trainforge.monitor.registry import Registry
        from trainforge.monitor.sinks import RegistryCollector

        self.engine, self.tokenizer, self.config = engine, tokenizer, config
        self.engine_cap = engine.config.max_batch_size + engine.config.max_queue
        self.admission = Admission(engine, config.max_concurrent or self.engine_cap)
        self.tokenizer_pool = TokenizerPool(config.max_tokenize_concurrent)
        self.token_texts = (TokenText(tokenizer), TokenText(tokenizer, as_ids=True))
        self.max_chars = text_limit(tokenizer, engine.max_context)
        self.metrics = Registry(rank=0)
        self.exposition = CollectorRegistry(auto_describe=False)
        self.exposition.register(RegistryCollector(self.metrics))
        self.created = int(config.model_created if config.model_created is not None else time.time())

    def check_text(self, text: str, param: str) -> str:
        """``text`` if it may be tokenised (``server_limits.text_limit``), else a 400: no text
        longer than ``max_chars`` fits the context, and its tokenisation would cost seconds."""
        if self.max_chars is not None and len(text) > self.max_chars:
            raise APIError(400, f"'{param}' has {len(text)} characters; at most {self.max_chars} can fit the context "
                           f"of {self.engine.max_context} tokens", param=param, code="context_length_exceeded")
        return text

    async def encode(self, text: str, param: str, pool: TokenizerPool | None = None) -> list[int]:
        """``text``'s token ids, tokenised off the event loop (``pool``'s threads, or the loop's
        default executor); a tokenizer failure on it is this request's 400."""
        try:
            if pool is not None:
                return (await pool.run(self.tokenizer.encode, text)).ids
            loop = asyncio.get_running_loop()
            return (await loop.run_in_executor(None, tokenizer_call, self.tokenizer.encode, text)).ids
        except TokenizerFailed as e:
            raise APIError(400, f"the server's tokenizer failed on this text ({e}); check its tokenizer.json "
                           "(a pre-tokenizer or normalizer regex that backtracks too much?)", param=param) from None

    def observe(self, req: Request) -> None:
        """A finished request's latencies into the histograms: time to first token, the whole
        request, and the time per output token after the first (decode speed as the client
        sees it, vLLM's TPOT: (last token - first token) / (tokens - 1); none for one token)."""
        record: dict[str, Any] = {"ttft_s": req.ttft_s}
        if req.finished_s is not None:
            record["request_s"] = req.finished_s - req.created_s
            n = len(req.output_ids)
            if n > 1 and req.first_token_s is not None:
                record["tpot_s"] = (req.finished_s - req.first_token_s) / (n - 1)
        self.metrics.ingest(record)


def state_of(request: HTTPRequest) -> ServerState:
    return request.app.state.server
