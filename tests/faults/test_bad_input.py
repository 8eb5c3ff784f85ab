"""Bad input a user meets, each through the real CLI: an unreachable data URL, a config
file that is not UTF-8, a read-only run directory, a disk that fills mid-run, a Hugging Face
config.json with 0 heads or 10**12 positions, a seq_len no machine can hold, a corrupt shard.

Each asserts what the user sees: exit code 2, exactly one error line naming the key or file,
no traceback, and a run directory that was not created (or, for the full disk, whose earlier
checkpoint is intact). Mounts (read-only / tiny tmpfs) need root; without it those tests skip
saying why.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig
import time
from contextlib import contextmanager
from pathlib import Path

import pytest
from safetensors.torch import save_file

from tests.faults.conftest import one_error_line, run_cli, train_args
from trainforge.data.prepare import PrepareOptions, prepare
from trainforge.model import ModelConfig, build_model
from trainforge.model.hf import to_hf_config_dict, to_hf_state_dict
from trainforge.train import checkpoint as ckpt


def assert_bad_input(proc: subprocess.CompletedProcess, *names: str) -> str:
    assert proc.returncode == 2, proc.stderr[-3000:]
    line = one_error_line(proc.stderr)
    for name in names:
        assert name in line, line
    return line


@contextmanager
def tmpfs(path: Path, options: str):
    """A tmpfs mounted at ``path`` for the test (root only); skips saying why when it cannot."""
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    path.mkdir(parents=True, exist_ok=True)
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(path)], capture_output=True, text=True)
    if r.returncode != 0:
        pytest.skip(f"mount -t tmpfs -o {options} failed: {r.stderr.strip()}")
    try:
        yield path
    finally:
        subprocess.run(["umount", str(path)], check=False)


def test_unreachable_data_url_is_one_line_naming_the_url(tmp_path):
    run_dir = tmp_path / "run"
    # Port 9 (discard) on loopback: closed, so the connection is refused at once; never another address.
    proc = run_cli([*train_args("http://127.0.0.1:9/", "--data.timeout_s", "5"), "--run_dir", str(run_dir)])
    assert_bad_input(proc, "data.path", "http://127.0.0.1:9/")
    assert not run_dir.exists()


def test_non_utf8_config_names_the_file_and_offset(tmp_path, small_data):
    config = tmp_path / "bad.toml"
    raw = b'[model]\nflavor = "debug"\n# caf\xe9\n'  # a latin-1 e-acute in a comment
    config.write_bytes(raw)
    run_dir = tmp_path / "run"
    proc = run_cli([*train_args(small_data), "--config", str(config), "--run_dir", str(run_dir)])
    offset = raw.index(0xE9)
    assert_bad_input(proc, str(config), "UTF-8", f"offset {offset}")
    assert not run_dir.exists()


def test_read_only_run_directory_is_refused_before_training(tmp_path, small_data):
    # Root ignores permission bits, so chmod proves nothing here: a read-only mount does not.
    with tmpfs(tmp_path / "ro", "ro,size=1m") as ro:
        run_dir = ro / "run"
        proc = run_cli([*train_args(small_data, "--training.steps", "2"), "--run_dir", str(run_dir)])
        assert_bad_input(proc, "run directory", str(run_dir), "not writable")
        assert "step 0 val_loss" not in proc.stderr + proc.stdout  # refused before any training
        assert not run_dir.exists()


def test_disk_full_mid_run_keeps_the_previous_checkpoint(tmp_path, small_data):
    # 4 MiB: the step-2 checkpoint (~2 MiB for the debug model + AdamW) fits, the step-4 one does not.
    with tmpfs(tmp_path / "full", "size=4m") as full:
        run_dir = full / "run"
        proc = run_cli([*train_args(small_data, "--training.steps", "4", "--checkpoint.interval", "2"),
                        "--run_dir", str(run_dir)])
        assert_bad_input(proc, "free space", str(run_dir / "checkpoints"))
        root = run_dir / "checkpoints"
        assert sorted(p.name for p in root.iterdir()) == ["step_0000002"]  # no half-written dir left, hidden or not
        kept = root / "step_0000002"
        meta = ckpt.read_meta(kept)
        assert meta["step"] == 2
        for name, digest in meta["files"].items():  # intact: every file matches its recorded sha256
            assert ckpt.sha256_file(kept / name) == digest, name


def _hf_dir(path: Path, **overrides) -> Path:
    """A tiny Llama-layout directory written by hand: config.json (with ``overrides``) + safetensors."""
    cfg = ModelConfig(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=256, ffn_hidden_dim=128,
                      max_seq_len=128)
    model = build_model(cfg, seed=0)
    path.mkdir()
    save_file({k: v.contiguous() for k, v in to_hf_state_dict(model.state_dict(), cfg).items()},
              str(path / "model.safetensors"))
    (path / "config.json").write_text(json.dumps({**to_hf_config_dict(cfg), **overrides}))
    return path


@pytest.mark.parametrize("key, value", [("num_attention_heads", 0), ("max_position_embeddings", 10**12)])
def test_generate_refuses_impossible_hf_config(tmp_path, key, value):
    hf = _hf_dir(tmp_path / "hf", **{key: value})
    t0 = time.monotonic()
    proc = run_cli(["generate", "--checkpoint", str(hf), "--prompt_ids", "1,2,3", "--max_new_tokens", "2"],
                   timeout_s=60)
    assert_bad_input(proc, str(hf), f"'{key}' = {value}")
    assert time.monotonic() - t0 < 30  # refused from the config, nothing allocated first


def test_seq_len_no_machine_holds_is_refused_fast_naming_the_estimate(tmp_path, small_data):
    run_dir = tmp_path / "run"
    t0 = time.monotonic()
    # Before the preflight this built rotary tables for 1e8 positions until the OOM killer came (minutes).
    proc = run_cli([*train_args(small_data, "--training.seq_len", "100000000"), "--run_dir", str(run_dir)],
                   timeout_s=60)
    elapsed = time.monotonic() - t0
    line = assert_bad_input(proc, "training.seq_len = 100000000", "rotary tables", "activations", "available")
    assert "TiB" in line.split("needs ~")[1].split(" ")[1], line
    # The CLI's own start (imports, opening the data) is most of this on a busy 2-core machine.
    assert elapsed < 30, elapsed
    assert not run_dir.exists()


@pytest.fixture(scope="module")
def sharded_data(tmp_path_factory, small_data) -> Path:
    """small_data's corpus in 8192-token shards (several train shards), reusing its tokenizer."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    files = [str(stdlib / n) for n in ("argparse.py", "ast.py", "dataclasses.py", "enum.py", "functools.py",
                                       "inspect.py", "json/encoder.py", "json/decoder.py", "pathlib.py")]
    out = tmp_path_factory.mktemp("sharded") / "data"
    prepare(files, out, PrepareOptions(vocab_size=512, val_fraction=0.1, shard_tokens=8192,
                                       tokenizer=str(small_data / "tokenizer.json")), log=lambda *_: None)
    return out


def _corrupt_copy(src: Path, dst: Path) -> str:
    """``src`` copied to ``dst`` with one train shard flipped in the middle (same size): one the
    first batch of a DEBUG_TRAIN run reads (seed 1234, batch 8, seq 64), so a lazily read
    (tiered-cache) shard is read during setup too. Returns the shard's file name."""
    from trainforge.config import load_config
    from trainforge.data.sampler import BatchPlan

    shutil.copytree(src, dst)
    manifest = json.loads((dst / "manifest.json").read_text())
    entries = manifest["splits"]["train"]
    assert len(entries) >= 3, "the fixture must have several train shards"
    t = load_config(None, train_args(dst)[1:-1]).training
    plan = BatchPlan([int(e["tokens"]) for e in entries], t.seq_len, t.batch_size, t.seed)
    name = entries[int(plan.batch_windows(0, 0)[0, 0])]["file"]
    shard = dst / name
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    return name


def test_corrupt_local_shard_is_quarantined_under_skip(tmp_path, sharded_data):
    name = _corrupt_copy(sharded_data, tmp_path / "data")
    run_dir = tmp_path / "run"
    proc = run_cli([*train_args(tmp_path / "data", "--training.steps", "6", "--data.on_corrupt", "skip"),
                    "--run_dir", str(run_dir)])
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    assert f"shard {name}" in proc.stderr and "quarantined" in proc.stderr  # logged
    records = [json.loads(ln) for ln in (run_dir / "metrics.jsonl").read_text().splitlines()]
    counted = [r["data_quarantined"] for r in records if "data_quarantined" in r]
    assert counted and all(c == 1 for c in counted), records[:3]  # counted at every logging interval
    assert (run_dir / "checkpoints" / "step_0000006").is_dir()  # trained to the end on the other shards


@pytest.mark.parametrize("cache", [False, True], ids=["local", "cache_dir"])
def test_corrupt_shard_fails_naming_it_and_writes_nothing(tmp_path, sharded_data, cache):
    name = _corrupt_copy(sharded_data, tmp_path / "data")
    run_dir = tmp_path / "run"
    extra = ["--data.cache.dir", str(tmp_path / "cache")] if cache else []
    proc = run_cli([*train_args(tmp_path / "data", "--training.steps", "2", *extra), "--run_dir", str(run_dir)])
    assert_bad_input(proc, name)
    # With the cache the shard is first read during setup (the first batch is checked before
    # config.toml or metrics.jsonl are written), so both cases leave no run directory behind.
    assert not run_dir.exists()


if __name__ == "__main__":  # pragma: no cover
    sys.exit(pytest.main([__file__, "-q"]))
