"""Serving faults: a client that hangs up (streamed, not streamed, still queued) has its
request aborted and its batch row and KV blocks freed at once, as ``/metrics`` shows; a
burst of exactly ``max_concurrent`` requests is admitted in full and one more gets exactly
one 429; an overload far past capacity gets only 200s and 429s and leaves the server
healthy. A real uvicorn server on 127.0.0.1 (tests/infer/test_server.py's ``serving``)."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import socket
import time

import httpx
import pytest

from tests.infer.test_server import serving, wait_idle
from trainforge.data.tokenizer import eos_id, load_tokenizer
from trainforge.errors import ConfigError
from trainforge.infer.engine import Engine, EngineConfig
from trainforge.infer.sampling import SamplingParams
from trainforge.infer.server import ServerConfig, create_app
from trainforge.model import FLAVORS, build_model
from trainforge.monitor.sinks import read_exposition

BATCH, QUEUE = 2, 2  # engine bound: 4 requests running + waiting
LONG = 1000  # max_tokens of a request that must still be running when its client leaves


def make_engine(tok) -> Engine:
    model = build_model(dataclasses.replace(FLAVORS["debug"], vocab_size=tok.get_vocab_size(), max_seq_len=1024),
                        seed=0)
    return Engine(model, EngineConfig(max_batch_size=BATCH, max_queue=QUEUE, max_context=1024, block_size=16),
                  tokenizer=tok, eos_ids=(eos_id(tok),))


@pytest.fixture(scope="module")
def tok(small_data):
    return load_tokenizer(small_data / "tokenizer.json")


@pytest.fixture(scope="module")
def server(tok):
    engine = make_engine(tok)
    with serving(engine, tok, ServerConfig(model_name="tiny")) as url:
        yield url, engine


def metrics(url: str) -> dict[str, float]:
    """``/metrics`` as {name{labels}: value}, without the rank label."""
    return read_exposition(httpx.get(url + "/metrics", timeout=10).text)


def open_request(url: str, body: dict) -> socket.socket:
    """POST /v1/completions on a raw socket, so the test decides when the client hangs up."""
    host, port = url.removeprefix("http://").split(":")
    sock = socket.create_connection((host, int(port)), timeout=10)
    data = json.dumps(body).encode()
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                 b"Content-Length: %d\r\n\r\n%s" % (len(data), data))
    return sock


def wait_for(cond, timeout_s: float, what: str) -> float:
    """Poll ``cond`` every 20 ms; returns the seconds it took, fails after ``timeout_s``."""
    t0 = time.monotonic()
    while not cond():
        assert time.monotonic() - t0 < timeout_s, what
        time.sleep(0.02)
    return time.monotonic() - t0


@pytest.mark.parametrize("case", ["not_streamed", "streamed", "queued"])
def test_a_client_that_hangs_up_is_aborted_and_its_blocks_freed(server, case):
    url, engine = server
    wait_idle(engine)
    before = metrics(url)
    held = []
    if case == "queued":  # both batch rows busy, so the client's request waits in the queue
        held = [engine.submit([1, 2, 3], SamplingParams(max_new_tokens=LONG, temperature=0, ignore_eos=True))
                for _ in range(BATCH)]
    body = {"prompt": "def ", "max_tokens": LONG, "ignore_eos": True, "stream": case == "streamed"}
    sock = open_request(url, body)
    try:
        if case == "queued":
            wait_for(lambda: engine.stats()["waiting"] == 1, 10, "the request never queued")
        else:
            generated_before = before["trainforge_inference_generated_tokens_total"]
            wait_for(lambda: engine.counters["generated_tokens"] > generated_before, 10,
                     "the request never started decoding")
            if case == "streamed":
                assert sock.recv(64).startswith(b"HTTP/1.1 200")  # the response is under way
            m = metrics(url)
            assert m["trainforge_inference_running_requests"] == 1
            assert m["trainforge_kv_cache_block_utilization_ratio"] > 0
    finally:
        sock.close()  # the client hangs up mid-generation (or mid-wait)
    if case == "queued":
        wait_for(lambda: engine.stats()["waiting"] == 0, 5, "the queued request was not dropped")
        assert engine.stats()["running"] == BATCH  # the others keep their rows
        for req in held:
            engine.abort(req)

    def idle() -> bool:
        m = metrics(url)
        return (m["trainforge_inference_running_requests"] == m["trainforge_inference_waiting_requests"] == 0
                and m["trainforge_kv_cache_block_utilization_ratio"] == 0)

    freed_s = wait_for(idle, 5, "the disconnected request still holds its row or blocks")
    after = metrics(url)
    aborted = 'trainforge_inference_requests_finished_total{reason="abort"}'
    assert after[aborted] - before[aborted] == 1 + len(held)
    generated = (after["trainforge_inference_generated_tokens_total"]
                 - before["trainforge_inference_generated_tokens_total"])
    assert generated < (LONG if case != "queued" else 2 * LONG), generated  # stopped, not run to max_tokens
    if case == "queued":
        assert all(len(r.output_ids) < LONG for r in held)
    print(json.dumps({"case": case, "freed_within_s": round(freed_s, 3), "generated_tokens": generated}))


async def burst(url: str, n: int, max_tokens: int) -> list[httpx.Response]:
    """``n`` requests sent together; each decodes ``max_tokens`` so all are in flight at once."""
    body = {"prompt": "def ", "max_tokens": max_tokens, "ignore_eos": True, "temperature": 0}
    async with httpx.AsyncClient(base_url=url, timeout=60, limits=httpx.Limits(max_connections=n + 2)) as client:
        return await asyncio.gather(*(client.post("/v1/completions", json=body) for _ in range(n)))


@pytest.mark.parametrize("max_concurrent", [0, 3])  # 0: the engine's bound, BATCH + QUEUE
def test_a_burst_of_max_concurrent_is_admitted_and_one_more_gets_one_429(tok, max_concurrent):
    engine = make_engine(tok)
    n = max_concurrent or BATCH + QUEUE
    with serving(engine, tok, ServerConfig(model_name="tiny", max_concurrent=max_concurrent)) as url:
        for _ in range(2):  # a race-dependent miscount shows on some bursts only
            statuses = [r.status_code for r in asyncio.run(burst(url, n, 200))]
            assert statuses == [200] * n, statuses
            wait_idle(engine)
        responses = asyncio.run(burst(url, n + 1, 400))  # longer: the first must outlast the last arrival
        statuses = sorted(r.status_code for r in responses)
        assert statuses == [200] * n + [429], statuses
        refused = next(r for r in responses if r.status_code == 429)
        assert refused.json()["error"]["code"] == "rate_limit_exceeded"
        assert all(r.json()["usage"]["completion_tokens"] == 400 for r in responses if r.status_code == 200)
        assert engine.counters["peak_batch"] == BATCH  # the rest waited in the queue, as admitted


def test_max_concurrent_beyond_the_engines_bound_is_refused(tok):
    with pytest.raises(ConfigError, match=r"max_concurrent=5: .*max_queue = 4"):
        create_app(make_engine(tok), tok, ServerConfig(max_concurrent=BATCH + QUEUE + 1))


def test_overload_gets_only_200s_and_429s_and_the_server_stays_healthy(server):
    url, engine = server
    wait_idle(engine)
    clients, rounds = 16, 3  # 16 clients against 4 places

    async def client(i: int, http: httpx.AsyncClient) -> list[tuple[int, bool]]:
        seen = []
        for k in range(rounds):
            stream = (i + k) % 2 == 1
            if i % 4 == 3:
                path, body = "/v1/chat/completions", {"messages": [{"role": "user", "content": f"hi {i}"}]}
            else:
                path, body = "/v1/completions", {"prompt": f"def f{i}(", "ignore_eos": True}
            body.update(max_tokens=48, stream=stream, seed=i)
            async with http.stream("POST", path, json=body) as r:
                text = (await r.aread()).decode()
            complete = r.status_code != 200 or (text.rstrip().endswith("data: [DONE]") if stream
                                                 else json.loads(text)["usage"]["completion_tokens"] > 0)
            seen.append((r.status_code, complete))
        return seen

    async def main():
        async with httpx.AsyncClient(base_url=url, timeout=60, limits=httpx.Limits(max_connections=64)) as http:
            return await asyncio.gather(*(client(i, http) for i in range(clients)))

    results = [s for seen in asyncio.run(main()) for s in seen]
    statuses = [s for s, _ in results]
    assert set(statuses) <= {200, 429}, statuses
    assert statuses.count(429) >= 1 and statuses.count(200) >= BATCH + QUEUE, statuses
    assert all(complete for _, complete in results), results  # every 200 carried a whole answer
    assert httpx.get(url + "/health", timeout=5).json()["status"] == "ok"
    wait_idle(engine)
    m = metrics(url)
    assert m["trainforge_kv_cache_block_utilization_ratio"] == 0
    assert not [k for k in m if k.startswith("trainforge_http_requests_total") and 'status="5' in k], m
    r = httpx.post(url + "/v1/completions", json={"prompt": "def ", "max_tokens": 4}, timeout=30)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] >= 1
    print(json.dumps({"requests": len(statuses), "ok": statuses.count(200), "shed_429": statuses.count(429)}))
