"""OpenAI request fields -> engine parameters, and engine results -> OpenAI response
fields: the parsing and formatting half of ``server.py``, with no HTTP in it.

Errors are ``APIError``s in OpenAI's envelope ``{"error": {"message", "type", "param",
"code"}}``; a bad value names its field in ``param`` and in the message.

Log-probabilities are the model's raw ``log_softmax`` (before repetition penalty,
temperature, top-k, top-p: see ``sampling.py``), as vLLM reports them by default.
``/v1/completions`` takes an integer ``logprobs`` (the top-k count, up to 20 as in vLLM;
OpenAI's legacy API stops at 5) and answers ``{tokens, token_logprobs, top_logprobs,
text_offset}``; ``/v1/chat/completions`` takes ``logprobs: true`` and ``top_logprobs: k``
and answers ``{content: [{token, logprob, bytes, top_logprobs}]}``.
"""

from __future__ import annotations

import math
import reprlib
from dataclasses import dataclass
from typing import Any

from trainforge.infer.request import decode_stream
from trainforge.infer.sampling import SamplingParams


class APIError(Exception):
    def __init__(self, status: int, message: str, type_: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code
        self.headers = headers  # extra response headers ("Connection: close" after a read timeout)

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


# A rejected value in an error message: a few items and characters, never a 1 MiB list.
_short = reprlib.Repr()
_short.maxlevel, _short.maxlist, _short.maxdict, _short.maxstring, _short.maxlong = 2, 4, 4, 40, 40

INT64 = (-(1 << 63), (1 << 63) - 1)  # OpenAI's and vLLM's seed: a 64-bit signed integer


def _field(body: dict, key: str, types: tuple, default: Any, ok=None, want: str = "") -> Any:
    value = body.get(key, default)
    if value is None:
        return default
    if isinstance(value, bool) and bool not in types or not isinstance(value, types) or (ok and not ok(value)):
        raise APIError(400, f"'{key}' must be {want}, got {_short.repr(value)}", param=key)
    return value


@dataclass(frozen=True)
class Choices:
    """How many completions a request wants and how they are streamed."""

    n: int = 1
    stream: bool = False
    include_usage: bool = False  # stream_options.include_usage: a last chunk with usage, empty choices
    tokens_as_ids: bool = False  # vLLM's return_tokens_as_token_ids: logprobs tokens as "token_id:ID"


def choices_of(body: dict, max_n: int) -> Choices:
    """``n`` (each choice is its own engine request, so at most ``max_n``, the engine's
    running + waiting bound), ``stream`` and ``stream_options``."""
    n = _field(body, "n", (int,), 1, lambda v: 1 <= v <= max_n, f"an integer in [1, {max_n}] (the server's "
               "max_batch_size + max_queue)")
    if body.get("best_of") not in (None, 1, n):
        raise APIError(400, "'best_of' is not supported by this server", param="best_of")
    stream = _field(body, "stream", (bool,), False, want="a boolean")
    options = body.get("stream_options")
    if options is not None:
        if not stream:
            raise APIError(400, "'stream_options' is only allowed when 'stream' is true", param="stream_options")
        if not isinstance(options, dict):
            raise APIError(400, f"'stream_options' must be an object, got {options!r}", param="stream_options")
    usage = _field(options or {}, "include_usage", (bool,), False, want="a boolean")
    as_ids = _field(body, "return_tokens_as_token_ids", (bool,), False, want="a boolean")
    return Choices(n=n, stream=stream, include_usage=usage, tokens_as_ids=as_ids)


def _logprobs_k(body: dict, chat: bool) -> int | None:
    top = SamplingParams.MAX_LOGPROBS
    if not chat:  # legacy completions: an integer, the number of top tokens
        return _field(body, "logprobs", (int,), None, lambda v: 0 <= v <= top, f"an integer in [0, {top}]")
    wanted = _field(body, "logprobs", (bool,), False, want="a boolean")
    k = _field(body, "top_logprobs", (int,), None, lambda v: 0 <= v <= top, f"an integer in [0, {top}]")
    if k is not None and not wanted:
        raise APIError(400, "'top_logprobs' needs 'logprobs': true", param="top_logprobs")
    return (k or 0) if wanted else None


def sampling_params(body: dict, default_max_tokens: int, chat: bool = False) -> SamplingParams:
    """OpenAI request fields -> ``SamplingParams`` (``top_k``, ``repetition_penalty`` and
    ``ignore_eos`` are extensions, spelled as vLLM spells them)."""
    num = (int, float)
    if body.get("echo"):
        raise APIError(400, "'echo' is not supported by this server", param="echo")
    for key in ("presence_penalty", "frequency_penalty"):
        if _field(body, key, num, 0) != 0:
            raise APIError(400, f"'{key}' is not supported (use 'repetition_penalty')", param=key)
    max_tokens = body.get("max_completion_tokens", body.get("max_tokens", default_max_tokens))
    max_tokens = _field({"max_tokens": max_tokens}, "max_tokens", (int,), default_max_tokens, lambda v: v >= 1,
                        "an integer >= 1")
    stop = body.get("stop")
    if isinstance(stop, str):
        stop = [stop]
    if stop is not None and (not isinstance(stop, list) or len(stop) > 4
                             or not all(isinstance(s, str) and s for s in stop)):
        raise APIError(400, "'stop' must be a non-empty string or a list of at most 4", param="stop")
    return SamplingParams(
        max_new_tokens=max_tokens,
        temperature=float(_field(body, "temperature", num, 1.0, lambda v: 0 <= v <= 2, "a number in [0, 2]")),
        top_p=float(_field(body, "top_p", num, 1.0, lambda v: 0 < v <= 1, "a number in (0, 1]")),
        top_k=_field(body, "top_k", (int,), 0, lambda v: v >= 0, "an integer >= 0"),
        repetition_penalty=float(_field(body, "repetition_penalty", num, 1.0, lambda v: v > 0 and math.isfinite(v),
                                        "a finite number > 0")),
        stop=tuple(stop or ()),
        ignore_eos=_field(body, "ignore_eos", (bool,), False, want="a boolean"),
        # Checked here, before admission: out of torch's range it raised in the engine thread.
        seed=_field(body, "seed", (int,), None, lambda v: INT64[0] <= v <= INT64[1],
                    f"an integer in [{INT64[0]}, {INT64[1]}]"),
        logprobs=_logprobs_k(body, chat),
    )


def chat_prompt(messages: Any) -> str:
    """OpenAI chat messages -> one prompt string (``role: content`` lines, then ``assistant:``)."""
    if not isinstance(messages, list) or not messages:
        raise APIError(400, "'messages' must be a non-empty list", param="messages")
    lines = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise APIError(400, f"messages[{i}] must be an object with a 'role'", param="messages")
        content = m.get("content")
        if isinstance(content, list):  # content parts: keep the text ones
            texts = [p.get("text") for p in content if isinstance(p, dict) and p.get("type") == "text"]
            if not all(isinstance(t, str) for t in texts):
                raise APIError(400, f"messages[{i}].content: a text part's 'text' must be a string", param="messages")
            content = "".join(texts)
        if not isinstance(content, str):
            raise APIError(400, f"messages[{i}].content must be a string", param="messages")
        lines.append(f"{m['role']}: {content}\n")
    return "".join(lines) + "assistant:"


# -- log-probabilities -----------------------------------------------------------------------

def _bytes_to_unicode() -> dict[str, int]:
    """GPT-2's byte-level alphabet inverted: the character a byte-level BPE piece uses -> its byte."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), 256))
    cs, extra = list(bs), 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + extra)
            extra += 1
    return {chr(c): b for b, c in zip(bs, cs)}


_BYTE_OF = _bytes_to_unicode()


class TokenText:
    """A token's text and UTF-8 bytes. A byte-level BPE token may hold part of a character:
    its bytes come from the piece itself (its text is then U+FFFD, as a one-token decode gives)."""

    def __init__(self, tokenizer, as_ids: bool = False):
        from tokenizers import decoders

        self.tokenizer, self.as_ids = tokenizer, as_ids
        self.byte_level = isinstance(getattr(tokenizer, "decoder", None), decoders.ByteLevel)
        self._cache: dict[int, tuple[str, list[int]]] = {}

    def __call__(self, token_id: int) -> tuple[str, list[int]]:
        hit = self._cache.get(token_id)
        if hit is None:
            text = self.tokenizer.decode([token_id])
            piece = self.tokenizer.id_to_token(token_id) if self.byte_level else None
            if piece is not None and all(c in _BYTE_OF for c in piece):
                raw = [_BYTE_OF[c] for c in piece]
            else:
                raw = list(text.encode())
            hit = self._cache[token_id] = (text, raw)
        return (f"token_id:{token_id}", hit[1]) if self.as_ids else hit


class TextOffsets:
    """Character offset in the decoded text where each token's text starts, fed the
    tokens in order (a streamed choice calls it per chunk). Tokens that each hold part of
    one character are all placed where the character starts; a whole token released
    together with earlier pending bytes (an invalid sequence) sits after them."""

    def __init__(self, tokenizer):
        self.tokenizer, self.stream, self.at = tokenizer, decode_stream(tokenizer), 0

    def __call__(self, ids: list[int]) -> list[int]:
        offsets = []
        for t in ids:
            chunk = self.stream.step(self.tokenizer, t) or ""
            own = self.tokenizer.decode([t])
            whole = chunk and own and "\ufffd" not in own and chunk.endswith(own)
            offsets.append(self.at + len(chunk) - len(own) if whole else self.at)
            self.at += len(chunk)
        return offsets


def completion_logprobs(token_text: TokenText, ids: list[int], lps: list, offsets: list[int]) -> dict:
    """The legacy completions ``logprobs`` object for tokens ``ids``."""
    out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": offsets}
    for t, (lp, top) in zip(ids, lps):
        out["tokens"].append(token_text(t)[0])
        out["token_logprobs"].append(lp)
        top_map: dict[str, float] = {}
        for tid, v in top:  # two ids can decode alike (U+FFFD): keep the likelier, as a dict must
            top_map.setdefault(token_text(tid)[0], v)
        out["top_logprobs"].append(top_map)
    return out


def chat_logprobs(token_text: TokenText, ids: list[int], lps: list) -> dict:
    """The chat ``logprobs`` object: ``{"content": [{token, logprob, bytes, top_logprobs}]}``."""
    def entry(t: int, v: float) -> dict:
        text, raw = token_text(t)
        return {"token": text, "logprob": v, "bytes": raw}

    return {"content": [{**entry(t, lp), "top_logprobs": [entry(tid, v) for tid, v in top]}
                        for t, (lp, top) in zip(ids, lps)]}
