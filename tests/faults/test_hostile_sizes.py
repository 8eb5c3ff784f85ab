"""Huge sizes cost nothing, and a signal always ends the wait.

A layer count of 10^9 (``--model.n_layers``, a config.json's ``num_hidden_layers``, a checkpoint's
meta.json, ``model.init_from``) is refused in constant time naming its key (``preflight``'s model
limits); main counted parameters layer by layer for ~15 minutes first. A SIGTERM before the
training loop starts (loading, building) ends the command at once with 128 + 15: main only
recorded it, so only SIGKILL ended such a wait.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.faults.conftest import cli_env, one_error_line, run_cli, train_args
from tests.faults.test_hostile_gguf import assert_one_line, bounded
from trainforge import exit_codes
from trainforge.errors import CheckpointError


def test_a_billion_layers_on_the_command_line_exits_2_in_seconds(small_data, tmp_path):
    t0 = time.monotonic()
    r = run_cli(train_args(small_data, "--run_dir", str(tmp_path / "run"), "--model.n_layers", "1000000000"),
                timeout_s=60)
    assert r.returncode == exit_codes.BAD_INPUT, r.stderr[-2000:]
    line = one_error_line(r.stderr)
    assert "'model.n_layers' = 1000000000" in line and "10,000" in line, line
    assert time.monotonic() - t0 < 30
    assert not (tmp_path / "run").exists()


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    """A Hugging Face directory of the debug model (config.json + model.safetensors)."""
    from safetensors.torch import save_file

    from trainforge.model import FLAVORS, build_model
    from trainforge.model.hf import to_hf_config_dict, to_hf_state_dict

    cfg = FLAVORS["debug"]
    d = tmp_path_factory.mktemp("hf") / "m"
    d.mkdir()
    sd = to_hf_state_dict(build_model(cfg, seed=0).state_dict(), cfg)
    save_file({k: v.contiguous() for k, v in sd.items()}, str(d / "model.safetensors"))
    (d / "config.json").write_text(json.dumps(to_hf_config_dict(cfg)))
    return d


def _with_config(src: Path, dst: Path, **changes) -> Path:
    import shutil

    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    cfg.update(changes)
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


def test_a_billion_hidden_layers_in_config_json_is_refused_in_constant_time(hf_dir, tmp_path):
    """Through load_model (generate, serve) and model.init_from (train)."""
    from trainforge.infer.loading import load_model
    from trainforge.train.init_from import open_init_source

    d = _with_config(hf_dir, tmp_path / "deep", num_hidden_layers=10**9)
    for load in (lambda: load_model(d), lambda: open_init_source(d)):
        assert_one_line(bounded(load, seconds=5), d, "'num_hidden_layers' = 1000000000")


def test_a_billion_layers_in_a_checkpoint_meta_json_is_refused(tmp_path):
    from trainforge.loading.loader import trainforge_model_config
    from trainforge.model import FLAVORS
    from trainforge.storage.checkpoint_format import META, write_meta

    import dataclasses

    ck = tmp_path / "step_0000001"
    ck.mkdir()
    write_meta(ck, 1, {}, {**dataclasses.asdict(FLAVORS["debug"]), "n_layers": 10**9})
    err = bounded(lambda: trainforge_model_config(ck), seconds=5)
    assert isinstance(err, CheckpointError)
    assert_one_line(err, ck / META, "n_layers", "1000000000")


def _catches_sigterm(pid: int) -> bool:
    """Whether the process has a SIGTERM handler installed (SigCgt of /proc/PID/status)."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("SigCgt:"):
                return bool(int(line.split()[1], 16) >> (signal.SIGTERM - 1) & 1)
    except OSError:
        pass
    return False


def test_sigterm_during_start_up_ends_the_command_at_once(small_data, tmp_path):
    """1,000 debug layers take seconds to build: the signal arrives while the handler is
    installed and the loop has not started. main recorded it and trained a step first."""
    run_dir = tmp_path / "run"
    proc = subprocess.Popen([sys.executable, "-m", "trainforge", *train_args(
        small_data, "--run_dir", str(run_dir), "--model.n_layers", "1000", "--training.steps", "1",
        "--training.batch_size", "1", "--training.seq_len", "16")], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        text=True, env=cli_env(), start_new_session=True)
    try:
        deadline = time.monotonic() + 60
        while not _catches_sigterm(proc.pid):
            assert proc.poll() is None and time.monotonic() < deadline, "the handler was never installed"
            time.sleep(0.01)
        t0 = time.monotonic()
        os.kill(proc.pid, signal.SIGTERM)
        _, err = proc.communicate(timeout=60)
        waited = time.monotonic() - t0
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode == exit_codes.killed_by(signal.SIGTERM), err[-2000:]
    assert "received SIGTERM before training started" in err and "Traceback" not in err, err[-2000:]
    assert waited < 10, waited
    assert not (run_dir / "checkpoints").exists()
