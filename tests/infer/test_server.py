"""``trainforge serve``: the official ``openai`` client talks to it (completions, chat,
streaming); each bad request gets its status code in OpenAI's error envelope; a client
that disconnects frees its slot and KV blocks; /health stays fast under load."""

from __future__ import annotations

import dataclasses
import json
import threading
import time
from contextlib import contextmanager
from types import SimpleNamespace

import httpx
import openai
import pytest
import uvicorn

from trainforge.data.tokenizer import eos_id, load_tokenizer
from trainforge.infer.engine import Engine, EngineConfig, QueueFull
from trainforge.infer.sampling import SamplingParams
from trainforge.infer.server import ServerConfig, create_app, uvicorn_config
from trainforge.model import FLAVORS, build_model
from trainforge.monitor.sinks import read_exposition

KEY = "sekret"


def tiny_model(vocab_size: int):
    return build_model(dataclasses.replace(FLAVORS["debug"], vocab_size=vocab_size, max_seq_len=128), seed=0)


@contextmanager
def serving(engine, tok, config: ServerConfig):
    """The app on 127.0.0.1 (a free port) in a uvicorn thread, the engine stepping in its own;
    yields the base URL (tests/faults/test_server_faults.py uses it too)."""
    app = create_app(engine, tok, config)
    engine.start()
    srv = uvicorn.Server(uvicorn_config(app, config, host="127.0.0.1", port=0))  # as `trainforge serve` runs it
    thread = threading.Thread(target=srv.run, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 30
        while not srv.started and time.monotonic() < deadline:
            time.sleep(0.05)
        port = srv.servers[0].sockets[0].getsockname()[1]
        yield f"http://127.0.0.1:{port}"
    finally:
        srv.should_exit = True
        thread.join(timeout=10)
        engine.stop()


@pytest.fixture(scope="module")
def server(small_data):
    tok = load_tokenizer(small_data / "tokenizer.json")
    engine = Engine(tiny_model(tok.get_vocab_size()), EngineConfig(max_batch_size=4, max_queue=4, max_context=128,
                                                                   block_size=8),
                    tokenizer=tok, eos_ids=(eos_id(tok),))
    with serving(engine, tok, ServerConfig(api_key=KEY, model_name="tiny", max_body_bytes=4096)) as url:
        yield SimpleNamespace(url=url, engine=engine, tok=tok,
                              client=openai.OpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0),
                              http=httpx.Client(base_url=url, headers={"Authorization": f"Bearer {KEY}"}, timeout=30))


def expected_greedy(server, prompt_ids: list[int], n: int) -> str:
    engine = Engine(tiny_model(server.tok.get_vocab_size()), EngineConfig(max_batch_size=1, max_context=128),
                    tokenizer=server.tok, eos_ids=server.engine.eos_ids)
    return engine.generate([prompt_ids], SamplingParams(max_new_tokens=n, temperature=0))[0].text


def wait_idle(engine, timeout_s=10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while engine.load() or engine.pool.utilisation()["blocks_reserved"]:
        assert time.monotonic() < deadline, engine.stats()
        time.sleep(0.02)


def test_openai_client_completions_chat_and_streaming(server):
    c = server.client
    assert [m.id for m in c.models.list().data] == ["tiny"]
    want = expected_greedy(server, server.tok.encode("def main(").ids, 12)
    r = c.completions.create(model="tiny", prompt="def main(", max_tokens=12, temperature=0)
    assert r.choices[0].text == want and r.choices[0].finish_reason in ("stop", "length")
    assert r.usage.prompt_tokens == len(server.tok.encode("def main(").ids) and 0 < r.usage.completion_tokens <= 12
    chunks = list(c.completions.create(model="tiny", prompt="def main(", max_tokens=12, temperature=0, stream=True))
    assert "".join(ch.choices[0].text for ch in chunks) == want
    assert chunks[-1].choices[0].finish_reason == r.choices[0].finish_reason

    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Say hi"}]
    chat = c.chat.completions.create(model="tiny", messages=messages, max_tokens=10, temperature=0)
    content = chat.choices[0].message.content
    assert chat.choices[0].message.role == "assistant" and content
    stream = list(c.chat.completions.create(model="tiny", messages=messages, max_tokens=10, temperature=0,
                                            stream=True))
    assert stream[0].choices[0].delta.role == "assistant"
    assert "".join(ch.choices[0].delta.content or "" for ch in stream) == content
    # The raw stream is server-sent events ending with [DONE].
    with server.http.stream("POST", "/v1/completions", json={"prompt": "x", "max_tokens": 3, "stream": True}) as s:
        lines = [ln for ln in s.iter_lines() if ln]
    assert lines[-1] == "data: [DONE]" and all(ln.startswith("data: ") for ln in lines)
    with pytest.raises(openai.BadRequestError, match="context"):
        c.completions.create(model="tiny", prompt="x", max_tokens=500)


@pytest.mark.parametrize("case", ["no_key", "wrong_key", "bad_json", "not_object", "no_prompt", "bad_temperature",
                                  "n", "too_long", "unknown_model", "unknown_path", "too_big", "too_big_chunked"])
def test_bad_requests_get_their_status_and_the_error_envelope(server, case):
    h = server.http
    auth = {"Authorization": f"Bearer {KEY}"}
    ok = {"prompt": "def ", "max_tokens": 2}
    send = {
        "no_key": lambda: httpx.post(server.url + "/v1/completions", json=ok),
        "wrong_key": lambda: httpx.post(server.url + "/v1/models", headers={"Authorization": "Bearer nope"}),
        "bad_json": lambda: h.post("/v1/completions", content=b"{not json", headers=auth),
        "not_object": lambda: h.post("/v1/completions", json=[1, 2]),
        "no_prompt": lambda: h.post("/v1/completions", json={"max_tokens": 2}),
        "bad_temperature": lambda: h.post("/v1/completions", json={**ok, "temperature": -1}),
        "n": lambda: h.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}], "n": 0}),
        "too_long": lambda: h.post("/v1/completions", json={"prompt": "x", "max_tokens": 128}),
        "unknown_model": lambda: h.post("/v1/completions", json={**ok, "model": "gpt-9"}),
        "unknown_path": lambda: h.get("/v1/nothing"),
        "too_big": lambda: h.post("/v1/completions", json={"prompt": "x" * 5000}),
        "too_big_chunked": lambda: h.post("/v1/completions", content=iter([b'{"prompt": "', b"x" * 5000, b'"}'])),
    }[case]
    status = {"no_key": 401, "wrong_key": 401, "unknown_model": 404, "unknown_path": 404, "too_big": 413,
              "too_big_chunked": 413}.get(case, 400)
    r = send()
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    if case == "too_long":
        assert err["code"] == "context_length_exceeded"
    if case == "bad_temperature":
        assert err["param"] == "temperature"


def test_over_the_concurrency_limit_is_a_fast_429(server):
    engine = server.engine
    held = []
    long = SamplingParams(max_new_tokens=100, temperature=0, ignore_eos=True)
    while len(held) < 8:  # 4 running + 4 waiting; the queue takes 4 at a time
        try:
            held.append(engine.submit([1, 2, 3], long))
        except QueueFull:
            time.sleep(0.01)
    try:
        assert engine.load() >= 8
        t0 = time.perf_counter()
        r = server.http.post("/v1/completions", json={"prompt": "x", "max_tokens": 2})
        assert r.status_code == 429 and r.json()["error"]["code"] == "rate_limit_exceeded"
        assert time.perf_counter() - t0 < 1.0
        with pytest.raises(openai.RateLimitError):
            server.client.completions.create(model="tiny", prompt="x", max_tokens=2)
    finally:
        for req in held:
            engine.abort(req)
    wait_idle(engine)


def test_a_client_disconnect_aborts_and_frees_the_slot(server):
    engine = server.engine
    wait_idle(engine)
    aborted = engine.counters["finished_abort"]
    body = {"prompt": "def ", "max_tokens": 120, "stream": True, "temperature": 1.0, "seed": 1, "ignore_eos": True}
    with httpx.stream("POST", server.url + "/v1/completions", json=body,
                      headers={"Authorization": f"Bearer {KEY}"}, timeout=30) as s:
        next(s.iter_lines())  # the first event: the request is running
        assert engine.load() == 1 and engine.pool.utilisation()["blocks_used"] > 0
    # Leaving the block closed the connection mid-stream.
    wait_idle(engine)
    assert engine.counters["finished_abort"] == aborted + 1
    assert engine.pool.utilisation()["blocks_used"] == 0


def test_health_stays_ok_under_load_and_metrics_report(server):
    engine = server.engine
    wait_idle(engine)
    results = []
    enough = threading.Event()  # set once /health has been checked often enough while the batch ran

    def client():
        # Request after request until the checker has seen enough: how long one batch of 100
        # tokens lasts depends on the machine (a fast one finished it within one check), so
        # the load is held until the checks are done, not for a fixed number of tokens.
        while not enough.is_set():
            r = server.http.post("/v1/completions", json={"prompt": "import", "max_tokens": 100, "temperature": 1.0,
                                                          "seed": 2, "ignore_eos": True})
            results.append(r.status_code)

    threads = [threading.Thread(target=client) for _ in range(4)]  # a full batch (more could see 429)
    for t in threads:
        t.start()
    deadline = time.monotonic() + 10
    while engine.load() < 4 and time.monotonic() < deadline:
        time.sleep(0.01)
    latencies, busy = [], []
    deadline = time.monotonic() + 60
    try:
        with httpx.Client(base_url=server.url, timeout=5) as health:  # no key needed
            while sum(b >= 2 for b in busy) < 20 and time.monotonic() < deadline:
                busy.append(engine.load())
                t0 = time.perf_counter()
                r = health.get("/health")
                latencies.append(time.perf_counter() - t0)
                assert r.status_code == 200 and r.json()["status"] == "ok"
    finally:  # a failed check must stop the clients, not leave them (and the test) running
        enough.set()
        for t in threads:
            t.join()
    assert results == [200] * len(results) and len(results) >= 4, results
    assert sum(b >= 2 for b in busy) >= 20, busy  # checks that ran while the engine was decoding a batch
    assert max(latencies) < 1.0, latencies
    # /metrics: the monitoring registry's names (monitor/catalog.py) and values that add up.
    metrics = read_exposition(server.http.get("/metrics").text, drop_labels=())
    s = engine.stats()
    assert metrics['trainforge_inference_generated_tokens_total{rank="0"}'] == s["generated_tokens"] >= 100 * len(results)
    assert metrics['trainforge_inference_requests_finished_total{rank="0",reason="length"}'] >= len(results)
    assert metrics['trainforge_kv_cache_block_utilization_ratio{rank="0"}'] == 0.0  # all requests done
    assert metrics['trainforge_kv_cache_blocks_capacity{rank="0"}'] == engine.pool.usable_blocks
    assert metrics['trainforge_inference_time_to_first_token_seconds_count{rank="0"}'] >= len(results)
    assert metrics['trainforge_http_requests_total{path="/health",rank="0",status="200"}'] >= len(latencies)
    print(json.dumps({"health_latency_max_s": round(max(latencies), 4), "checks": len(busy), "requests": len(results)}))
