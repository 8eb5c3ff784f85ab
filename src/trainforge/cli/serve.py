"""``trainforge serve``: the OpenAI-compatible HTTP server over the engine (``infer/server.py``)."""

from __future__ import annotations

from dataclasses import dataclass

from trainforge.cli.options import Command
from trainforge.config_base import _f
from trainforge.errors import TrainforgeError
from trainforge.infer.session_options import SessionOptions

DESCRIPTION = ("OpenAI-compatible HTTP server (/v1/completions, /v1/chat/completions, /v1/models, /tokenize, "
               "/detokenize, /health, /metrics) with continuous batching.")


@dataclass
class EngineOptions:
    max_batch_size: int = _f(8, "sequences decoded together")
    max_queue: int = _f(64, "requests waiting while every batch row is busy")
    block_size: int = _f(16, "tokens per KV-cache block")
    n_blocks: int = _f(0, "KV pool size in blocks; 0 = max_batch_size full contexts")
    max_context: int = _f(0, "tokens per sequence; 0 = the model's max_seq_len")
    max_prefill_tokens: int = _f(512, "prompt tokens of requests admitted together that prefill in one forward "
                                      "(a longer prompt prefills alone)")


@dataclass
class ServerOptions:
    host: str = _f("127.0.0.1", "address to bind (0.0.0.0 exposes the server to the network)")
    port: int = _f(8000, "TCP port to listen on")
    api_key: str | None = _f(None, "require 'Authorization: Bearer KEY' on all endpoints but /health "
                                   "(default: $TRAINFORGE_API_KEY; unset = no key)", env="TRAINFORGE_API_KEY",
                             metavar="KEY")
    model_name: str | None = _f(None, "model id in the API (default: the checkpoint's name)", metavar="NAME")
    max_concurrent: int = _f(0, "running + waiting requests before answering 429; 0 = max_batch_size + max_queue")
    max_body_bytes: int = _f(1 << 20, "larger request bodies get 413")
    read_timeout_s: float = _f(30.0, "a client must send a request's headers within this many seconds (else the "
                                     "connection closes), then its body within as many again (else 408); slow "
                                     "clients hold no place")
    max_tokenize_concurrent: int = _f(2, "/tokenize and /detokenize requests handled at once (each on its own "
                                         "thread); more get 429")
    no_access_log: bool = _f(False, "do not log a line per request (method, path, status, ms, tokens)")


SECTIONS = {"model and engine": SessionOptions, "batching and KV cache": EngineOptions, "server": ServerOptions}
COMMAND = Command("serve", DESCRIPTION, SECTIONS, model="checkpoint")


def run(argv: list[str]) -> int:
    parsed = COMMAND.parse(argv)
    if parsed is None:
        return 0
    opts, eo, so = parsed.section(SessionOptions), parsed.section(EngineOptions), parsed.section(ServerOptions)
    from trainforge.infer.listen import bind_socket

    sock = bind_socket(so.host, so.port)  # before the model loads: a busy port fails at once, and stays ours
    from trainforge.infer.engine import Engine  # torch and FastAPI take seconds to import: after the bind

    try:
        from trainforge.infer.server import ServerConfig, serve
    except ImportError as e:
        raise TrainforgeError(f"trainforge serve needs the server packages ({e.name} is missing): "
                              "pip install 'trainforge[infer]'") from None
    from trainforge.infer.session import (engine_config, freeze_long_lived, inference_mode, load_drafter,
                                          load_for_engine, speculative_args)

    server_config = ServerConfig(host=so.host, port=so.port, api_key=so.api_key, max_body_bytes=so.max_body_bytes,
                                 max_concurrent=so.max_concurrent, access_log=not so.no_access_log,
                                 read_timeout_s=so.read_timeout_s, max_tokenize_concurrent=so.max_tokenize_concurrent)
    server_config.validate()  # before any weight is read
    spec = speculative_args(opts)
    ahead = opts.num_speculative_tokens if spec else 0
    config = engine_config(opts, max_batch_size=eo.max_batch_size, max_queue=eo.max_queue, block_size=eo.block_size,
                           n_blocks=eo.n_blocks, max_context=eo.max_context, max_prefill_tokens=eo.max_prefill_tokens)
    try:
        config.validate()  # before any weight is read: a bad flag costs no load
    except ValueError as e:
        raise TrainforgeError(f"--{e}") from None

    def kv_slots(cfg) -> int:  # EngineConfig's defaults: max_batch_size full contexts (+ the padding block)
        bs = max(eo.block_size, 1)
        return (eo.n_blocks or eo.max_batch_size * -(-((eo.max_context or cfg.max_seq_len) + ahead) // bs) + 1) * bs

    with inference_mode():
        loaded = load_for_engine(opts, kv_slots)
        if loaded.tokenizer is None:
            raise TrainforgeError(f"{opts.checkpoint} has no tokenizer.json; the server needs one")
        try:
            engine = Engine(loaded.model, config, tokenizer=loaded.tokenizer, eos_ids=loaded.eos_ids,
                            drafter=load_drafter(opts, spec, loaded))
        except ValueError as e:
            raise TrainforgeError(str(e)) from None
    freeze_long_lived()
    server_config.model_name = so.model_name or loaded.name
    serve(engine, loaded.tokenizer, server_config, sock)
    return 0
