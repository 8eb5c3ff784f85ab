"""The GET endpoints of ``trainforge serve``: ``/health`` (no API key needed: a load
balancer's probe), ``/v1/models``, ``/version`` and ``/metrics`` (Prometheus text: the
monitoring ``Registry``, fed the engine's state at scrape time and each finished request's
latencies, exposed through ``prometheus_client``; names, types and help come from
``monitor/catalog.py`` and appear in ``docs/metrics.md``)."""

from __future__ import annotations

from fastapi import APIRouter
from fastapi.responses import PlainTextResponse
from starlette.requests import Request as HTTPRequest  # at module level: FastAPI resolves annotations here

from trainforge.infer.server_extras import engine_record
from trainforge.infer.server_state import state_of

router = APIRouter(tags=["server"])


@router.get("/health", summary="ok, with the requests running and waiting (no API key needed)")
async def health(request: HTTPRequest):
    engine = state_of(request).engine
    return {"status": "ok", "running": len(engine._rows), "waiting": len(engine._waiting)}


@router.get("/v1/models", summary="The served model")
async def models(request: HTTPRequest):
    """``created``: when the served model was made, as Unix seconds (the load time unless
    the server was told the checkpoint's; ``ServerState``). ``max_model_len``: the most
    tokens (prompt + completion) a request may use, as vLLM reports it;
    ``trained_context_length``: the context the model was trained for (``max_seq_len``;
    larger than ``max_model_len`` when ``--max_context`` lowers it)."""
    state = state_of(request)
    cfg = state.engine.model.cfg
    return {"object": "list", "data": [{
        "id": state.config.model_name, "object": "model", "created": state.created, "owned_by": "trainforge",
        "root": state.config.model_name, "parent": None, "max_model_len": state.engine.max_context,
        "trained_context_length": getattr(cfg, "max_seq_len", None)}]}


@router.get("/version", summary="trainforge's and torch's versions")
async def version():
    import torch

    import trainforge

    return {"version": trainforge.__version__, "torch": torch.__version__}


@router.get("/metrics", summary="Prometheus metrics (text exposition format)", response_class=PlainTextResponse)
async def metrics(request: HTTPRequest):
    from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

    state = state_of(request)
    state.metrics.ingest(engine_record(state.engine))
    return PlainTextResponse(generate_latest(state.exposition), media_type=CONTENT_TYPE_LATEST)
