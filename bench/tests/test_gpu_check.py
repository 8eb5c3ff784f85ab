"""bench/gpu_check.py: its reduced form runs every part on CPU (so the GPU check never rots
between the rare runs on a lent GPU), and its published-figure lookup reads the planner's table."""

from __future__ import annotations

import json
import math
import subprocess
import sys
import time
import types
from pathlib import Path

import pytest

import trainforge.plan
from bench import gpu_check
from trainforge.plan.spec import Cluster, LinkTier

ROOT = Path(__file__).resolve().parents[2]


def numbers(x):
    """Every int/float inside a JSON value."""
    if isinstance(x, bool):
        return
    if isinstance(x, (int, float)):
        yield x
    elif isinstance(x, dict):
        for v in x.values():
            yield from numbers(v)
    elif isinstance(x, list):
        for v in x:
            yield from numbers(v)


@pytest.fixture(scope="module")
def reduced_report(tmp_path_factory):
    out = tmp_path_factory.mktemp("gpu_check") / "gpu.json"
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "gpu_check.py"), "--reduced", "--device", "cpu",
                           "--json", str(out), "--work_dir", str(out.parent / "work")],
                          capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(out.read_text()), proc


@pytest.mark.slow  # one ~30 s run of the script (three training processes) shared by these tests
def test_reduced_run_reports_every_part_with_finite_figures(reduced_report):
    report, proc = reduced_report
    sections = report["sections"]
    assert report["mode"] == "reduced" and set(sections) == set(gpu_check.PARTS)
    ran = {k for k, v in sections.items() if v["status"] == "ok"}
    # train_compile is opt-in on CPU (--compile); everything else runs, none fails.
    assert ran == set(gpu_check.PARTS) - {"train_compile"}, {k: v.get("reason") or v.get("error")
                                                              for k, v in sections.items()}
    assert "--compile" in sections["train_compile"]["reason"]
    for name in ran:
        values = list(numbers(sections[name]))
        assert values and all(math.isfinite(v) for v in values), (name, sections[name])
    assert sections["matmul"]["best"]["fp32"]["tflops"] > 0, sections["matmul"]
    assert any(r["dtype"] == "fp8" and "sm >= 89" in r["skipped"] for r in sections["matmul"]["rows"])
    assert sections["bandwidth"]["copy"]["bytes_per_s"] > 0, sections["bandwidth"]
    for batch in (1, 32):
        d = sections["decode"][f"batch_{batch}"]
        assert d["tokens_per_s"] > 0 and d["bound_tokens_per_s"] > 0, sections["decode"]
    assert "gpu_check (reduced)" in proc.stderr  # the table


@pytest.mark.slow  # one ~30 s run of the script (three training processes) shared by these tests
def test_reduced_train_runs_read_the_trainers_metrics(reduced_report):
    sections = reduced_report[0]["sections"]
    plain, fsdp2 = sections["train"], sections["train_fsdp2"]
    assert plain["data_parallel"] == "none" and plain["fsdp_units"] == 0
    # The FSDP2 variant really shards: per-block units plus the root, over a 1-rank mesh.
    assert fsdp2["data_parallel"] == "fsdp" and fsdp2["fsdp_units"] >= 3
    for run in (plain, fsdp2):
        assert run["tokens_per_s"] > 0 and 0 < run["mfu"] <= 1 and run["windows"] == 3
        assert math.isfinite(run["final_loss"])


@pytest.mark.slow  # one ~30 s run of the script (three training processes) shared by these tests
def test_reduced_run_counts_the_cuda_marked_tests(reduced_report):
    tests = reduced_report[0]["sections"]["tests"]
    marked = gpu_check.cuda_test_files()
    assert "tests/test_train.py" in marked and "tests/data/test_loader.py" in marked
    assert tests["failed"] == 0 and tests["errors"] == 0
    assert tests["passed"] + tests["skipped"] >= len(marked)  # skipped on CPU, run on a GPU


def test_published_figures_come_from_the_planner_table_when_it_exists(monkeypatch):
    h200 = Cluster(name="h200", n_gpus=1, gpus_per_node=8, peak_flops={"bf16": 989e12, "fp8": 1979e12},
                   memory_bytes=141e9, memory_bandwidth_bytes_per_s=4.8e12,
                   intra=LinkTier(450e9, 3e-6), inter=LinkTier(50e9, 5e-6))
    fake = types.ModuleType("trainforge.plan.hardware")
    fake.cluster = lambda name, n_gpus: h200 if name == "h200" else None
    monkeypatch.setitem(sys.modules, "trainforge.plan.hardware", fake)
    monkeypatch.setattr(trainforge.plan, "hardware", fake, raising=False)
    assert gpu_check.published_bandwidth("NVIDIA H200") == (4.8e12, "plan.hardware h200")
    assert gpu_check.published_flops("NVIDIA H200", "fp8")[0] == 1979e12
    assert gpu_check.published_bandwidth("NVIDIA L4") is None  # not in the planner's table
    assert gpu_check.published_bandwidth("NVIDIA H200 NVL") is None  # the table's H200 is the SXM part


def test_without_the_planner_table_flops_fall_back_to_the_mfu_table(monkeypatch):
    monkeypatch.setitem(sys.modules, "trainforge.plan.hardware", None)  # import fails
    monkeypatch.delattr(trainforge.plan, "hardware", raising=False)
    assert gpu_check.published_bandwidth("NVIDIA H200") is None
    assert gpu_check.published_flops("NVIDIA H200", "bf16")[0] == pytest.approx(989.4e12)
    assert gpu_check.published_flops("NVIDIA H200", "fp8") is None


def test_a_whole_check_limit_too_short_skips_the_parts_naming_why(tmp_path):
    out = tmp_path / "gpu.json"
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "gpu_check.py"), "--device", "cpu", "--budget_s", "1",
                           "--json", str(out)], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-2000:]
    sections = json.loads(out.read_text())["sections"]
    assert {s["status"] for s in sections.values()} == {"skipped"}
    assert "left of --budget_s" in sections["matmul"]["reason"]


def test_a_child_past_its_budget_is_killed_with_its_process_group():
    t0 = time.monotonic()
    # The child starts a grandchild (as torch.compile's workers are) that would outlive it.
    code = ("import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']); "
            "time.sleep(60)")  # a surviving grandchild would hold the pipes open: communicate() would wait 60 s
    assert gpu_check.run_child([sys.executable, "-c", code], timeout_s=1.0) is None
    assert time.monotonic() - t0 < 20
