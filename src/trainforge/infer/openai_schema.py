"""Engine results -> OpenAI response fields, and OpenAI's error envelope: the formatting
half of the server, with no HTTP in it (the request bodies are ``server_protocol.py``).

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

from typing import Any

from trainforge.infer.request import decode_stream


class APIError(Exception):
    def __init__(self, status: int, message: str, type_: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code
        self.headers = headers  # extra response headers ("Connection: close" after a read timeout)

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


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
