"""Where `trainforge train` starts (train/resume.py), called directly: --run_dir, --resume RUN_DIR
/ auto and --from_step resolved to a run directory, refused in one line naming the fix."""

from pathlib import Path

import pytest

from trainforge.errors import ConfigError
from trainforge.train.resume import resolve


def test_a_fresh_run_goes_to_run_dir_or_a_dated_directory_under_runs():
    start = resolve("out", None, None)
    assert (start.run_dir, start.resume, start.saved_config) == (Path("out"), False, None)
    dated = resolve(None, None, None).run_dir
    assert dated.parent == Path("runs") and dated.name[:2] == "20" and len(dated.name) == len("YYYYmmdd-HHMMSS")


def test_resume_continues_the_run_from_its_saved_config(tmp_path):
    (tmp_path / "config.toml").write_text("[training]\nsteps = 5\n")
    start = resolve(None, str(tmp_path), 3)
    assert (start.run_dir, start.resume, start.saved_config, start.from_step) == \
        (tmp_path, True, tmp_path / "config.toml", 3)
    assert resolve(str(tmp_path), str(tmp_path), None).resume  # the same directory twice is fine


def test_resume_auto_starts_a_directory_without_a_checkpoint(tmp_path, capsys):
    (tmp_path / "checkpoints" / "step_0000004").mkdir(parents=True)  # no meta.json: incomplete
    start = resolve(str(tmp_path), "auto", None)
    assert (start.run_dir, start.resume) == (tmp_path, False)
    assert "has no complete checkpoint (step_0000004:" in capsys.readouterr().err


@pytest.mark.parametrize("run_dir, resume, from_step, needle", [
    (None, "auto", None, "--resume auto needs --run_dir DIR"),
    ("d", "auto", 3, "--resume auto continues from the newest checkpoint"),
    (None, None, 3, "--from_step N needs --resume RUN_DIR"),
    ("a", "b", None, "--run_dir and --resume name different directories"),
    (None, "nowhere", None, "--resume nowhere: no config.toml there"),
])
def test_mistakes_are_refused_naming_the_fix(tmp_path, monkeypatch, run_dir, resume, from_step, needle):
    monkeypatch.chdir(tmp_path)
    if resume == "b":
        (tmp_path / "b").mkdir()
        (tmp_path / "b" / "config.toml").write_text("")
    with pytest.raises(ConfigError, match=needle.replace("(", r"\(")):
        resolve(run_dir, resume, from_step)
    assert sorted(p.name for p in tmp_path.iterdir()) in ([], ["b"])  # nothing written
