"""Compressed gradient communication under torchrun (gloo): the collective's accuracy
and wire bytes, replicas in sync bit for bit through the real trainer (DDP, HSDP,
PP), exact resume with error feedback, and the PowerSGD baseline."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pytest

from tests.parallel.test_data_parallel import losses, run, train_cmd
from tests.parallel.torchrun import Prepared, run_torchrun, run_train_many
from trainforge.monitor.jsonl import read_jsonl

WORKERS = Path(__file__).parent / "workers"
pytestmark = pytest.mark.slow


@pytest.mark.parametrize("nproc", [2, 4])
def test_compressed_all_reduce_matches_the_fp32_mean_within_the_codec_bound(nproc):
    r = run_torchrun(WORKERS / "allreduce.py", nproc, timeout_s=180)
    rows = {d["codec"]: d for d in map(json.loads, (ln for ln in r.stdout.splitlines() if ln.startswith("{")))}
    assert set(rows) == {"none", "int8", "int4", "topk", "topk+int4"}
    for name, d in rows.items():
        assert d["identical"], f"{name}: ranks decoded different results"
        assert d["bytes_sent"] == d["expected_bytes"], name  # counted = what the two collectives move
    assert rows["none"]["worst_over_bound"] < 1e-6
    assert rows["int8"]["worst_over_bound"] <= 1.0 and rows["int4"]["worst_over_bound"] <= 1.0
    # Wire bytes per rank stay ~2(n-1)/n x size x bits/32 for any n (not x n as an all-gather would).
    assert rows["int8"]["ratio"] < 0.27 and rows["int4"]["ratio"] < 0.14
    assert rows["topk+int4"]["ratio"] < rows["topk"]["ratio"] < rows["int4"]["ratio"]
    assert rows["int8"]["rel_err"] < rows["int4"]["rel_err"]


LAYOUTS = {
    "ddp2-int4": (2, ["--parallel.dp_replicate", "2", "--compression.codec", "int4"]),
    "hsdp2x2-adaptive": (4, ["--parallel.dp_replicate", "2", "--parallel.dp_shard", "2",
                             "--compression.codec", "adaptive"]),
    # The host thread's reduction, one step delayed (compression.host_reduce).
    "ddp2-host-int4": (2, ["--parallel.dp_replicate", "2", "--compression.codec", "int4",
                           "--compression.host_reduce", "true",
                           "--compression.host_reduce_delay", "1"]),
    # Intra-node reduce-scatter on the device, inter-node from the host: delay 0 must equal
    # hsdp2x2-adaptive to the last bit (test below), delay 1 keeps the replicas in sync.
    "hsdp2x2-host0-adaptive": (4, ["--parallel.dp_replicate", "2", "--parallel.dp_shard", "2",
                                   "--compression.codec", "adaptive", "--compression.host_reduce", "true",
                                   "--compression.host_reduce_delay", "0"]),
    "hsdp2x2-host-int4": (4, ["--parallel.dp_replicate", "2", "--parallel.dp_shard", "2",
                              "--compression.codec", "int4", "--compression.host_reduce", "true",
                              "--compression.host_reduce_delay", "1"]),
    "pp2-dp2-int4": (4, ["--parallel.dp_replicate", "2", "--parallel.pp", "2", "--parallel.pp_split", "even",
                         "--compression.codec", "int4"]),
}


@pytest.fixture(scope="module")
def sync_runs(tmp_path_factory, small_data):
    """``get(nproc)``: the LAYOUTS runs of that world size, in ONE launch of
    workers/sync_check.py the first time a test asks for it, as {run directory: its SYNC
    line}. Returns (root: run directories by layout name, get)."""
    root = tmp_path_factory.mktemp("sync_runs")
    made: dict[int, dict[str, str]] = {}

    def get(nproc: int) -> dict[str, str]:
        if nproc not in made:
            runs = [[str(root / name), ["--data.path", str(small_data), "--model.flavor", "debug",
                                        "--training.seq_len", "32", "--training.steps", "8",
                                        "--training.log_interval", "4", "--training.val_interval", "0",
                                        "--training.val_batches", "2", "--sample.max_new_tokens", "0",
                                        "--training.threads", "1", "--compression.warmup_steps", "2", *extra]]
                    for name, (n, extra) in LAYOUTS.items() if n == nproc]
            r = run_torchrun(WORKERS / "sync_check.py", nproc, json.dumps(runs), timeout_s=240)
            made[nproc] = {ln.split()[1]: ln for ln in r.stdout.splitlines() if ln.startswith("SYNC ")}
        return made[nproc]
    return root, get


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_replicas_stay_bit_identical_and_report_wire_bytes(layout, sync_runs):
    root, get = sync_runs
    line = get(LAYOUTS[layout][0])[str(root / layout)]
    assert "mismatched=[]" in line and "checked=0" not in line, line
    records = [rec for rec in read_jsonl(root / layout / "metrics.jsonl") if "wire_bytes_per_step" in rec]
    assert records, "no wire accounting in the metrics"
    last = records[-1]
    # After warm-up every bucket is at 4 bits (int4, and adaptive on these smooth early gradients).
    assert set(last["compression_bits"].values()) == {4}
    assert 0.12 < last["wire_ratio_vs_fp32"] < 0.14
    first = records[0]  # steps 1-4: two fp32 warm-up steps among them
    assert first["wire_ratio_vs_fp32"] > 0.5


def test_host_reduce_without_delay_under_hsdp_equals_the_device_reduction(sync_runs):
    root, get = sync_runs
    get(4)
    got, want = losses(root / "hsdp2x2-host0-adaptive"), losses(root / "hsdp2x2-adaptive")
    assert len(want) == 8 and got == want  # tolerance 0: the same reduction, on the host thread


RESUME_LAYOUTS = {
    "ddp2-int4-ef": (2, ["--parallel.dp_replicate", "2", "--compression.codec", "int4",
                         "--compression.stochastic_rounding", "true"]),
    "hsdp2x2-adaptive": (4, ["--parallel.dp_replicate", "2", "--parallel.dp_shard", "2",
                             "--compression.codec", "adaptive", "--compression.target_rel_error", "0.05"]),
    # Exact only if the reduced gradient in flight at the checkpoint is saved with it.
    "ddp2-host-int4": (2, ["--parallel.dp_replicate", "2", "--compression.codec", "int4",
                           "--compression.host_reduce", "true",
                           "--compression.host_reduce_delay", "1"]),
}


def interrupted_after_step_3(straight, resumed):
    """``resumed``: the 6-step run ``straight`` as it was after its step-3 checkpoint (one
    launch fewer than training 3 steps again). Later metrics are dropped too, so steps 4-6
    can only come from the resumed run."""
    shutil.copytree(straight, resumed)
    shutil.rmtree(resumed / "checkpoints" / "step_0000006")
    metrics = resumed / "metrics.jsonl"
    lines = metrics.read_text().splitlines(keepends=True)
    metrics.write_text("".join(ln for ln in lines if json.loads(ln).get("step", 0) <= 3))


NO_STATE = ["--parallel.dp_replicate", "2", "--compression.codec", "int4", "--compression.warmup_steps", "1"]
POWERSGD = ["--compression.codec", "powersgd", "--compression.warmup_steps", "2"]


def drop_compression_state(ckpt_dir: Path) -> None:
    """Make ``ckpt_dir`` a checkpoint saved without compression state (as by a run that had
    none): drop the files and their entries in meta.json, which lists every file's sha256."""
    shutil.rmtree(ckpt_dir / "compression")
    meta = json.loads((ckpt_dir / "meta.json").read_text())
    meta["files"] = {k: v for k, v in meta["files"].items() if not k.startswith("compression/")}
    (ckpt_dir / "meta.json").write_text(json.dumps(meta))


def resumable_copy(straight: str, resumed: str, without_compression_state: bool) -> None:
    """The prepare step (on rank 0, in the launch) of a resumed run: ``resumed`` is
    ``straight`` interrupted after step 3, its step-3 checkpoint stripped of the
    compression state if ``without_compression_state``."""
    interrupted_after_step_3(Path(straight), Path(resumed))
    if without_compression_state:
        drop_compression_state(Path(resumed) / "checkpoints" / "step_0000003")


@pytest.fixture(scope="module")
def resume_runs(tmp_path_factory, small_data):
    """The CLI runs of the resume tests, the PowerSGD baseline and its refusal with FSDP2, by
    world size in one torchrun launch each (tests/parallel/workers/cli_many.py: one after
    another through the real CLI), two launches instead of eight: the uninterrupted runs,
    then their step-3 copies (made in the launch) resumed. Returns (root: run directories by
    name, name -> CompletedProcess)."""
    root = tmp_path_factory.mktemp("compressed_runs")

    def fresh(name, *extra):
        return train_cmd(1, root / name, small_data, *extra)[4:]  # the arguments after `trainforge train`

    straight = {f"{n}-straight": (nproc, [*extra, "--compression.warmup_steps", "1"])
                for n, (nproc, extra) in RESUME_LAYOUTS.items()}
    straight["no-state-straight"] = (2, NO_STATE)
    done = {}
    for nproc in (2, 4):
        runs = {name: fresh(name, *extra) for name, (n, extra) in straight.items() if n == nproc}
        if nproc == 2:
            runs["powersgd-ddp"] = fresh("powersgd-ddp", "--parallel.dp_replicate", "2", *POWERSGD)
        for name, (n, extra) in straight.items():
            resumed = name.replace("-straight", "-resumed")
            if n == nproc:
                runs[resumed] = Prepared([*fresh(resumed, *extra), "--resume", str(root / resumed)], resumable_copy,
                                         (str(root / name), str(root / resumed), name == "no-state-straight"))
        if nproc == 4:  # refused on every rank before any work: the launch goes on
            runs["powersgd-hsdp"] = fresh("powersgd-hsdp", "--parallel.dp_replicate", "2", "--parallel.dp_shard",
                                          "2", *POWERSGD)
        done |= run_train_many(nproc, runs)
    return root, done


@pytest.mark.parametrize("layout", list(RESUME_LAYOUTS))
def test_resume_with_error_feedback_is_bit_identical(layout, resume_runs):
    root, done = resume_runs
    straight, resumed = root / f"{layout}-straight", root / f"{layout}-resumed"
    assert done[f"{layout}-straight"].returncode == 0 and done[f"{layout}-resumed"].returncode == 0
    assert (resumed / "checkpoints" / "step_0000003" / "compression" / "rank_00000.pt").is_file()
    assert losses(resumed) == losses(straight)  # exact: residuals, widths and RNG restored


def test_resume_without_compression_state_differs(resume_runs):
    """The control for the test above: residuals are what make resume exact."""
    root, done = resume_runs
    straight, resumed = root / "no-state-straight", root / "no-state-resumed"
    r = done["no-state-resumed"]
    assert done["no-state-straight"].returncode == 0 and r.returncode == 0
    assert "no compression state" in r.stdout + r.stderr
    got, want = losses(resumed), losses(straight)
    assert all(got[s] == want[s] for s in (1, 2, 3)) and got[6] != want[6]


def test_powersgd_baseline_under_ddp_and_refused_with_fsdp(resume_runs):
    root, done = resume_runs
    assert done["powersgd-ddp"].returncode == 0
    last = [rec for rec in read_jsonl(root / "powersgd-ddp" / "metrics.jsonl") if "wire_ratio_vs_fp32" in rec][-1]
    assert last["wire_ratio_vs_fp32"] < 0.9
    r = done["powersgd-hsdp"]
    assert r.returncode == 2, r.stderr[-3000:]
    assert "compression.codec" in r.stderr and "plain DDP only" in r.stderr
    assert not (root / "powersgd-hsdp").exists()  # refused before anything was written


def test_codec_without_a_replicate_axis_warns_and_trains(tmp_path, small_data):
    r = run([sys.executable, "-m", "trainforge", "train", "--run_dir", str(tmp_path / "one"), "--data.path",
             str(small_data), "--model.flavor", "debug", "--training.seq_len", "32", "--training.steps", "2",
             "--sample.max_new_tokens", "0", "--compression.codec", "int4"])
    assert "has no effect" in r.stdout + r.stderr and "dp_replicate" in r.stdout + r.stderr
