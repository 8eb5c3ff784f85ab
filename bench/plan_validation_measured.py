"""Validation (b) of the cost model: predicted vs measured step time on this machine.

Each layout trains the same workload (``tiny``, seq_len 128, global batch 8, fp32) for a
few steps with the real trainer under torchrun (gloo, one thread per process); the measured
step time is the median after the warm-up steps (tokens per step / the per-step
``tokens_per_s`` of ``metrics.jsonl``; every step is its own logging window, so the trainer
runs with its per-window profiler and memory tracking off: ``_plan_validation_worker.py``). The prediction is ``cost_model.estimate`` for the
same workload and layout on ``probe.measured_cluster(N)``, N the layout's process count
("predicted"), and on the same cluster calibrated to the workload ("calibrated":
``plan/calibration.py``: one-process trainer and model runs plus N-process contention,
measured once before the layouts, never fitted to them). Reported: the relative error per layout (target within 25%) and whether the measured-fastest
layout is among the two the cost model ranks first.

Every training run holds ``/tmp/cpu.lock`` (the probe takes it itself), so on a shared
machine no other heavy job runs at the same time; the load average is recorded per run.

    python bench/plan_validation_measured.py [--steps 12] [--warmup 4] [--json out.json]
    python bench/plan_validation_measured.py --only "DDP 2,TP 2" --json part.json   # a few layouts
    python bench/plan_validation_measured.py --reuse out.json   # predict again on saved measurements
    python bench/plan_validation_measured.py --reuse out.json --recalibrate --json new.json  # + calibration

Each locked job (a layout's run, the calibration) stays under 5 minutes; ``--reuse`` keeps the
saved measurements and calibration samples and only predicts again (seconds).
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
WORKER = Path(__file__).parent / "_plan_validation_worker.py"  # the trainer, its per-step observers off


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
    Case("PP 2 zbv mb4", Layout(pp=2, microbatches=4, pp_schedule="zbv")),  # the calibrated planner's first pick
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
            str(WORKER), "train", "--run_dir", str(run_dir), "--model.flavor", FLAVOR,
            "--training.seq_len", str(SEQ_LEN), "--training.batch_size", str(case.batch_size),
            "--training.steps", str(steps), "--training.warmup_steps", "2", "--training.log_interval", "1",
            "--training.val_interval", "0", "--training.val_batches", "1", "--training.threads", "1",
            "--checkpoint.interval", "0", "--sample.max_new_tokens", "0", "--monitor.enabled", "false", *par]


@contextmanager
def cpu_lock():
    with open(LOCK, "a") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        yield


def _busy_cpu_s() -> float:
    """CPU seconds all processes on the machine have spent busy (``/proc/stat``, first line)."""
    fields = [float(x) for x in open("/proc/stat").readline().split()[1:]]
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0.0)  # idle + iowait
    return (sum(fields[:8]) - idle) / os.sysconf("SC_CLK_TCK")


def _run_once(case: Case, steps: int, warmup: int) -> dict:
    with tempfile.TemporaryDirectory(prefix="plan-validation-") as tmp:
        run_dir = Path(tmp) / "run"
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
        with cpu_lock():
            load_before = os.getloadavg()[0]
            busy0, ours0 = _busy_cpu_s(), _children_cpu_s()
            t0 = time.perf_counter()
            r = subprocess.run(train_command(case, run_dir, steps), capture_output=True, text=True, env=env,
                               timeout=600)
            wall = time.perf_counter() - t0
            busy, ours = _busy_cpu_s() - busy0, _children_cpu_s() - ours0
        if r.returncode != 0:
            raise RuntimeError(f"{case.name}: rc {r.returncode}\n{r.stderr[-4000:]}")
        records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    train = sorted((x for x in records if "tokens_per_s" in x), key=lambda x: x["step"])
    tokens_per_step = GLOBAL_BATCH * SEQ_LEN
    step_s = [tokens_per_step / x["tokens_per_s"] for x in train if x["step"] > warmup]
    # Other processes' CPU use during the run, in cores: the machine's busy time less ours.
    other_cores = max(0.0, busy - ours) / wall
    return {"measured_step_s": statistics.median(step_s), "step_s_samples": step_s, "wall_s": wall,
            "load_1min": round(load_before, 2), "other_cores": round(other_cores, 2)}


def _children_cpu_s() -> float:
    import resource

    ru = resource.getrusage(resource.RUSAGE_CHILDREN)
    return ru.ru_utime + ru.ru_stime


def measure(case: Case, steps: int, warmup: int, max_other_cores: float = 0.25, attempts: int = 2) -> dict:
    """Train ``steps`` steps at the case's layout; median step seconds after ``warmup``. The
    machine is shared: a run during which other processes used more than ``max_other_cores``
    cores is repeated (up to ``attempts`` runs), and the least disturbed one kept."""
    best = None
    for _ in range(attempts):
        r = _run_once(case, steps, warmup)
        if best is None or r["other_cores"] < best["other_cores"]:
            best = r
        if r["other_cores"] <= max_other_cores:
            break
    return best


def predict(case: Case, clusters: dict, calibrated: dict, calibration: dict) -> dict:
    """The case's estimate on ``measured_cluster(N)`` (uncalibrated) and on the same cluster
    calibrated (``plan/calibration.py``: one-process runs of the workload's model, measured
    once per table and shared by every N; ``calibration["samples"]`` when reused)."""
    from trainforge.plan import cost_model
    from trainforge.plan.calibration import calibrate, measure_samples
    from trainforge.plan.probe import measured_cluster

    n = case.n_procs
    if n not in clusters:
        clusters[n] = measured_cluster(n)
        if "samples" not in calibration:
            calibration["samples"] = measure_samples(workload(), n_procs=sorted({c.n_procs for c in CASES}))
        calibrated[n] = calibrate(clusters[n], workload(), calibration["samples"])
        calibration.setdefault("source", calibrated[n].sources["matmul_efficiency"].split("; x ")[0])
    est = cost_model.estimate(workload(), case.layout, clusters[n])
    cal = cost_model.estimate(workload(), case.layout, calibrated[n])
    return {"predicted_step_s": est.step_s, "calibrated_step_s": cal.step_s, "feasible": est.feasible,
            "why": est.why, "breakdown": {k: v for k, v in est.breakdown.items() if k.endswith("_s")},
            "calibrated_breakdown": {k: v for k, v in cal.breakdown.items() if k.endswith("_s")}}


def _rank(rows: list[dict], key: str) -> None:
    for i, r in enumerate(sorted(rows, key=lambda r: r[f"{key}_step_s"])):
        r[f"{key}_rank"] = i + 1


def measured_table(steps: int = 12, warmup: int = 4, cases=CASES, measure_fn=measure, log=print,
                   reuse: dict | None = None, calibration_samples: dict | None = None) -> dict:
    """Rows of (layout, processes, measured s, predicted s, relative error; the same
    calibrated), the cost model's ranking of the measured layouts, and whether the
    measured-fastest is in its top 2. ``reuse``: {layout name: row} of an earlier run whose
    measurements are kept (only the predictions are made again); ``calibration_samples``:
    that run's calibration measurement (else it is measured now)."""
    clusters: dict = {}
    calibrated: dict = {}
    calibration: dict = {"samples": calibration_samples} if calibration_samples else {}
    rows = []
    for case in cases:
        row = {"layout": case.name, "n_procs": case.n_procs, **dataclasses.asdict(case.layout)}
        row.update(predict(case, clusters, calibrated, calibration))
        if reuse and case.name in reuse:
            row.update({k: reuse[case.name][k] for k in ("measured_step_s", "step_s_samples", "wall_s",
                                                           "load_1min", "other_cores")})
        else:
            row.update(measure_fn(case, steps, warmup))
        row["rel_error"] = row["predicted_step_s"] / row["measured_step_s"] - 1
        row["calibrated_rel_error"] = row["calibrated_step_s"] / row["measured_step_s"] - 1
        rows.append(row)
        log(f"{case.name:<22} N={case.n_procs} measured {row['measured_step_s']:.3f} s  "
            f"predicted {row['predicted_step_s']:.3f} s ({row['rel_error']:+.0%}), calibrated "
            f"{row['calibrated_step_s']:.3f} s ({row['calibrated_rel_error']:+.0%})  load {row['load_1min']}, "
            f"others {row['other_cores']} cores")
    _rank(rows, "predicted")
    _rank(rows, "calibrated")
    _rank(rows, "measured")
    fastest = min(rows, key=lambda r: r["measured_step_s"])
    out = {"rows": rows, "measured_fastest": fastest["layout"], "workload": f"{FLAVOR}, seq_len {SEQ_LEN}, "
           f"global batch {GLOBAL_BATCH}, fp32, 1 thread per process", "steps": steps, "warmup": warmup,
           "calibration_samples": calibration.get("samples"), "calibration": calibration.get("source"),
           "clusters": {n: {"fp32_flops_per_s": c.peak_flops["fp32"], "memory_bytes_per_s":
                            c.memory_bandwidth_bytes_per_s, "link_bandwidth_bytes_per_s": c.intra.bandwidth_bytes_per_s,
                            "link_latency_s": c.intra.latency_s, "link_source": c.intra.source,
                            "comm_overlaps_compute": c.comm_overlaps_compute,
                            **{k: getattr(calibrated[n], k) for k in CALIBRATED_FIELDS}}
                        for n, c in clusters.items()}}
    for key in ("predicted", "calibrated"):
        errors = [abs(r[f"{'rel' if key == 'predicted' else 'calibrated_rel'}_error"]) for r in rows]
        out[key] = {"median_abs_error": statistics.median(errors), "max_abs_error": max(errors),
                    "within_25pct": sum(e <= 0.25 for e in errors),
                    "fastest_in_top2": fastest[f"{key}_rank"] <= 2}
    return out


CALIBRATED_FIELDS = ("matmul_efficiency", "step_overhead_s", "pass_overhead_s", "tp_pass_overhead_s",
                     "tp_token_overhead_s", "tp_step_overhead_s", "fsdp_pass_overhead_s", "fsdp_token_overhead_s")
# What each term of the calibrated estimate contributed (cost_model breakdown keys, seconds per step).
TERMS = (("compute", "compute_s"), ("mem-bound", "memory_bound_s"), ("optimizer", "optimizer_s"),
         ("tp comm", "tp_comm_s"), ("dp comm", "dp_comm_s"), ("bubble", "bubble_s"),
         ("sync", "sync_s"), ("pass ovh", "pass_overhead_s"), ("step ovh", "step_overhead_s"),
         ("exposed comm", "exposed_comm_s"))


def format_terms(result: dict) -> str:
    """Per layout, the calibrated estimate's parts in ms (dp comm: all of it; exposed comm:
    what the step pays of tp + dp + pp traffic)."""
    lines = [f"{'layout':<22} " + " ".join(f"{name:>9}" for name, _ in TERMS) + f" {'total':>7}"]
    for r in result["rows"]:
        b = r["calibrated_breakdown"]
        lines.append(f"{r['layout']:<22} " + " ".join(f"{b.get(k, 0.0) * 1e3:>9.0f}" for _, k in TERMS)
                     + f" {r['calibrated_step_s'] * 1e3:>7.0f}")
    return "\n".join(lines)


def format_table(result: dict) -> str:
    lines = [f"{'layout':<22} {'N':>2} {'measured s':>10} {'predicted s':>11} {'error':>6} {'calibrated s':>12} "
             f"{'error':>6} {'rank m/p/c':>10} {'others':>6}"]
    for r in result["rows"]:
        ranks = f"{r['measured_rank']}/{r['predicted_rank']}/{r['calibrated_rank']}"
        lines.append(f"{r['layout']:<22} {r['n_procs']:>2} {r['measured_step_s']:>10.3f} "
                     f"{r['predicted_step_s']:>11.3f} {r['rel_error']:>+6.0%} {r['calibrated_step_s']:>12.3f} "
                     f"{r['calibrated_rel_error']:>+6.0%} {ranks:>10} {r['other_cores']:>6.2f}")
    for key in ("predicted", "calibrated"):
        k = result[key]
        lines.append(f"{key}: median |error| {k['median_abs_error']:.0%}, {k['within_25pct']}/{len(result['rows'])} "
                     f"within 25%; measured fastest ({result['measured_fastest']}) "
                     f"{'in' if k['fastest_in_top2'] else 'NOT in'} its top 2")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--warmup", type=int, default=4, help="steps dropped before the median")
    ap.add_argument("--only", default="", help="comma-separated layout names (default: all)")
    ap.add_argument("--json", default=None, help="also write the result here")
    ap.add_argument("--reuse", default=None, help="a --json file of an earlier run: keep its measurements, "
                                                  "predict again (after a cost model change)")
    ap.add_argument("--recalibrate", action="store_true", help="with --reuse: measure the calibration again "
                                                              "(after a change to what it measures), keep the layouts")
    a = ap.parse_args()
    cases = [c for c in CASES if not a.only or c.name in a.only.split(",")]
    old = json.loads(Path(a.reuse).read_text()) if a.reuse else {}
    reuse = {r["layout"]: r for r in old["rows"]} if a.reuse else None
    result = measured_table(a.steps, a.warmup, cases, log=lambda m: print(m, file=sys.stderr, flush=True),
                            reuse=reuse, calibration_samples=None if a.recalibrate else old.get("calibration_samples"))
    print(format_table(result))
    print(format_terms(result))
    print(f"calibration: {result['calibration']}")
    if a.json:
        Path(a.json).write_text(json.dumps(result, indent=1))



def print_measured(result: dict) -> None:
    print(f"Validation (b): predicted vs measured step time on this machine ({result['workload']})")
    print(format_table(result))


def measured_table_if_asked() -> dict | None:
    """For ``bench/plan_validation.py``'s TABLES: the measured table takes minutes of
    training runs, so it is built only with TRAINFORGE_PLAN_MEASURED=1 (else None: skipped)."""
    return measured_table() if os.environ.get("TRAINFORGE_PLAN_MEASURED") == "1" else None


# ("measured", measured_table_if_asked, print_measured): the entry bench/plan_validation.py's TABLES takes.
TABLE = ("measured", measured_table_if_asked, print_measured)


if __name__ == "__main__":
    main()
