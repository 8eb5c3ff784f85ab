"""A data-only checkpoint costs nothing either: what passes ``weights_only`` and the re-hashed
manifest is still checked before use.

Fault: an attacker (or a damaged run) writes a ``train_state.pt`` of plain tensors and numbers
that unpickles safely and whose sha256 meta.json lists: an optimizer moment of the wrong shape
(main: the fused AdamW wrote out of bounds, ``malloc_consolidate(): invalid chunk size``, exit
134), a step of -5 or 2^70 (accepted), a string ``data.epoch`` (a ValueError traceback); or a
manifest key or DCP ``relative_path`` that leads out of the checkpoint (main opened it). Each
must be one line naming the file and the field, exit 2, before anything is loaded.
"""

from __future__ import annotations

import hashlib
import json
import os
import pickle
import shutil
from pathlib import Path

import pytest
import torch

from tests.conftest import debug_config, train_to
from tests.faults.conftest import one_error_line, run_cli
from trainforge import exit_codes
from trainforge.errors import CheckpointError, TrainforgeError
from trainforge.train import checkpoint as ckpt
from trainforge.train.trainer import Trainer

STEPS = ("--training.steps", "2", "--training.warmup_steps", "1", "--training.val_interval", "0",
         "--training.threads", "1", "--training.batch_size", "4", "--training.seq_len", "32")


@pytest.fixture(scope="module")
def trained(tmp_path_factory, small_data) -> Path:
    return train_to(debug_config(small_data, *STEPS), tmp_path_factory.mktemp("trained") / "run")


def _copy(run: Path, tmp_path: Path) -> tuple[Path, Path]:
    dst = tmp_path / "run"
    shutil.copytree(run, dst)
    return dst, ckpt.list_checkpoints(dst / "checkpoints")[-1]


def rewrite_state(ck: Path, change) -> Path:
    """Apply ``change`` to the checkpoint's train_state.pt and re-hash it in meta.json (what an
    attacker does: the hash is no authentication). Returns the file."""
    f = ck / ckpt.STATE_FILE
    state = torch.load(f, weights_only=True)
    change(state)
    torch.save(state, f)
    meta = json.loads((ck / ckpt.META).read_text())
    meta["files"][ckpt.STATE_FILE] = hashlib.sha256(f.read_bytes()).hexdigest()
    (ck / ckpt.META).write_text(json.dumps(meta))
    return f


MOMENT = "state.layers.0.attention.wq.weight.exp_avg"


def test_an_optimizer_moment_of_the_wrong_shape_exits_2_not_a_heap_corruption(trained, small_data, tmp_path):
    run, ck = _copy(trained, tmp_path)
    f = rewrite_state(ck, lambda s: s["optimizer"].__setitem__(MOMENT, torch.zeros(2)))
    r = run_cli(["train", "--resume", str(run), "--training.steps", "3", "--no_sample"], timeout_s=120)
    assert r.returncode == exit_codes.BAD_INPUT, (r.returncode, r.stderr[-2000:])
    line = one_error_line(r.stderr)
    assert str(f) in line and MOMENT in line and "(2,)" in line and "(64, 64)" in line, line


def _resume(run: Path, data: Path) -> None:
    Trainer(debug_config(data, *STEPS[:1], "3", *STEPS[2:]), run, resume=True, progress=False).close()


@pytest.mark.parametrize("field,change", [
    ("step", lambda s: s.__setitem__("step", -5)),
    ("step", lambda s: s.__setitem__("step", 2**70)),
    ("data.epoch", lambda s: s["data"].__setitem__("epoch", "1")),
    ("data.position", lambda s: s["data"].__setitem__("position", -1)),
    ("data.position", lambda s: s["data"].__setitem__("position", 10**9)),
    ("scheduler.last_epoch", lambda s: s["scheduler"].__setitem__("last_epoch", 10**6)),
    ("scheduler.base_lrs", lambda s: s["scheduler"].__setitem__("base_lrs", ["0.001", 0.001])),
    # a scalar step the fused kernel reads as one float: three of them, or an int64 moment
    ("weight.step", lambda s: s["optimizer"].__setitem__(MOMENT.replace("exp_avg", "step"), torch.zeros(3))),
    (MOMENT + "_sq", lambda s: s["optimizer"].__setitem__(MOMENT + "_sq", torch.zeros(64, 64, dtype=torch.int64))),
    ("param_groups", lambda s: s["optimizer"].__setitem__(
        "param_groups.layers.0.attention.wq.weight.betas", (0.9, "0.95"))),
], ids=["step-negative", "step-2^70", "epoch-str", "position-negative", "position-huge", "last-epoch", "base-lrs",
        "step-shape", "moment-int", "betas-str"])
def test_resume_fields_and_tensors_are_range_checked(trained, small_data, tmp_path, field, change):
    run, ck = _copy(trained, tmp_path)
    f = rewrite_state(ck, change)
    with pytest.raises(TrainforgeError) as e:
        _resume(run, small_data)
    msg = str(e.value)
    assert "\n" not in msg and str(f) in msg and field in msg, msg


def test_a_component_state_of_the_wrong_kind_is_one_line(trained, small_data, tmp_path):
    """A [bad_steps] state whose counts are a list: main's load_state_dict raised an AttributeError."""
    run, ck = _copy(trained, tmp_path)
    rewrite_state(ck, lambda s: s.__setitem__("bad_steps", {"consecutive_bad": 0, "rollbacks": 0, "counts": [1],
                                                            "recent": []}))
    with pytest.raises(TrainforgeError) as e:
        Trainer(debug_config(small_data, *STEPS[:1], "3", *STEPS[2:], "--bad_steps.enabled", "true"), run,
                resume=True, progress=False).close()
    assert "bad_steps" in str(e.value) and str(ck) in str(e.value), str(e.value)


def test_a_manifest_key_outside_the_checkpoint_is_never_opened(trained, tmp_path):
    run, ck = _copy(trained, tmp_path)
    outside = tmp_path / "secret.bin"
    outside.write_bytes(b"not the checkpoint's")
    digest = hashlib.sha256(outside.read_bytes()).hexdigest()
    (ck / "link.bin").symlink_to(outside)
    for name in ("../../../secret.bin", str(outside), "link.bin"):
        meta = json.loads((ck / ckpt.META).read_text())
        meta["files"] = {name: digest, **meta["files"]}
        (ck / ckpt.META).write_text(json.dumps(meta))
        with pytest.raises(CheckpointError) as e:
            ckpt.read_meta(ck)
        assert "outside the checkpoint" in str(e.value) and name in str(e.value), str(e.value)
        meta["files"].pop(name)
        (ck / ckpt.META).write_text(json.dumps(meta))
    ckpt.read_meta(ck)  # the control: without the key it verifies


def _sharded(tmp_path: Path):
    """A DCP checkpoint of a tiny model and its AdamW state, written in this process."""
    from trainforge.train import dist_checkpoint as dckpt

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 4))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(2, 8)).sum().backward()
    opt.step()
    dckpt.save_sharded(tmp_path, model, opt)
    return model, opt, tmp_path / dckpt.SHARDED_DIR


def _rewrite_metadata(d: Path, change) -> None:
    from trainforge.safe_unpickle import load_dcp_metadata

    md = load_dcp_metadata(d / ".metadata")
    change(md)
    (d / ".metadata").write_bytes(pickle.dumps(md))


def test_a_dcp_relative_path_outside_the_checkpoint_is_never_opened(tmp_path):
    """The shard is moved out and .metadata pointed at it: main read it from there."""
    import dataclasses

    from trainforge.train import dist_checkpoint as dckpt

    model, opt, d = _sharded(tmp_path / "ck")
    shard = next(d.glob("*.distcp"))
    outside = tmp_path / "elsewhere.distcp"
    os.replace(shard, outside)

    def point_out(md):
        md.storage_data = {k: dataclasses.replace(v, relative_path="../../elsewhere.distcp")
                           for k, v in md.storage_data.items()}

    _rewrite_metadata(d, point_out)
    with pytest.raises(CheckpointError) as e:
        dckpt.load_sharded(tmp_path / "ck", model, opt)
    msg = str(e.value)
    assert "\n" not in msg and str(d / ".metadata") in msg and "outside the checkpoint" in msg, msg


def test_a_dcp_byte_range_past_its_file_is_refused(tmp_path):
    import dataclasses

    from trainforge.train import dist_checkpoint as dckpt

    model, opt, d = _sharded(tmp_path / "ck")
    _rewrite_metadata(d, lambda md: setattr(md, "storage_data", {
        k: dataclasses.replace(v, length=2**40) for k, v in md.storage_data.items()}))
    with pytest.raises(CheckpointError) as e:
        dckpt.load_sharded(tmp_path / "ck", model, opt)
    assert str(d / ".metadata") in str(e.value) and "outside its" in str(e.value) and "\n" not in str(e.value)


def test_the_untouched_checkpoints_resume(trained, small_data, tmp_path):
    run, _ = _copy(trained, tmp_path)
    _resume(run, small_data)
    from trainforge.train import dist_checkpoint as dckpt

    model, opt, _ = _sharded(tmp_path / "ck")
    dckpt.load_sharded(tmp_path / "ck", model, opt)


def test_a_meta_json_nested_past_the_stack_is_one_line(trained, tmp_path):
    """main: json's RecursionError escaped read_meta (a traceback)."""
    _, ck = _copy(trained, tmp_path)
    (ck / ckpt.META).write_text("[" * 100_000 + "]" * 100_000)
    with pytest.raises(CheckpointError) as e:
        ckpt.read_meta(ck)
    assert str(ck / ckpt.META) in str(e.value) and "\n" not in str(e.value)


def test_a_data_manifest_naming_a_shard_outside_its_directory_is_refused(small_data, tmp_path):
    """The shard moved out and the manifest pointed at it (sha256 unchanged): main read it there."""
    from trainforge.data.dataset import load_prepared
    from trainforge.errors import DataError

    data = tmp_path / "data"
    shutil.copytree(small_data, data)
    manifest = json.loads((data / "manifest.json").read_text())
    entry = manifest["splits"]["train"][0]
    os.replace(data / entry["file"], tmp_path / "moved.bin")
    entry["file"] = "../moved.bin"
    (data / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(DataError) as e:
        load_prepared(data)
    assert "'../moved.bin' is not a name inside the data directory" in str(e.value), str(e.value)
