"""The C++ CPU kernels' build as a new user meets it: a first run killed mid-build (a closed
terminal, ``timeout``) must not wedge the runs after it; a wait for another process's build is
bounded and names the lock; a machine without a C++ compiler says so in one line, once per
cache, and every weight format runs on its fallback through ``generate`` and ``serve``.

The kill tests build a one-function library through the same ``build`` (the same lock, private
build directory and publication as the kernels'), with a compiler wrapper that stalls, so the
kill lands mid-compile in seconds instead of after the kernels' minute of compiling."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import httpx
import pytest

from tests.conftest import debug_config, train_to
from tests.faults.conftest import cli_env
from trainforge.infer.cpu_kernels import build as kbuild
from trainforge.native.build_cache import BuildCache

# These build a library: they need the compiler that a machine without one lacks (the no-compiler
# tests below run everywhere).
needs_cxx = pytest.mark.skipif(kbuild.toolchain()["cxx"] is None, reason="needs a C++ compiler on PATH (c++)")

TINY_CPP = "extern \"C\" int trainforge_test_answer() { return 42; }\n"


def _build_script(src: Path, entry: Path) -> list[str]:
    code = textwrap.dedent(f"""
        from pathlib import Path
        from trainforge.infer.cpu_kernels.build import build
        r = build(announce=lambda m: print(m, flush=True), sources=[Path({str(src)!r})], name="tiny",
                  entry=Path({str(entry)!r}), wait_limit_s=60)
        print("RESULT", r, flush=True)
    """)
    return [sys.executable, "-c", code]


@pytest.fixture
def tiny(tmp_path):
    src = tmp_path / "tiny.cpp"
    src.write_text(TINY_CPP)
    # A compiler that announces itself, then stalls before compiling: the kill lands mid-build.
    slow = tmp_path / "slow-c++"
    slow.write_text(f"#!/bin/sh\ntouch {tmp_path}/compiling\nsleep 30\nexec g++ \"$@\"\n")
    slow.chmod(0o755)
    return src, slow, tmp_path / "cache" / "entry"


@needs_cxx
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL])
def test_a_build_killed_midway_does_not_block_the_next_run(tiny, tmp_path, sig):
    src, slow, entry = tiny
    first = subprocess.Popen(_build_script(src, entry), stdout=subprocess.PIPE, text=True,
                             env=cli_env(CXX=str(slow)), start_new_session=True)
    try:
        deadline = time.monotonic() + 60
        while not (tmp_path / "compiling").exists():
            assert time.monotonic() < deadline and first.poll() is None, "the build never started"
            time.sleep(0.05)
        assert "building CPU kernels" in first.stdout.readline()
        first.send_signal(sig)  # the builder alone, as `timeout` does: ninja and the compiler live on
        first.wait(timeout=10)
        assert not (entry / "tiny.so").exists()
        t0 = time.monotonic()
        second = subprocess.run(_build_script(src, entry), capture_output=True, text=True, timeout=120,
                                env=cli_env())
        assert second.returncode == 0, second.stderr
        assert "RESULT None" in second.stdout and "built CPU kernels" in second.stdout
        assert time.monotonic() - t0 < 60  # it never waited on the dead builder
        assert (entry / "tiny.so").is_file()
        assert not list(entry.parent.glob("entry.tmp-*"))  # the dead builder's directory is gone
    finally:
        os.killpg(first.pid, signal.SIGKILL)  # the orphaned compiler wrapper


@needs_cxx
def test_a_lock_left_by_torchs_filebaton_does_not_block(tiny):
    src, _, entry = tiny
    entry.mkdir(parents=True)
    (entry / "lock").write_text("")  # what cpp_extension's FileBaton leaves behind a killed build
    r = subprocess.run(_build_script(src, entry), capture_output=True, text=True, timeout=120, env=cli_env())
    assert "RESULT None" in r.stdout, r.stdout + r.stderr


def test_a_wait_for_a_live_builder_is_bounded_and_names_the_lock(tiny, capfd):
    src, _, entry = tiny
    lock = BuildCache(entry).lock_path
    lock.parent.mkdir(parents=True)
    holder = subprocess.Popen(["flock", str(lock), "sleep", "60"])  # a live builder that never finishes
    try:
        while not lock.exists():
            time.sleep(0.05)
        time.sleep(0.3)  # flock(1) holds it
        t0 = time.monotonic()
        reason = kbuild.build(sources=[src], name="tiny", entry=entry, wait_limit_s=1.0)
        waited = time.monotonic() - t0
    finally:
        holder.kill()
        holder.wait()
    assert 1.0 <= waited < 5
    assert reason is not None and str(lock) in reason and f"pid {holder.pid}" in reason
    err = capfd.readouterr().err
    assert "waiting up to 1 s" in err and str(lock) in err  # said while it waited, then gave up
    assert not (entry / "tiny.so").exists()


def test_no_compiler_is_reported_once_per_cache(tiny, tmp_path):
    src, _, entry = tiny
    bare = tmp_path / "bin"
    bare.mkdir()  # no c++ on PATH
    script = _build_script(src, entry)
    env = cli_env(PATH=str(bare))
    env.pop("CXX", None)
    runs = [subprocess.run(script, capture_output=True, text=True, timeout=60, env=env) for _ in range(2)]
    assert all(r.returncode == 0 and "RESULT no C++ compiler" in r.stdout for r in runs)
    first = [ln for ln in runs[0].stderr.splitlines() if ln.strip()]
    assert len(first) == 1 and "install a C++ compiler" in first[0] and "slower" in first[0], runs[0].stderr
    assert runs[1].stderr.strip() == ""  # the recorded result: no second message, no second attempt
    # A compiler on PATH now (another toolchain): the next run builds.
    if kbuild.toolchain()["cxx"] is None:
        return  # this machine has none to put back
    third = subprocess.run(script, capture_output=True, text=True, timeout=120, env=cli_env())
    assert "RESULT None" in third.stdout, third.stdout + third.stderr


# -- every weight format through generate and serve, with no compiler on PATH ---------------------

FORMATS = ["f32", "int8", "int4", "q8_0", "q4_0", "gguf"]


@pytest.fixture(scope="module")
def no_compiler(small_data, tmp_path_factory):
    """A trained debug model (linears groupable for every format), its GGUF Q4_0 export, and an
    environment with no C++ compiler on PATH and an empty kernel cache."""
    pytest.importorskip("gguf")
    from tests.infer.test_gguf_loading import Q, write_gguf
    from trainforge.data.tokenizer import load_tokenizer
    from trainforge.infer.loading import load_model

    root = tmp_path_factory.mktemp("nocc")
    run = train_to(debug_config(small_data, "--training.steps", "20", "--model.ffn_hidden_dim", "192",
                                "--training.val_interval", "0"), root / "run")
    model = load_model(run).model
    gguf_file = write_gguf(root / "m.gguf", model, linear_type=Q.Q4_0, embd_type=Q.Q4_0,
                           tokenizer=load_tokenizer(small_data / "tokenizer.json"))
    bare = root / "bin"
    bare.mkdir()
    env = cli_env(PATH=str(bare), TRAINFORGE_KERNEL_CACHE=str(root / "kernels"))
    env.pop("CXX", None)
    return run, gguf_file, env


def _model_args(fmt: str, run: Path, gguf_file: Path) -> list[str]:
    if fmt == "gguf":
        return ["--checkpoint", str(gguf_file)]
    return ["--checkpoint", str(run), "--quantize", "none" if fmt == "f32" else fmt]


def test_every_format_generates_without_a_compiler(no_compiler):
    run, gguf_file, env = no_compiler
    told = []
    for fmt in FORMATS:
        r = subprocess.run([sys.executable, "-m", "trainforge", "generate", *_model_args(fmt, run, gguf_file),
                            "--prompt", "def ", "--max_new_tokens", "6", "--temperature", "0", "--ignore_eos"],
                           capture_output=True, text=True, timeout=120, env=env)
        assert r.returncode == 0, (fmt, r.stderr[-3000:])
        assert r.stdout.startswith("def ") and len(r.stdout) > len("def "), (fmt, r.stdout)
        told += [(fmt, ln) for ln in r.stderr.splitlines() if "CPU kernels" in ln]
        assert "Traceback" not in r.stderr and "Warning" not in r.stderr, (fmt, r.stderr[-3000:])
    # One line for the whole cache: the first run's; the five after it find the result recorded.
    assert len(told) == 1 and told[0][0] == FORMATS[0] and "install a C++ compiler" in told[0][1], told


@pytest.mark.parametrize("fmt", FORMATS)
def test_every_format_serves_without_a_compiler(no_compiler, fmt):
    run, gguf_file, env = no_compiler
    proc = subprocess.Popen([sys.executable, "-m", "trainforge", "serve", *_model_args(fmt, run, gguf_file),
                             "--port", "0", "--max_batch_size", "2", "--no_access_log", "--model_name", "m"],
                            stderr=subprocess.PIPE, text=True, env=env, start_new_session=True)
    try:
        url, seen = None, []
        deadline = time.monotonic() + 120
        while url is None and time.monotonic() < deadline:
            line = proc.stderr.readline()
            assert line or proc.poll() is None, "".join(seen)[-3000:]
            seen.append(line)
            m = re.search(r"running on (http://[\d.]+:\d+)", line)
            url = m.group(1) if m else None
        assert url is not None, "".join(seen)[-3000:]
        body = {"model": "m", "prompt": "def ", "max_tokens": 6, "temperature": 0}
        with httpx.Client(timeout=60) as http:
            replies = [http.post(url + "/v1/completions", json=body) for _ in range(2)]
        assert all(r.status_code == 200 for r in replies), [r.text for r in replies]
        assert all(r.json()["choices"][0]["finish_reason"] in ("length", "stop") for r in replies)
        assert "Traceback" not in "".join(seen)
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=30)


def test_compile_without_a_compiler_is_one_line(no_compiler, small_data, tmp_path):
    # torch.compile on the CPU compiles C++ too: asked for without a compiler, it is refused in
    # one line naming the flag (inductor's own error is a traceback at the first compiled call).
    from tests.faults.conftest import one_error_line, train_args

    run, _, env = no_compiler
    gen = subprocess.run([sys.executable, "-m", "trainforge", "generate", "--checkpoint", str(run), "--prompt",
                          "def ", "--max_new_tokens", "2", "--compile"], capture_output=True, text=True,
                         timeout=120, env=env)
    assert gen.returncode == 2 and "--compile" in one_error_line(gen.stderr) and "g++" in gen.stderr
    train = subprocess.run([sys.executable, "-m", "trainforge", *train_args(small_data, "--training.steps", "1",
                                                                             "--parallel.compile", "true",
                                                                             "--run_dir", str(tmp_path / "r"))],
                           capture_output=True, text=True, timeout=120, env=env)
    assert train.returncode == 2 and "parallel.compile" in one_error_line(train.stderr)
