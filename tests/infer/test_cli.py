"""The inference commands end to end: ``trainforge quantize`` writes a checkpoint that
``generate`` loads, and ``trainforge serve`` binds 127.0.0.1 and answers."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time

import httpx


def tf(*args, timeout=180):
    r = subprocess.run([sys.executable, "-m", "trainforge", *args], capture_output=True, text=True, timeout=timeout)
    assert r.returncode == 0, r.stderr
    return r.stdout


def test_quantize_then_generate(trained_run, tmp_path):
    out = tf("quantize", "--checkpoint", str(trained_run), "--output", str(tmp_path / "q4"), "--mode", "int4",
             "--group_size", "32")
    assert "quantised 15 linear layers to int4" in out and (tmp_path / "q4" / "model.safetensors").is_file()
    text = tf("generate", "--checkpoint", str(tmp_path / "q4"), "--prompt", "def ", "--temperature", "0",
              "--max_new_tokens", "8", "--stats")
    assert text.startswith("def ")
    ids = tf("generate", "--checkpoint", str(trained_run), "--prompt_ids", "5,6,7", "--print_ids", "--quantize",
             "int8", "--temperature", "0", "--max_new_tokens", "8", "--ignore_eos")
    assert len(ids.strip().split(",")) == 8
    r = subprocess.run([sys.executable, "-m", "trainforge", "quantize", "--checkpoint", str(trained_run), "--output",
                        str(tmp_path / "q4"), "--mode", "int8"], capture_output=True, text=True)
    assert r.returncode == 2 and "exists" in r.stderr


def test_serve_binds_localhost_and_answers(trained_run):
    env = {**os.environ, "TRAINFORGE_API_KEY": "k"}
    proc = subprocess.Popen([sys.executable, "-m", "trainforge", "serve", "--checkpoint", str(trained_run), "--port",
                             "0", "--max_batch_size", "2"], stderr=subprocess.PIPE, text=True, env=env)
    try:
        url = None
        deadline = time.monotonic() + 120
        while url is None and time.monotonic() < deadline:
            line = proc.stderr.readline()
            m = re.search(r"running on (http://[\d.]+:\d+)", line)
            url = m.group(1) if m else None
        assert url is not None and url.startswith("http://127.0.0.1:")
        assert httpx.get(url + "/health").status_code == 200
        assert httpx.get(url + "/v1/models").status_code == 401  # the key came from the environment
        r = httpx.post(url + "/v1/completions", headers={"Authorization": "Bearer k"},
                       json={"prompt": "def ", "max_tokens": 4, "temperature": 0}, timeout=60)
        assert r.status_code == 200 and r.json()["model"] == "run"
    finally:
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=30)


def test_serve_refuses_a_bad_engine_flag_before_loading(tmp_path):
    """An impossible engine setting is refused naming the flag, before any checkpoint is read (the
    checkpoint here does not even exist)."""
    r = subprocess.run([sys.executable, "-m", "trainforge", "serve", "--checkpoint", str(tmp_path / "absent"),
                        "--port", "0", "--max_prefill_tokens", "0"], capture_output=True, text=True, timeout=120)
    assert r.returncode != 0
    assert "--max_prefill_tokens=0: must be >= 1" in r.stderr, r.stderr
    assert "absent" not in r.stderr  # the config was checked first
