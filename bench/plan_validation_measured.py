"""Validation (b) of the cost model: predicted vs measured step time on this machine.

Each layout trains the same workload (``tiny``, seq_len 128, global batch 8, fp32) for a
few steps with the real trainer under torchrun (gloo, one thread per process); the measured
step time is the median after the warm-up steps (tokens per step / the per-step
``tokens_per_s`` of ``metrics.jsonl``). The prediction is ``cost_model.estimate`` for the
same workload and layout on ``probe.measured_cluster(N)``, N the layout's process count.
Reported: the relative error per layout (target within 25%) and whether the measured-fastest
layout is among the two the cost model ranks first.

Every training run holds ``/tmp/cpu.lock`` (the probe takes it itself), so on a shared
machine no other heavy job runs at the same time; the load average is recorded per run.

    python bench/plan_validation_measured.py [--steps 12] [--warmup 4] [--json out.json]
"""

from __future__ import annotations

import argparse
import dataclasses
import fcntl
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path

from trainforge.model import FLAVORS
from trainforge.plan.spec import Layout, Workload

FLAVOR, SEQ_LEN, GLOBAL_BATCH = "tiny", 128, 8
LOCK = "/tmp/cpu.lock"


@dataclasses.dataclass(frozen=True)
class Case:
    name: str
    layout: Layout

    @property
    def n_procs(self) -> int:
        return self.layout.n_gpus

    @property
    def batch_size(self) -> int:  # sequences per micro-batch per data-parallel rank ([training] batch_size)
        return GLOBAL_BATCH // (self.layout.dp * self.layout.grad_accum_steps)


CASES = (
    Case("DDP 2", Layout(dp_replicate=2)),
    Case("FSDP2 2", Layout(dp_shard=2)),
    Case("TP 2", Layout(tp=2)),
    Case("PP 2 1f1b mb4", Layout(pp=2, microbatches=4, pp_schedule="1f1b")),
    Case("PP 2 interleaved mb4", Layout(pp=2, microbatches=4, pp_schedule="interleaved-1f1b")),
    Case("FSDP2 4", Layout(dp_shard=4)),
    Case("FSDP2 2 x TP 2", Layout(dp_shard=2, tp=2)),
    Case("3D dp2 tp2 pp2 mb2", Layout(dp_shard=2, tp=2, pp=2, microbatches=2, pp_schedule="1f1b")),
)


def workload() -> Workload:
    return Workload(model=dataclasses.replace(FLAVORS[FLAVOR], max_seq_len=SEQ_LEN), seq_len=SEQ_LEN,
                    global_batch=GLOBAL_BATCH, precision="fp32", flavor=FLAVOR)


def train_command(case: Case, run_dir: Path, steps: int) -> list[str]:
    lay = case.layout
    par = ["--parallel.dp_replicate", str(lay.dp_replicate), "--parallel.dp_shard", str(lay.dp_shard),
           "--parallel.tp", str(lay.tp), "--parallel.pp", str(lay.pp)]
    if lay.pp > 1:
        par += ["--parallel.microbatches", str(lay.microbatches), "--parallel.pp_schedule", lay.pp_schedule,
                "--parallel.pp_split", "even"]
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={case.n_procs}",
            "-m", "trainforge", "train", "--run_dir", str(run_dir), "--model.flavor", FLAVOR,
            "--training.seq_len", str(SEQ_LEN), "--training.batch_size", str(case.batch_size),
            "--training.steps", str(steps), "--training.warmup_steps", "2", "--training.log_interval", "1",
            "--training.val_interval", "0", "--training.val_batches", "1", "--training.threads", "1",
            "--checkpoint.interval", "0", "--sample.max_new_tokens", "0", "--monitor.enabled", "false", *par]


@contextmanager
def cpu_lock():
    with open(LOCK, "a") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        yield


def measure(case: Case, steps: int, warmup: int) -> dict:
    """Train ``steps`` steps at the case's layout; median step seconds after ``warmup``."""
    with tempfile.TemporaryDirectory(prefix="plan-validation-") as tmp:
        run_dir = Path(tmp) / "run"
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
        with cpu_lock():
            load_before = os.getloadavg()[0]
            t0 = time.perf_counter()
            r = subprocess.run(train_command(case, run_dir, steps), capture_output=True, text=True, env=env,
                               timeout=600)
            wall = time.perf_counter() - t0
            load_after = os.getloadavg()[0]
        if r.returncode != 0:
            raise RuntimeError(f"{case.name}: rc {r.returncode}\n{r.stderr[-4000:]}")
        records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    train = sorted((x for x in records if "tokens_per_s" in x), key=lambda x: x["step"])
    tokens_per_step = GLOBAL_BATCH * SEQ_LEN
    step_s = [tokens_per_step / x["tokens_per_s"] for x in train if x["step"] > warmup]
    return {"measured_step_s": statistics.median(step_s), "step_s_samples": step_s, "wall_s": wall,
            "load_1min": [round(load_before, 2), round(load_after, 2)]}


def predict(case: Case, clusters: dict) -> dict:
    from trainforge.plan import cost_model
    from trainforge.plan.probe import measured_cluster

    if case.n_procs not in clusters:
        clusters[case.n_procs] = measured_cluster(case.n_procs)
    est = cost_model.estimate(workload(), case.layout, clusters[case.n_procs])
    return {"predicted_step_s": est.step_s, "feasible": est.feasible, "why": est.why,
            "breakdown": {k: v for k, v in est.breakdown.items() if k.endswith("_s")}}


def measured_table(steps: int = 12, warmup: int = 4, cases=CASES, measure_fn=measure, log=print) -> dict:
    """Rows of (layout, processes, measured s, predicted s, relative error), the planner's
    ranking of the measured layouts, and whether the measured-fastest is in its top 2."""
    clusters: dict = {}
    rows = []
    for case in cases:
        row = {"layout": case.name, "n_procs": case.n_procs, **dataclasses.asdict(case.layout)}
        row.update(predict(case, clusters))
        row.update(measure_fn(case, steps, warmup))
        row["rel_error"] = row["predicted_step_s"] / row["measured_step_s"] - 1
        rows.append(row)
        log(f"{case.name:<22} N={case.n_procs} measured {row['measured_step_s']:.3f} s  "
            f"predicted {row['predicted_step_s']:.3f} s  ({row['rel_error']:+.0%})  load {row['load_1min']}")
    by_pred = sorted(rows, key=lambda r: r["predicted_step_s"])
    fastest = min(rows, key=lambda r: r["measured_step_s"])
    for i, r in enumerate(by_pred):
        r["predicted_rank"] = i + 1
    errors = [abs(r["rel_error"]) for r in rows]
    return {"rows": rows, "measured_fastest": fastest["layout"],
            "fastest_in_predicted_top2": fastest["predicted_rank"] <= 2,
            "median_abs_error": statistics.median(errors), "max_abs_error": max(errors),
            "within_25pct": sum(e <= 0.25 for e in errors), "workload": f"{FLAVOR}, seq_len {SEQ_LEN}, "
            f"global batch {GLOBAL_BATCH}, fp32, 1 thread per process", "steps": steps, "warmup": warmup,
            "clusters": {n: {"fp32_flops_per_s": c.peak_flops["fp32"], "memory_bytes_per_s":
                             c.memory_bandwidth_bytes_per_s, "allreduce_bus_bytes_per_s": c.intra.bandwidth_bytes_per_s,
                             "allreduce_latency_s": c.intra.latency_s} for n, c in clusters.items()}}


def format_table(result: dict) -> str:
    lines = [f"{'layout':<22} {'N':>2} {'measured s':>10} {'predicted s':>11} {'error':>7} {'rank':>4}"]
    for r in result["rows"]:
        lines.append(f"{r['layout']:<22} {r['n_procs']:>2} {r['measured_step_s']:>10.3f} "
                     f"{r['predicted_step_s']:>11.3f} {r['rel_error']:>+7.0%} {r['predicted_rank']:>4}")
    lines.append(f"median |error| {result['median_abs_error']:.0%}, {result['within_25pct']}/{len(result['rows'])} "
                 f"within 25%; measured fastest: {result['measured_fastest']} "
                 f"({'in' if result['fastest_in_predicted_top2'] else 'NOT in'} the predicted top 2)")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--warmup", type=int, default=4, help="steps dropped before the median")
    ap.add_argument("--only", default="", help="comma-separated layout names (default: all)")
    ap.add_argument("--json", default=None, help="also write the result here")
    a = ap.parse_args()
    cases = [c for c in CASES if not a.only or c.name in a.only.split(",")]
    result = measured_table(a.steps, a.warmup, cases, log=lambda m: print(m, file=sys.stderr, flush=True))
    print(format_table(result))
    if a.json:
        Path(a.json).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
