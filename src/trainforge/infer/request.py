"""A generation request and what becomes of its sampled tokens: stop tokens, the length
limit, stop strings, and incremental detokenization for streaming.

Text is re-decoded from all output ids at each update (byte-level BPE can split a
character across tokens, so decoding tokens one by one would garble it). What is
streamed holds back a trailing U+FFFD (an unfinished UTF-8 sequence) and the last
len(stop) - 1 characters (the start of a stop string still being written), so streamed
text is never retracted and never shows a stop string.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Callable

from trainforge.infer.sampling import SamplingParams


@dataclass(eq=False)
class Request:
    """One generation. Read ``output_ids`` / ``text`` / ``finish_reason`` after ``done`` is set.
    ``on_update(request, new_ids, new_text, finished)`` is called from the engine's thread."""

    id: int
    prompt_ids: list[int]
    params: SamplingParams
    on_update: Callable[["Request", list[int], str, bool], None] | None = None
    output_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None  # "stop", "length" or "abort"
    created_s: float = field(default_factory=time.perf_counter)
    first_token_s: float | None = None
    finished_s: float | None = None
    done: threading.Event = field(default_factory=threading.Event)
    row: int | None = None  # the engine's batch row while running
    _sampled: int = 0  # tokens sampled so far (some maybe not read to the host yet)
    _abort: bool = False
    _emitted: int = 0  # characters of text already streamed

    @property
    def ttft_s(self) -> float | None:
        return None if self.first_token_s is None else self.first_token_s - self.created_s

    def add_tokens(self, ids: list[int], eos_ids: tuple[int, ...], tokenizer=None) -> tuple[list[int], str, str | None]:
        """Append sampled ``ids`` until one ends the request. Returns (ids kept, text to
        stream, finish reason or None). A stop token ends it and is not kept; a stop string
        ends it and cuts ``text`` before itself (``output_ids`` keep the tokens)."""
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
        delta = ""
        if tokenizer is not None:
            text = tokenizer.decode(self.output_ids)
            for s in p.stop:  # each cut shortens the text, so the earliest stop string wins
                at = text.find(s, max(0, self._emitted - len(s)))
                if at >= 0:
                    text, reason = text[:at], "stop"
            self.text = text
            safe = len(text)
            if reason is None:
                safe -= max((len(s) - 1 for s in p.stop), default=0)
                while safe > self._emitted and text[safe - 1] == "\ufffd":
                    safe -= 1
            safe = max(safe, self._emitted)
            delta, self._emitted = text[self._emitted:safe], safe
        return new, delta, reason
