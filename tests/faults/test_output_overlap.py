"""Writes never destroy their inputs: every command that writes refuses an output that is,
contains or lies inside what it reads (symlinks resolved), with one line naming both paths,
exit 2 and nothing touched, --force or not; and a killed export's temporary directory is
removed by the next export (a live writer's is left alone)."""

from __future__ import annotations

import dataclasses
import hashlib
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.faults.conftest import cli_env, one_error_line, run_cli
from trainforge.cli import main
from trainforge.infer.hf_export import export
from trainforge.errors import TrainforgeError


def _tree(root: Path) -> dict[str, str]:
    """Every file under ``root`` (hidden ones too) by content: what 'nothing touched' compares."""
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> Path:
    """A debug-flavor run directory with one checkpoint (built, not trained: its files are what matters)."""
    from trainforge.model import FLAVORS, build_model
    from trainforge.train import checkpoint as ckpt

    cfg = dataclasses.replace(FLAVORS["debug"], max_seq_len=64)
    root = tmp_path_factory.mktemp("overlap") / "runs" / "a"
    ckpt.save_checkpoint(root / "checkpoints", 1, build_model(cfg, seed=0), {}, {}, dataclasses.asdict(cfg), None,
                         keep_last=1)
    return root


def test_export_refuses_every_overlap_even_with_force(run):
    before = _tree(run.parent)
    step = next((run / "checkpoints").iterdir())
    link = run.parent.parent / "link-to-a"
    link.symlink_to(run, target_is_directory=True)
    cases = [(run, run, "is the same path as"),                      # the case: the run replaced
             (step, step, "is the same path as"),                    # a checkpoint replaced by its export
             (run, run / "hf", "lies inside"),                       # written into what it reads
             (run, run.parent, "contains"),                          # --force would replace runs/ whole
             (link, run, "is the same path as"),                     # the same directory through a symlink
             (run, link / "checkpoints" / "hf", "lies inside")]
    for checkpoint, output, how in cases:
        with pytest.raises(TrainforgeError, match=f"--output {output} {how} --checkpoint {checkpoint}"):
            export(checkpoint, output, force=True)
        assert _tree(run.parent) == before, (checkpoint, output)
    r = run_cli(["export", "--checkpoint", str(run), "--output", str(run), "--force"])
    line = one_error_line(r.stderr)
    assert r.returncode == 2 and line.count(str(run)) == 2 and "is the same path as" in line
    assert _tree(run.parent) == before


def test_other_writing_commands_refuse_overlaps(run, tmp_path, capsys, small_data):
    before = _tree(run.parent)
    # quantize: an output inside the checkpoint it reads.
    assert main(["quantize", "--checkpoint", str(run), "--output", str(run / "int4"), "--mode", "int8"]) == 2
    assert "--output" in capsys.readouterr().err and not (run / "int4").exists()
    # prepare: the output inside an input directory, and an input file given as the output.
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "a.txt").write_text("some text to tokenise " * 200)
    assert main(["prepare", "--input", str(corpus), "--output", str(corpus / "prepared"), "--vocab_size", "300"]) == 2
    assert "lies inside --input" in capsys.readouterr().err and not (corpus / "prepared").exists()
    assert main(["prepare", "--input", str(corpus / "a.txt"), "--output", str(corpus / "a.txt")]) == 2
    assert "is the same path as" in capsys.readouterr().err
    # report: --out one of the files it reads (a new file beside them stays the default).
    (run / "metrics.jsonl").write_text('{"step": 1, "loss": 2.0}\n')
    metrics = (run / "metrics.jsonl").read_bytes()
    assert main(["report", str(run), "--out", str(run / "metrics.jsonl")]) == 2
    assert "--out" in capsys.readouterr().err and (run / "metrics.jsonl").read_bytes() == metrics
    (run / "metrics.jsonl").unlink()
    # train: a fresh run directory inside the checkpoint it starts from (keep_last would prune it).
    step = next((run / "checkpoints").iterdir())
    code = main(["train", "--model.flavor", "debug", "--data.path", str(small_data), "--training.steps", "2",
                 "--training.threads", "1", "--no_sample", "--model.init_from", str(step),
                 "--run_dir", str(step / "finetune")])
    assert code == 2 and "lies inside model.init_from" in capsys.readouterr().err
    assert _tree(run.parent) == before


_KILLED_EXPORT = """
import os, signal, sys
import trainforge.infer.hf_export as h
write = h.write_sharded
def write_then_die(*a, **k):  # the weights written, the directory not yet committed: SIGKILL
    write(*a, **k)
    os.kill(os.getpid(), signal.SIGKILL)
h.write_sharded = write_then_die
h.export(sys.argv[1], sys.argv[2])
"""

_LIVE_WRITER = """
import sys, time
from pathlib import Path
from trainforge.storage.atomic import make_temp_dir
print(make_temp_dir(Path(sys.argv[1])), flush=True)
time.sleep(60)
"""


def test_a_killed_exports_temporary_is_removed_by_the_next_export(run, tmp_path):
    out = tmp_path / "hf"
    killed = subprocess.run([sys.executable, "-c", _KILLED_EXPORT, str(run), str(out)], env=cli_env(),
                            capture_output=True, text=True, timeout=120)
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-2000:]
    leftovers = [p for p in tmp_path.iterdir() if p.name.startswith(".hf.tmp")]
    assert len(leftovers) == 1 and not out.exists() and any(leftovers[0].iterdir())
    live = subprocess.Popen([sys.executable, "-c", _LIVE_WRITER, str(out)], env=cli_env(), stdout=subprocess.PIPE,
                            text=True)
    try:
        live_tmp = Path(live.stdout.readline().strip())
        export(run, out)
        assert (out / "model.safetensors").is_file()
        assert not leftovers[0].exists()  # the dead writer's
        assert live_tmp.is_dir()  # a running writer's temporary is left alone
    finally:
        os.kill(live.pid, signal.SIGKILL)
        live.wait()
