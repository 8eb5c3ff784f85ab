"""Starting ``trainforge serve``: a busy port fails at once, before anything loads, with one
line naming the address and ``--port`` (exit 2); the startup banner says where, what and
how much; every request gets an access-log line (method, path, status, ms, tokens) unless
``--no_access_log``."""

from __future__ import annotations

import logging
import os
import re
import signal
import socket
import subprocess
import sys
import time

import httpx
import pytest

from tests.infer.test_server import KEY, serving, tiny_model
from trainforge import exit_codes
from trainforge.data.tokenizer import eos_id, load_tokenizer
from trainforge.errors import TrainforgeError
from trainforge.infer.engine import Engine, EngineConfig
from trainforge.infer.listen import bind_socket
from trainforge.infer.server import ServerConfig
from trainforge.infer.server_extras import ACCESS_LOGGER, banner
from trainforge.log import get_logger


def test_a_busy_port_fails_at_once_before_the_model_loads():
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        times = []
        for _ in range(3):
            t0 = time.perf_counter()
            # No such checkpoint: had it tried to load one first, the error would name the checkpoint.
            r = subprocess.run([sys.executable, "-m", "trainforge", "serve", "--checkpoint", "/no/such/run", "--port",
                                str(port)], capture_output=True, text=True, timeout=60)
            times.append(time.perf_counter() - t0)
            assert r.returncode == exit_codes.BAD_INPUT == 2
            lines = r.stderr.strip().splitlines()
            assert len(lines) == 1 and f"127.0.0.1:{port}" in lines[0] and "--port" in lines[0], r.stderr
            assert "no/such/run" not in r.stderr
        # Measured 0.15-0.3 s here (the interpreter's own start included; torch and FastAPI are imported
        # only after the bind); 3 s leaves room for a loaded CI machine and still fails an import of torch first.
        assert min(times) < 3.0, times
        with pytest.raises(TrainforgeError, match=f"127.0.0.1:{port}.*--port"):
            bind_socket("127.0.0.1", port)


@pytest.fixture(scope="module")
def tok(small_data):
    return load_tokenizer(small_data / "tokenizer.json")


def engine_for(tok) -> Engine:
    return Engine(tiny_model(tok.get_vocab_size()), EngineConfig(max_batch_size=2, max_queue=2, max_context=128,
                                                                 block_size=8), tokenizer=tok, eos_ids=(eos_id(tok),))


class Lines(logging.Handler):
    def __init__(self):
        super().__init__()
        self.lines: list[str] = []

    def emit(self, record):
        self.lines.append(record.getMessage())


@pytest.mark.parametrize("access_log", [True, False])
def test_an_access_log_line_per_request_unless_turned_off(tok, access_log):
    log = get_logger(ACCESS_LOGGER)  # as the server sets it up (INFO, to stderr); the test listens beside it
    handler = Lines()
    log.addHandler(handler)
    try:
        with serving(engine_for(tok), tok, ServerConfig(api_key=KEY, access_log=access_log)) as url:
            auth = {"Authorization": f"Bearer {KEY}"}
            httpx.post(url + "/v1/completions", json={"prompt": "def ", "max_tokens": 5, "temperature": 0,
                                                      "ignore_eos": True}, headers=auth, timeout=30)
            with httpx.stream("POST", url + "/v1/completions", headers=auth, timeout=30,
                              json={"prompt": "def ", "max_tokens": 3, "stream": True, "ignore_eos": True}) as s:
                list(s.iter_lines())
            httpx.get(url + "/v1/models")  # no key: 401
            httpx.get(url + "/health")
    finally:
        log.removeHandler(handler)
    if not access_log:
        assert handler.lines == []
        return
    assert len(handler.lines) == 4, handler.lines
    pattern = r"127\.0\.0\.1 (GET|POST) (\S+) (\d{3}) (\d+\.\d) ms(?: prompt=(\d+) completion=(\d+) tokens)?$"
    got = [re.search(pattern, ln).groups() for ln in handler.lines]
    prompt = str(len(tok.encode("def ").ids))
    assert got[0][:3] == ("POST", "/v1/completions", "200") and got[0][4:] == (prompt, "5")
    assert got[1][:3] == ("POST", "/v1/completions", "200") and got[1][4:] == (prompt, "3")  # streamed: at its end
    assert got[2][:3] == ("GET", "/v1/models", "401") and got[3][:3] == ("GET", "/health", "200")


def test_the_banner_names_url_model_limits_and_endpoints(tok):
    engine = engine_for(tok)
    text = banner(engine, ServerConfig(model_name="tiny", api_key="k", max_concurrent=3), "http://127.0.0.1:8123")
    lines = text.splitlines()
    assert len(lines) <= 8 and "running on http://127.0.0.1:8123" in lines[0]
    for want in ("'tiny'", "dtype float32", "quantization none", "max batch 2", "queue 2", "3 requests at once",
                 "context 128 tokens", f"KV pool {engine.pool.usable_blocks} blocks x 8 tokens", "API key on",
                 "access log on", "POST /tokenize", "GET /metrics"):
        assert want in text, (want, text)
    assert "API key off" in banner(engine, ServerConfig(access_log=False), "http://x:1")


def test_serve_prints_the_banner_then_logs_requests(trained_run):
    """The real command: banner on stderr once the port is bound, then one line per request."""
    env = {**os.environ, "TRAINFORGE_API_KEY": "k"}
    proc = subprocess.Popen([sys.executable, "-m", "trainforge", "serve", "--checkpoint", str(trained_run), "--port",
                             "0", "--max_batch_size", "2"], stderr=subprocess.PIPE, text=True, env=env)
    try:
        seen, url = [], None
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and not any("endpoints:" in ln for ln in seen):
            seen.append(proc.stderr.readline())
            m = re.search(r"running on (http://[\d.]+:\d+)", seen[-1])
            url = url or (m.group(1) if m else None)
        assert url and url.startswith("http://127.0.0.1:"), seen
        text = "".join(seen)
        assert "model 'run'" in text and "max batch 2" in text and "API key on" in text, text
        r = httpx.post(url + "/v1/completions", headers={"Authorization": "Bearer k"},
                       json={"prompt": "def ", "max_tokens": 4, "temperature": 0, "ignore_eos": True}, timeout=60)
        assert r.status_code == 200
        line = proc.stderr.readline()
        assert re.search(r"POST /v1/completions 200 \d+\.\d ms prompt=\d+ completion=4 tokens", line), line
    finally:
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=30)
