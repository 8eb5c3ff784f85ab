"""trainforge.storage: what every writer of files relies on. A failed write leaves the old
file or directory (and no temporary); a checkpoint directory written by ``trainforge
quantize`` carries the same version fields and sha256 list as a training checkpoint and is
fsynced like one; meta.json without version fields (older trainforge) still reads, a newer
or foreign one is refused with the fix."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from trainforge.errors import CheckpointError
from trainforge.infer.quantize import save_quantized
from trainforge.storage import atomic
from trainforge.storage.checkpoint_format import FORMAT, FORMAT_VERSION, META, CorruptCheckpointError, read_meta

V1_INT8 = Path(__file__).parent / "compat" / "v1" / "int8"


def _boom(*a, **kw):
    raise OSError(28, "No space left on device")


def test_failed_file_write_keeps_the_old_file_and_no_temporary(tmp_path, monkeypatch):
    path = tmp_path / "facts.json"
    atomic.atomic_write_json(path, {"v": 1})
    monkeypatch.setattr(atomic.os, "replace", _boom)
    with pytest.raises(OSError):
        atomic.atomic_write_json(path, {"v": 2})
    assert json.loads(path.read_text()) == {"v": 1}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["facts.json"]


def test_directory_commit_replaces_whole_or_not_at_all(tmp_path, monkeypatch):
    final = tmp_path / "out"
    with atomic.atomic_directory(final) as tmp:
        (tmp / "a").write_text("old")
    with pytest.raises(RuntimeError):
        with atomic.atomic_directory(final, replace=True) as tmp:
            (tmp / "a").write_text("new")
            raise RuntimeError("killed while writing")
    assert (final / "a").read_text() == "old" and sorted(p.name for p in tmp_path.iterdir()) == ["out"]
    with pytest.raises(OSError):  # without replace an existing non-empty directory is never overwritten
        with atomic.atomic_directory(final) as tmp:
            (tmp / "a").write_text("new")
    assert (final / "a").read_text() == "old"
    with atomic.atomic_directory(final, replace=True) as tmp:
        (tmp / "b").write_text("new")
    assert sorted(p.name for p in final.iterdir()) == ["b"] and sorted(p.name for p in tmp_path.iterdir()) == ["out"]


def _tiny_quantized(tmp_path: Path, monkeypatch) -> tuple[Path, set[str]]:
    synced: set[str] = set()
    real_fsync = os.fsync

    def recording_fsync(fd):
        synced.add(Path(os.readlink(f"/proc/self/fd/{fd}")).name)
        return real_fsync(fd)

    monkeypatch.setattr(os, "fsync", recording_fsync)
    sd = {"tok_embeddings.weight": torch.randn(8, 4), "layers.0.w.weight": torch.zeros(4, 4, dtype=torch.int8),
          "layers.0.w.scales": torch.ones(4)}
    tok = tmp_path / "tok.json"
    tok.write_text("{}")
    out = save_quantized(tmp_path / "q8", sd, {"mode": "int8", "layers": ["layers.0.w"], "skipped": {}},
                         {"dim": 4}, tok, {"path": "src", "step": 7})
    return out, synced


@pytest.mark.skipif(not Path("/proc/self/fd").is_dir(), reason="names fsynced files through /proc/self/fd")
def test_quantized_directory_is_a_versioned_fsynced_checkpoint(tmp_path, monkeypatch):
    out, synced = _tiny_quantized(tmp_path, monkeypatch)
    meta = read_meta(out)  # verifies every file's sha256
    assert (meta["format"], meta["format_version"], meta["step"]) == (FORMAT, FORMAT_VERSION, 7)
    assert meta["quantization"]["mode"] == "int8" and meta["source"] == "src"
    assert {"trainforge_version", "torch_version"} <= set(meta)
    assert set(meta["files"]) == {"model.safetensors", "tokenizer.json"}
    assert {"model.safetensors", "tokenizer.json", META} <= synced
    assert sorted(p.name for p in tmp_path.iterdir()) == ["q8", "tok.json"]  # no temporary left


def test_meta_without_version_fields_reads_and_newer_or_foreign_is_refused(tmp_path):
    old = read_meta(V1_INT8)  # written before the fields existed
    assert "format_version" not in old and old["quantization"]["mode"] == "int8"
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    meta = {"step": 1, "config": {}, "model_config": {}, "files": {}}
    for extra, error, needle in [({"format_version": FORMAT_VERSION + 1}, CheckpointError, "upgrade trainforge"),
                                 ({"format": "other-tool"}, CheckpointError, "not a trainforge checkpoint"),
                                 ({"format_version": "1"}, CorruptCheckpointError, "format_version")]:
        (ckpt / META).write_text(json.dumps({**meta, **extra}))
        with pytest.raises(error, match=needle) as e:
            read_meta(ckpt)
        assert str(ckpt / META) in str(e.value)
    (ckpt / META).write_text(json.dumps({**meta, "format": FORMAT, "format_version": FORMAT_VERSION}))
    assert read_meta(ckpt)["step"] == 1
