"""A generation request and what becomes of its sampled tokens: stop tokens, the length
limit, stop strings, and incremental detokenization for streaming.

Text is decoded incrementally with ``tokenizers.decoders.DecodeStream``: each new token
costs a decode of a few tokens (a prefix window and the new ones), not of the whole output.
Re-decoding all output ids at every update, as this file did before, cost 990 ms of the
engine thread over a 2048-token answer against 8 ms (bench/detokenize.py). Byte-level BPE
can split a character across tokens; the stream returns nothing until the character is
complete, so streamed text never shows half a character. When the request ends, the text
is decoded once in full, so ``text`` is exactly ``tokenizer.decode(output_ids)`` (cut at a
stop string), including a trailing unfinished sequence that decodes to U+FFFD.

What is streamed also holds back the last len(stop) - 1 characters (the start of a stop
string still being written), so streamed text is never retracted and never shows a stop
string.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Callable

from trainforge.infer.sampling import SamplingParams

# One sampled token's log-probabilities: (logprob of the token, [(id, logprob), ...] top ones).
TokenLogprobs = tuple[float, list[tuple[int, float]]]


class _WindowDecoder:
    """``DecodeStream``'s algorithm for a tokenizer that is not a ``tokenizers.Tokenizer``
    (a test double with only ``decode``): decode a window of the last tokens with and
    without the new one; the difference is the new text, unless it ends in U+FFFD (an
    unfinished character), then wait for the next token."""

    def __init__(self):
        self.ids: list[int] = []
        self.prefix = self.read = 0

    def step(self, tokenizer, token_id: int) -> str | None:
        self.ids.append(token_id)
        before = tokenizer.decode(self.ids[self.prefix:self.read])
        after = tokenizer.decode(self.ids[self.prefix:])
        if after.endswith("\ufffd") or len(after) <= len(before):
            return None
        self.prefix, self.read = self.read, len(self.ids)
        return after[len(before):]


def decode_stream(tokenizer):
    """A fresh incremental decoder for ``tokenizer`` (``.step(tokenizer, id) -> str | None``),
    skipping special tokens as ``tokenizer.decode`` does by default."""
    try:
        from tokenizers import Tokenizer
        from tokenizers.decoders import DecodeStream
    except ImportError:  # pragma: no cover - tokenizers is a core dependency
        return _WindowDecoder()
    return DecodeStream(skip_special_tokens=True) if isinstance(tokenizer, Tokenizer) else _WindowDecoder()


@dataclass(eq=False)
class Request:
    """One generation. Read ``output_ids`` / ``text`` / ``finish_reason`` after ``done`` is set.
    ``on_update(request, new_ids, new_text, finished)`` is called from the engine's thread.
    With ``params.logprobs`` set, ``logprobs[i]`` belongs to ``output_ids[i]``."""

    id: int
    prompt_ids: list[int]
    params: SamplingParams
    on_update: Callable[["Request", list[int], str, bool], None] | None = None
    output_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None  # "stop", "length", "abort" (client gone) or "error" (see ``error``)
    error: str | None = None  # why the engine failed this request (finish_reason "error")
    created_s: float = field(default_factory=time.perf_counter)
    first_token_s: float | None = None
    finished_s: float | None = None
    done: threading.Event = field(default_factory=threading.Event)
    row: int | None = None  # the engine's batch row while running
    _sampled: int = 0  # tokens sampled so far (some maybe not read to the host yet)
    _abort: bool = False
    _emitted: int = 0  # characters of text already streamed
    _decoder: object = None  # the incremental decoder, made at the first token

    @property
    def ttft_s(self) -> float | None:
        return None if self.first_token_s is None else self.first_token_s - self.created_s

    def add_tokens(self, ids: list[int], eos_ids: tuple[int, ...], tokenizer=None,
                   logprobs: list[TokenLogprobs] | None = None) -> tuple[list[int], str, str | None]:
        """Append sampled ``ids`` (and their ``logprobs``, if asked for) until one ends the
        request. Returns (ids kept, text to stream, finish reason or None). A stop token ends
        it and is not kept; a stop string ends it and cuts ``text`` before itself
        (``output_ids`` keep the tokens)."""
        p = self.params
        new: list[int] = []
        reason = None
        for t in ids:
            if (t in eos_ids and not p.ignore_eos) or t in p.stop_token_ids:
                reason = "stop"
                break
            new.append(t)
            if len(self.output_ids) + len(new) >= p.max_new_tokens:
                reason = "length"
                break
        if self.first_token_s is None:
            self.first_token_s = time.perf_counter()
        self.output_ids.extend(new)
        if logprobs is not None:
            self.logprobs.extend(logprobs[:len(new)])
        delta = ""
        if tokenizer is not None:
            if self._decoder is None:
                self._decoder = decode_stream(tokenizer)
            text = self.text + "".join(c for c in (self._decoder.step(tokenizer, t) for t in new) if c)
            if reason is not None:  # once, at the end: exactly the full decode, unfinished bytes included
                text = tokenizer.decode(self.output_ids)
            for s in p.stop:  # each cut shortens the text, so the earliest stop string wins
                at = text.find(s, max(0, self._emitted - len(s)))
                if at >= 0:
                    text, reason = text[:at], "stop"
            self.text = text
            safe = len(text)
            if reason is None:
                safe -= max((len(s) - 1 for s in p.stop), default=0)
            safe = max(safe, self._emitted)
            delta, self._emitted = text[self._emitted:safe], safe
        return new, delta, reason
