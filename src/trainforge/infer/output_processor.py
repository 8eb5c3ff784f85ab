"""What the engine hands back per request: stop rules, detokenisation, streaming, callbacks.

A step gives ``append`` the token ids it sampled for a request (and their logprobs);
``Request.add_tokens`` (request.py) applies stop tokens, stop strings and the length limit
and detokenises incrementally. What a request streams is queued as an event; ``dispatch``
runs the requests' callbacks after the step, once finished requests' blocks are back in
the pool, so a callback that submits again finds room (vLLM v1's output processor likewise
runs outside the engine core's step).

An error one request causes (its detokenisation, its stop check) fails that request alone
(``fail``: finish reason "error", ``Request.error`` says why); a consumer's callback that
raises is ignored so it cannot stop the engine for everyone.
"""

from __future__ import annotations

import time

from trainforge.infer.request import Request


def contained(error: BaseException) -> bool:
    """Whether the engine contains ``error`` (fails the requests it belongs to) rather than let it
    end the engine thread: any ``Exception``, and the ``PanicException`` of a Rust panic in the
    tokenizers library, which derives from ``BaseException`` (a tokenizer.json regex that hits
    Oniguruma's retry limit raises one from ``decode``: uncaught, it ended the thread and every
    client waited forever). Not ``KeyboardInterrupt`` / ``SystemExit``."""
    return not isinstance(error, (KeyboardInterrupt, SystemExit, GeneratorExit))


class OutputProcessor:
    """Stops, text and callbacks for ``tokenizer`` (None: ids only) and stop ids ``eos_ids``;
    counts into ``counters`` (the engine's: generated tokens, finishes by reason)."""

    def __init__(self, tokenizer, eos_ids: tuple[int, ...], counters: dict[str, float]):
        self.tokenizer, self.eos_ids, self.counters = tokenizer, eos_ids, counters
        self.events: list[tuple[Request, list[int], str, bool]] = []

    def append(self, req: Request, ids: list[int], logprobs: list | None = None) -> None:
        """Hand sampled ids (and their logprobs) to ``req`` and queue what it streams.
        An error in its detokenisation or stop check fails ``req`` alone."""
        try:
            new, delta, reason = req.add_tokens(ids, self.eos_ids, self.tokenizer, logprobs)
        except BaseException as e:
            if not contained(e):
                raise
            return self.fail(req, e, "detokenising its output")
        self.counters["generated_tokens"] += len(new)
        if reason is not None:
            self.finish(req, reason, new, delta)
        elif new or delta:
            self.events.append((req, new, delta, False))

    def finish(self, req: Request, reason: str, new: list[int] | None = None, delta: str = "") -> None:
        req.finish_reason = reason
        req.finished_s = time.perf_counter()
        self.counters[f"finished_{reason}"] += 1
        self.events.append((req, new or [], delta, True))

    def fail(self, req: Request, error: BaseException, during: str) -> None:
        """End ``req`` alone (reason "error", ``req.error`` says why) after an error only it met;
        its row leaves with the step's finished rows. The others go on."""
        from trainforge.log import get_logger

        req.error = f"{during} failed: {type(error).__name__}: {str(error)[:300]}"
        get_logger().warning(f"engine: request {req.id} failed, the others go on: {req.error}")
        self.finish(req, "error")

    def dispatch(self) -> None:
        """Callbacks after the step, once finished requests' blocks are back in the pool."""
        events, self.events = self.events, []
        for req, ids, text, finished in events:
            if req.on_update is not None:
                try:
                    req.on_update(req, ids, text, finished)
                except BaseException as e:  # a consumer's bug must not stop the engine for everyone
                    if not contained(e):
                        raise
            if finished:
                req.done.set()
