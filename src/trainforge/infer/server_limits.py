"""What keeps one HTTP client of ``trainforge serve`` from costing the others anything: a
deadline on request headers, a bound on JSON nesting, and tokenizer work off the event loop.

- **Headers within ``read_timeout_s``.** uvicorn times out only an idle keep-alive
  connection (``timeout_keep_alive``, cancelled by the first byte of a new request) and
  bounds the header *size* (h11's 16 KiB ``h11_max_incomplete_event_size``), not the time a
  client takes to send them: a client that sends a few header bytes and waits keeps its
  connection forever. ``header_deadline_protocol`` wraps uvicorn's HTTP protocol (h11, or
  httptools when installed) with a timer armed when a connection opens and again when a
  response ends; if it fires before the next request's headers are complete, the
  connection is closed. (uvicorn's ``limit_concurrency`` counts such connections too, so it
  would hand slow clients the server rather than protect it.) The body's deadline is
  ``server.read_body``'s: the same ``read_timeout_s`` from the end of the headers, then 408.
- **JSON nesting at most ``MAX_JSON_DEPTH``.** Python's ``json`` recurses per level: a
  200,000-deep body raised ``RecursionError`` (a 500), and a few hundred levels passed the
  parser but not ``repr`` of the value in an error message. ``json_depth_error`` checks the
  depth before parsing; counting brackets is enough for almost every body, the exact scan
  (strings cut out, a cumulative sum) runs only when there are more brackets than the limit.
- **Tokenizer calls off the event loop, bounded.** ``tokenizers`` releases the GIL while it
  works (a 1 MiB encode in a thread stalled the event loop's thread 12 ms, against 650 ms
  inline), so a thread is enough. ``TokenizerPool`` runs ``/tokenize`` and ``/detokenize`` on
  their own threads, at most ``max_tokenize_concurrent`` at once (more get 429 at once, so a
  flood of texts never queues behind itself or in front of completions), at a lower CPU
  priority than the engine (nice +10, Linux: the engine thread keeps its core); a
  completion's prompt is encoded on the event loop's default executor, bounded by the
  server's admission. Text longer than ``text_limit`` (the context times the longest
  token's characters: a byte-level BPE token covers at most that many characters) is refused
  before it is tokenised: a 1 MiB ``/tokenize`` cost 0.65 s of a core and a 250,000-id answer.
  ``tokenizer_call`` turns a panic of the tokenizers library (a ``BaseException``; e.g. a
  tokenizer.json regex that hits Oniguruma's retry limit on this text) into a
  ``TokenizerFailed`` for that request.
"""

from __future__ import annotations

import asyncio
import os
import re
import threading
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from typing import Any, Callable

import numpy as np

from trainforge.infer.openai_schema import APIError

MAX_JSON_DEPTH = 64  # OpenAI's request bodies nest 5 deep (messages -> content parts -> ...)

# A JSON string, escapes included (the unrolled form: no backtracking on long strings).
_JSON_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"', re.S)


def json_depth_error(body: bytes, max_depth: int = MAX_JSON_DEPTH) -> str | None:
    """None if ``body`` nests arrays / objects at most ``max_depth`` deep, else the reason.
    Malformed JSON is left to the parser (only the depth is judged here)."""
    if body.count(b"[") + body.count(b"{") <= max_depth:
        return None
    skeleton = np.frombuffer(_JSON_STRING.sub(b"", body), dtype=np.uint8)
    opens = (skeleton == ord("[")) | (skeleton == ord("{"))
    closes = (skeleton == ord("]")) | (skeleton == ord("}"))
    depth = int(np.cumsum(opens.astype(np.int32) - closes.astype(np.int32)).max(initial=0))
    if depth <= max_depth:
        return None
    return f"request body nests {depth} levels of arrays / objects; at most {max_depth} are allowed"


def header_deadline_protocol(read_timeout_s: float) -> type[asyncio.Protocol]:
    """uvicorn's HTTP protocol class with a deadline of ``read_timeout_s`` on each request's
    headers (module docstring). Pass it as ``uvicorn.Config(http=...)``."""
    from uvicorn.protocols.http.auto import AutoHTTPProtocol

    class HeaderDeadlineProtocol(AutoHTTPProtocol):  # type: ignore[misc, valid-type]
        _header_timer: asyncio.TimerHandle | None = None

        def connection_made(self, transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            self._arm_header_timer()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            self._arm_header_timer()  # the next request's headers (keep-alive) get the same deadline

        def connection_lost(self, exc: Exception | None) -> None:
            if self._header_timer is not None:
                self._header_timer.cancel()
                self._header_timer = None
            super().connection_lost(exc)

        def _arm_header_timer(self) -> None:
            if self._header_timer is not None:
                self._header_timer.cancel()
            self._header_timer = self.loop.call_later(read_timeout_s, self._headers_overdue)

        def _headers_overdue(self) -> None:
            self._header_timer = None
            if self.transport.is_closing():
                return
            if self.cycle is None or self.cycle.response_complete:  # no request's headers arrived in time
                self.transport.close()

    return HeaderDeadlineProtocol


def text_limit(tokenizer, max_context: int) -> int | None:
    """The most characters a text may have to be tokenised by the server: ``max_context``
    tokens of the vocabulary's longest piece (None if the tokenizer cannot list its vocabulary)."""
    try:
        longest = max(map(len, tokenizer.get_vocab()))
    except (AttributeError, TypeError, ValueError):
        return None
    return max_context * max(longest, 1)


def _lower_priority() -> None:
    """A tokenizer thread runs at nice +10 (on Linux niceness is per thread), so the engine's
    thread wins the core when both want it. Raising niceness needs no privilege."""
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 10)
    except (AttributeError, OSError):  # not Linux: same priority as the rest
        pass


class TokenizerFailed(Exception):
    """The tokenizer raised (or panicked) on one request's text or ids."""


def tokenizer_call(fn: Callable[..., Any], *args) -> Any:
    """``fn(*args)``, with any error of the tokenizers library (a Rust panic included, which
    is a ``BaseException``) raised as ``TokenizerFailed``."""
    try:
        return fn(*args)
    except BaseException as e:
        if isinstance(e, (KeyboardInterrupt, SystemExit, GeneratorExit)):
            raise
        raise TokenizerFailed(f"{type(e).__name__}: {str(e)[:300]}") from None


class TokenizerPool:
    """``/tokenize`` and ``/detokenize`` work: at most ``limit`` calls at once, each on its own
    thread (so none waits behind another); one more gets 429 before its text is touched.
    Event-loop only (``slot``)."""

    def __init__(self, limit: int):
        self.limit, self.in_flight = limit, 0
        self.executor = ThreadPoolExecutor(limit, thread_name_prefix="trainforge-tokenize",  # threads made on demand
                                           initializer=_lower_priority)

    def check(self) -> None:
        """429 if every slot is taken (before a body is read: the cheapest refusal)."""
        if self.in_flight >= self.limit:
            raise APIError(429, f"tokenizer busy: {self.in_flight} /tokenize or /detokenize requests running "
                           f"(limit {self.limit}, --max_tokenize_concurrent); retry later", "rate_limit_error",
                           code="rate_limit_exceeded")

    @contextmanager
    def slot(self):
        """Hold a slot (taken once the body has arrived: a slow client holds none) or raise 429."""
        self.check()
        self.in_flight += 1
        try:
            yield
        finally:
            self.in_flight -= 1

    async def run(self, fn: Callable[..., Any], *args) -> Any:
        return await asyncio.get_running_loop().run_in_executor(self.executor, tokenizer_call, fn, *args)
