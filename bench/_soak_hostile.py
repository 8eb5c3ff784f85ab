"""The hostile clients of ``python -m bench.soak_serve --hostile``: each request is one of
the attacks below, and each has the answers a server that contains it may give. Anything
else (a 5xx, a wrong status, a slow client still connected well past ``read_timeout_s``) is
*unexpected* and fails the soak.

Slow clients (``slow_client``), each holding one connection at a time and reconnecting when
it is cut, alternate:

- ``slow_headers``: the request line and one header, then a byte every 0.7 s of a header
  that never ends. Expected: the server closes the connection at ``read_timeout_s``.
- ``slow_body``: headers announcing a 4,000-byte body, 10 bytes of it, then a byte every
  0.7 s. Expected: 408 at ``read_timeout_s``, then the connection closes; or only the close,
  at ``read_timeout_s``, when a byte the client sent as the server closed made the client's
  kernel drop the unread answer (a RST purges the receive queue). (On a server that admitted
  requests before their bodies, ``max_concurrent`` of these held every place.)

Fast attackers (``attacker``) draw at random:

- ``huge_seed``: ``"seed": 2**64`` (raised in the engine thread and aborted everyone). 400.
- ``deep_json``: a 200,000-deep array (``RecursionError``, a 500). 400.
- ``big_tokenize``: ``/tokenize`` on ~1 MiB of text just under ``--max_body_bytes`` (0.65 s
  of tokenizer on the event loop, and a 250,000-id answer). 400: longer than any prompt that
  fits the context.
- ``tokenize``: ``/tokenize`` on 40,000 characters (fits the debug model's context of 2,048
  tokens). 200, or 429 when ``--max_tokenize_concurrent`` are running.
- ``bad_json``: a body cut mid-object. 400.
- ``hang_up``: a valid 384-token request, then the connection closed 50-300 ms later.
  Nothing to read (or a 429 first).
- ``half_headers``: half a request line's headers, then the connection closed. Nothing.
"""

from __future__ import annotations

import asyncio
import json
import random
import time

import httpx

SLOW_KINDS = ("slow_headers", "slow_body")
FAST_KINDS = ("huge_seed", "deep_json", "big_tokenize", "tokenize", "bad_json", "hang_up", "half_headers")
EXPECTED = {"slow_headers": {"cut"}, "slow_body": {"408", "cut"}, "huge_seed": {"400"}, "deep_json": {"400"},
            "big_tokenize": {"400", "429"}, "tokenize": {"200", "429"}, "bad_json": {"400"},
            "hang_up": {"hung_up", "429"}, "half_headers": {"closed"}}
CUT_SLACK_S = 3.0  # a slow client must be cut within read_timeout_s + this


class HostileTally:
    def __init__(self):
        self.outcomes: dict[str, dict[str, int]] = {k: {} for k in EXPECTED}
        self.cut_s: list[float] = []  # slow clients: connect to cut
        self.unexpected: list[str] = []

    def add(self, kind: str, outcome: str) -> None:
        self.outcomes[kind][outcome] = self.outcomes[kind].get(outcome, 0) + 1
        if outcome not in EXPECTED[kind] and len(self.unexpected) < 10:
            self.unexpected.append(f"{kind}: {outcome}")

    def n_unexpected(self) -> int:
        return sum(n for kind, seen in self.outcomes.items() for o, n in seen.items() if o not in EXPECTED[kind])

    def summary(self) -> dict:
        return {"outcomes": self.outcomes, "unexpected": self.n_unexpected(), "unexpected_samples": self.unexpected,
                "slow_cut_s_max": round(max(self.cut_s), 2) if self.cut_s else None}


async def _close(writer: asyncio.StreamWriter) -> None:
    writer.close()
    try:
        await writer.wait_closed()
    except OSError:
        pass


async def _trickle(port: int, head: bytes, read_timeout_s: float) -> tuple[str, float]:
    """Send ``head``, then a byte every 0.7 s, until the server answers or closes. Returns the
    outcome ("cut": closed with no answer, "<status>": an answer, "not_cut": still open
    ``CUT_SLACK_S`` past the deadline) and the seconds it took."""
    t0 = time.monotonic()
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(head)
        await writer.drain()
        while time.monotonic() - t0 < read_timeout_s + CUT_SLACK_S:
            try:
                data = await asyncio.wait_for(reader.read(64), 0.7)
            except asyncio.TimeoutError:
                try:
                    writer.write(b"x")
                    await writer.drain()
                    continue
                except OSError:  # closed meanwhile: an answer may still be in the buffer
                    data = await asyncio.wait_for(reader.read(64), 1.0)
            if not data:
                return "cut", time.monotonic() - t0
            status = data.split(b" ", 2)[1].decode() if data.startswith(b"HTTP/1.1 ") else "garbage"
            while await asyncio.wait_for(reader.read(4096), CUT_SLACK_S):  # then it must close
                pass
            return status, time.monotonic() - t0
        return "not_cut", time.monotonic() - t0
    except (OSError, asyncio.TimeoutError) as e:
        return ("cut" if isinstance(e, ConnectionError) else f"error {type(e).__name__}"), time.monotonic() - t0
    finally:
        await _close(writer)


async def slow_client(i: int, port: int, deadline: float, tally: HostileTally, read_timeout_s: float) -> None:
    body = json.dumps({"prompt": "def parse(", "max_tokens": 8}).encode().ljust(4000)
    k = i
    while time.monotonic() < deadline:
        kind = SLOW_KINDS[k % 2]
        k += 1
        if kind == "slow_headers":
            head = b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: "
        else:
            head = (b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                    b"Content-Length: %d\r\n\r\n%s" % (len(body), body[:10]))
        outcome, took = await _trickle(port, head, read_timeout_s)
        if outcome in ("cut", "408") and took < read_timeout_s - 0.5:
            outcome += " early"  # before the deadline: not what the server promises either
        if outcome in EXPECTED[kind]:
            tally.cut_s.append(took)
        tally.add(kind, outcome)


async def _raw_close(port: int, data: bytes, wait_s: float) -> str:
    """Send ``data``, close after ``wait_s`` (or at once); "429" if that came back first."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(data)
        await writer.drain()
        if not wait_s:
            return "closed"
        try:
            line = await asyncio.wait_for(reader.readline(), wait_s)
        except asyncio.TimeoutError:
            line = b""
        return "429" if b" 429 " in line else "hung_up"
    finally:
        await _close(writer)


async def attacker(i: int, url: str, port: int, deadline: float, tally: HostileTally, max_body_bytes: int) -> None:
    rng = random.Random(1000 + i)
    big = ("def parse(x): return x " * (max_body_bytes // 23))[:max_body_bytes - 64]  # no escapes: JSON adds 16 bytes
    fits = big[:40_000]
    deep = b"[" * 200_000 + b"]" * 200_000
    async with httpx.AsyncClient(base_url=url, timeout=60) as http:
        while time.monotonic() < deadline:
            kind = rng.choice(FAST_KINDS)
            try:
                if kind == "huge_seed":
                    r = await http.post("/v1/completions", json={"prompt": "def ", "max_tokens": 8, "seed": 2**64})
                elif kind == "deep_json":
                    r = await http.post("/v1/completions", content=deep, headers={"Content-Type": "application/json"})
                elif kind in ("big_tokenize", "tokenize"):
                    r = await http.post("/tokenize", json={"prompt": big if kind == "big_tokenize" else fits})
                elif kind == "bad_json":
                    r = await http.post("/v1/completions", content=b'{"prompt": "x", "max_tokens": ',
                                        headers={"Content-Type": "application/json"})
                elif kind == "hang_up":
                    body = json.dumps({"prompt": "import os\n", "max_tokens": 384, "ignore_eos": True}).encode()
                    outcome = await _raw_close(port, b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                                               b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n%s"
                                               % (len(body), body), rng.uniform(0.05, 0.3))
                    tally.add(kind, outcome)
                    continue
                else:  # half_headers
                    tally.add(kind, await _raw_close(port, b"POST /v1/completions HTTP/1.1\r\nHo", 0))
                    continue
                tally.add(kind, str(r.status_code))
            except (httpx.HTTPError, OSError) as e:
                tally.add(kind, f"error {type(e).__name__}")
            await asyncio.sleep(rng.uniform(0.0, 0.1))
