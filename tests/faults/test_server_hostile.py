"""Hostile clients and hostile tokenizers against ``trainforge serve``: one request never
hurts another. An out-of-range seed is a 400 while a concurrent request finishes; a
request the engine fails (its detokenisation panics, its sampler setup raises) fails alone,
with a 500 or an error event, and the engine thread lives on; clients that trickle headers
or bodies hold no place and are cut after ``read_timeout_s``; ``/tokenize`` runs off the
event loop under its own limit; a 200,000-deep JSON body is a 400.

One real uvicorn server (module scope) on a "copy" model: every layer's output
projections are zero and the head is the (scaled) embedding, so a request's tokens are
its prompt's last token, repeated, whatever it samples. Its tokenizer is the small set's
BPE with two hostile regexes that only a run of 25+ "a"s trips (Oniguruma's retry limit:
a Rust panic, a ``BaseException``): one in the pre-tokenizer (encoding such text) and one
in the decoder (decoding the added token ``POISON``)."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import socket
import threading
import time
from types import SimpleNamespace

import httpx
import pytest
import torch
from safetensors.torch import save_file

from tests.faults.conftest import one_error_line, run_cli
from tests.infer.test_server import serving, wait_idle
from trainforge.data.tokenizer import eos_id, load_tokenizer
from trainforge.infer.engine import Engine, EngineConfig
from trainforge.infer.sampling import SamplingParams
from trainforge.infer.server import ServerConfig
from trainforge.model import FLAVORS, build_model
from trainforge.model.hf import to_hf_config_dict, to_hf_state_dict

POISON = "a" * 40 + "b"  # an added token; decoding it trips the decoder's regex
HOSTILE = r"(a+)+ZZZ$"  # never matches ordinary text; backtracks past Oniguruma's retry limit on a run of a's
READ_TIMEOUT_S = 2.0
BATCH, QUEUE, MAX_CONCURRENT = 2, 2, 2


def hostile_tokenizer(small_data):
    from tokenizers import Regex, decoders, pre_tokenizers

    tok = load_tokenizer(small_data / "tokenizer.json")
    tok.add_tokens([POISON])
    tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(HOSTILE), "isolated"), tok.pre_tokenizer])
    tok.decoder = decoders.Sequence([decoders.Replace(Regex(HOSTILE), ""), tok.decoder])
    return tok


def copy_model(vocab_size: int, max_seq_len: int = 256):
    """The debug flavor made to repeat its input token: zero residual updates, head = embedding
    scaled so the input token wins by hundreds of logits (any temperature samples it)."""
    model = build_model(dataclasses.replace(FLAVORS["debug"], vocab_size=vocab_size, max_seq_len=max_seq_len), seed=0)
    with torch.no_grad():
        for layer in model.layers.values():
            layer.attention.wo.weight.zero_()
            layer.feed_forward.w2.weight.zero_()
        emb = model.tok_embeddings.weight
        model.output.weight.copy_(emb / emb.norm(dim=1, keepdim=True) * 100)
    return model


class GatedTokenizer:
    """The app's tokenizer: the real one, except that encoding text that starts with "WAIT"
    blocks until the test opens ``gate`` (so a test can hold tokenizer calls in flight)."""

    def __init__(self, tok):
        self._tok, self.gate, self.entered = tok, threading.Event(), 0

    def encode(self, text, *args, **kw):
        if text.startswith("WAIT"):
            self.entered += 1
            self.gate.wait(20)
        return self._tok.encode(text, *args, **kw)

    def __getattr__(self, name):
        return getattr(self._tok, name)


def make_engine(tok) -> Engine:
    return Engine(copy_model(tok.get_vocab_size()),
                  EngineConfig(max_batch_size=BATCH, max_queue=QUEUE, max_context=256, block_size=16),
                  tokenizer=tok, eos_ids=(eos_id(tok),))


@pytest.fixture(scope="module")
def server(small_data):
    tok = hostile_tokenizer(small_data)
    engine = make_engine(tok)
    app_tok = GatedTokenizer(tok)
    config = ServerConfig(model_name="tiny", max_concurrent=MAX_CONCURRENT, read_timeout_s=READ_TIMEOUT_S,
                          max_tokenize_concurrent=2, max_body_bytes=1 << 20)
    with serving(engine, app_tok, config) as url:
        yield SimpleNamespace(url=url, engine=engine, tok=tok, app_tok=app_tok,
                              poison=tok.token_to_id(POISON), prompt=tok.encode("def parse(").ids)


async def post_all(url: str, bodies: list[tuple[str, dict]], stagger_s: float = 0.3,
                   timeout_s: float = 60) -> list[httpx.Response]:
    """POST each (path, body), the first at once and the rest ``stagger_s`` later (so the first
    is decoding when they arrive)."""
    async with httpx.AsyncClient(base_url=url, timeout=timeout_s) as http:
        async def one(i: int, path: str, body: dict) -> httpx.Response:
            await asyncio.sleep(stagger_s if i else 0)
            return await http.post(path, json=body)
        return await asyncio.gather(*(one(i, p, b) for i, (p, b) in enumerate(bodies)))


def well_behaved(s, max_tokens: int = 60) -> dict:
    return {"prompt": s.prompt, "max_tokens": max_tokens, "temperature": 0.8, "seed": 1, "ignore_eos": True}


def assert_completed(s, r: httpx.Response, max_tokens: int = 60) -> None:
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "length" and r.json()["usage"]["completion_tokens"] == max_tokens, r.text
    assert choice["text"] == s.tok.decode([s.prompt[-1]] * max_tokens)  # the copy model's answer, untouched


@pytest.mark.parametrize("seed", [2**64, -(2**63) - 1, 10**30])
def test_an_out_of_range_seed_is_a_400_and_a_concurrent_request_completes(server, seed):
    s = server
    wait_idle(s.engine)
    good, bad = asyncio.run(post_all(s.url, [("/v1/completions", well_behaved(s)),
                                             ("/v1/completions", {**well_behaved(s, 4), "seed": seed})]))
    assert bad.status_code == 400, bad.text
    assert bad.json()["error"]["param"] == "seed" and "'seed' must be an integer in" in bad.json()["error"]["message"]
    assert_completed(s, good)
    assert s.engine.counters.get("finished_error", 0) == 0 and s.engine.last_error is None


@pytest.mark.parametrize("stream", [False, True])
def test_a_request_whose_detokenisation_panics_fails_alone(server, stream):
    """The decoder's regex panics on the POISON token (a BaseException: uncaught, it ended the
    engine thread and every client waited forever): that request fails, the other finishes."""
    s = server
    wait_idle(s.engine)
    errors_before = s.engine.counters.get("finished_error", 0)
    poisoned = {"prompt": [*s.prompt, s.poison], "max_tokens": 8, "ignore_eos": True, "stream": stream}
    good, bad = asyncio.run(post_all(s.url, [("/v1/completions", well_behaved(s)), ("/v1/completions", poisoned)],
                                     timeout_s=20))
    assert_completed(s, good)
    if stream:  # the 200 is out before the failure: an error event, then [DONE]
        assert bad.status_code == 200
        events = [ln.removeprefix("data: ") for ln in bad.text.splitlines() if ln.startswith("data: ")]
        assert events[-1] == "[DONE]" and json.loads(events[-2])["error"]["code"] == "generation_error", bad.text
    else:
        assert bad.status_code == 500, bad.text
        err = bad.json()["error"]
        assert err["code"] == "generation_error" and "retry-limit-in-match" in err["message"], err
    assert s.engine.counters["finished_error"] == errors_before + 1
    # The engine thread lives on: a new request is served.
    r = httpx.post(s.url + "/v1/completions", json=well_behaved(s, 5), timeout=30)
    assert_completed(s, r, 5)


def test_a_prompt_that_trips_the_tokenizer_regex_is_a_400_and_the_server_goes_on(server):
    s = server
    for path, body in (("/v1/completions", {"prompt": "a" * 60 + "!", "max_tokens": 2}),
                       ("/v1/chat/completions", {"messages": [{"role": "user", "content": "a" * 60}]}),
                       ("/tokenize", {"prompt": "a" * 60})):
        r = httpx.post(s.url + path, json=body, timeout=30)
        assert r.status_code == 400, (path, r.text)
        assert "tokenizer failed" in r.json()["error"]["message"]
    assert_completed(s, httpx.post(s.url + "/v1/completions", json=well_behaved(s, 5), timeout=30), 5)


def test_a_failing_sampler_setup_fails_only_its_request_in_a_packed_prefill(small_data):
    """Two requests prefilled together (one pack); the sampler setup of one raises: it ends with
    "error", the other gets its tokens; run in the caller's thread (``Engine.generate``)."""
    tok = hostile_tokenizer(small_data)
    engine = make_engine(tok)
    set_row = engine.sampler.set_row

    def failing_set_row(row, params, prompt_ids):
        if params.seed == 13:
            raise RuntimeError("injected sampler fault")
        set_row(row, params, prompt_ids)

    engine.sampler.set_row = failing_set_row
    prompt = tok.encode("def parse(").ids
    bad, good = engine.generate([prompt, prompt], [SamplingParams(max_new_tokens=6, temperature=1.0, seed=13),
                                                   SamplingParams(max_new_tokens=6, temperature=1.0, seed=1)])
    assert bad.finish_reason == "error" and "injected sampler fault" in bad.error
    assert good.finish_reason == "length" and good.output_ids == [prompt[-1]] * 6
    assert engine.counters["peak_batch"] == 2 and not engine.has_work()
    assert engine.pool.utilisation()["blocks_reserved"] == 0


def raw(url: str) -> socket.socket:
    host, port = url.removeprefix("http://").split(":")
    return socket.create_connection((host, int(port)), timeout=10)


def test_slow_clients_hold_no_place_and_are_cut_after_the_read_timeout(server):
    s = server
    wait_idle(s.engine)
    body = json.dumps(well_behaved(s, 4)).encode()
    trickle_body = []
    for _ in range(MAX_CONCURRENT + 1):  # more than every place: headers and part of the body, then nothing
        sock = raw(s.url)
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: %d\r\n\r\n%s" % (len(body), body[:10]))
        trickle_body.append(sock)
    trickle_headers = raw(s.url)
    trickle_headers.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")  # headers never finished
    t0 = time.monotonic()
    time.sleep(0.3)  # the slow requests have reached the handler
    try:
        r = httpx.post(s.url + "/v1/completions", json=well_behaved(s, 5), timeout=30)
        assert_completed(s, r, 5)  # not 429: a body still arriving holds no place
        for sock in trickle_body:
            answer = sock.recv(4096)
            assert answer.startswith(b"HTTP/1.1 408"), answer
            while sock.recv(4096):  # then the server closes the connection
                pass
        trickle_headers.settimeout(READ_TIMEOUT_S + 5)
        assert trickle_headers.recv(4096) == b""  # closed, without an answer
        cut_s = time.monotonic() - t0
        assert READ_TIMEOUT_S - 0.5 < cut_s < READ_TIMEOUT_S + 5, cut_s
    finally:
        for sock in [*trickle_body, trickle_headers]:
            sock.close()
    assert httpx.get(s.url + "/health", timeout=5).status_code == 200


def test_tokenize_runs_off_the_event_loop_under_its_own_limit(server):
    s = server
    gate = s.app_tok.gate
    gate.clear()
    s.app_tok.entered = 0
    results: list[httpx.Response] = []
    held = [threading.Thread(target=lambda: results.append(
        httpx.post(s.url + "/tokenize", json={"prompt": "WAIT here"}, timeout=30))) for _ in range(2)]
    try:
        for t in held:
            t.start()
        deadline = time.monotonic() + 10
        while s.app_tok.entered < 2:  # both in the tokenizer at once: neither blocks the loop
            assert time.monotonic() < deadline, f"only {s.app_tok.entered} tokenize call(s) started"
            time.sleep(0.02)
        t0 = time.monotonic()
        assert httpx.get(s.url + "/health", timeout=5).status_code == 200
        assert time.monotonic() - t0 < 2.0
        third = httpx.post(s.url + "/tokenize", json={"prompt": "x"}, timeout=5)
        assert third.status_code == 429 and "max_tokenize_concurrent" in third.json()["error"]["message"]
        assert_completed(s, httpx.post(s.url + "/v1/completions", json=well_behaved(s, 5), timeout=30), 5)
    finally:
        gate.set()
        for t in held:
            t.join(timeout=30)
    assert [r.status_code for r in results] == [200, 200]
    # Longer than any prompt that fits the context: refused before it is tokenised.
    big = httpx.post(s.url + "/tokenize", json={"prompt": "WAIT" + "x" * 100_000}, timeout=5)
    assert big.status_code == 400 and big.json()["error"]["code"] == "context_length_exceeded", big.text
    assert s.app_tok.entered == 2


@pytest.mark.parametrize("case", ["200k_deep_array", "deep_field"])
def test_deeply_nested_json_is_a_400(server, case):
    s = server
    if case == "200k_deep_array":
        body = b"[" * 200_000 + b"]" * 200_000
    else:  # an ignored field, 5,000 deep
        body = b'{"prompt": "x", "max_tokens": 2, "user": ' + b"[" * 5000 + b"]" * 5000 + b"}"
    r = httpx.post(s.url + "/v1/completions", content=body, headers={"Content-Type": "application/json"},
                   timeout=30)
    assert r.status_code == 400, r.text[:300]
    assert "nests" in r.json()["error"]["message"]


def test_read_timeout_flag_is_validated_before_loading():
    r = run_cli(["serve", "--checkpoint", "nowhere", "--port", "0", "--read_timeout_s", "0"], timeout_s=60)
    assert r.returncode == 2
    assert "--read_timeout_s 0" in one_error_line(r.stderr) and "must be in" in r.stderr


@pytest.mark.parametrize("case", ["prompt", "output"])
def test_generate_with_a_hostile_tokenizer_regex_is_one_line(tmp_path, small_data, case):
    """``trainforge generate`` on a Hugging Face directory with the hostile tokenizer.json: a
    prompt that trips its pre-tokenizer, or an output token that trips its decoder, is one
    line naming the checkpoint (exit 2), not a Rust panic's traceback."""
    tok = hostile_tokenizer(small_data)
    model = copy_model(tok.get_vocab_size(), max_seq_len=64)
    hf = tmp_path / "hf"
    hf.mkdir()
    save_file({k: v.contiguous() for k, v in to_hf_state_dict(model.state_dict(), model.cfg).items()},
              str(hf / "model.safetensors"))
    (hf / "config.json").write_text(json.dumps(to_hf_config_dict(model.cfg)))
    tok.save(str(hf / "tokenizer.json"))
    prompt = ["--prompt", "a" * 60 + "!"] if case == "prompt" else ["--prompt_ids", f"1,2,{tok.token_to_id(POISON)}"]
    r = run_cli(["generate", "--checkpoint", str(hf), *prompt, "--max_new_tokens", "3"], timeout_s=90)
    assert r.returncode == 2, r.stderr[-2000:]
    line = one_error_line(r.stderr)
    assert str(hf) in line and "retry-limit-in-match" in line, line
