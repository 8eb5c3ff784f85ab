"""Calibration of a measured CPU cluster (``probe.measured_cluster``) to one workload: what a
step costs on this CPU beyond the cost model's FLOP and byte counts, measured by short runs
of the workload's own model on one process, never fitted to the layouts it then predicts.

Why: the probe's 1024^3 matmul is the best shape a CPU sees; a small model's GEMMs,
attention and dispatch reach about half of it on one thread, and a trainer step does more
than forward + backward + AdamW (clipping, the bad-step guard, loss sync, logging). Under
tensor parallelism every op also goes through DTensor's dispatch, a fixed CPU cost per op
that no collective accounts for.

Measured (``measure_samples``, 2-3 minutes for ``tiny``, under the probe lock):

1. the real trainer (``trainforge train`` under torchrun, one process, one thread) at two
   batch sizes b_lo < b_hi: seconds per step T(b), from its logging windows after the first
   (the fastest window: someone else's load spoils some, not all);
2. ``calibrate_worker`` on one process: forward + backward of the plain model at both batch
   sizes, P(b); the same with every parameter a DTensor (the TP plan on a one-rank mesh),
   D(b), and under FSDP2 on a one-rank mesh, F(b); clip + AdamW, plain and on DTensors;
3. ``calibrate_worker`` on N processes at once for each N asked (no communication): the
   slowest rank's P_N(b). ``contention(N)`` = slope of P_N / slope of P: how much a rank's
   work stretches when N processes share this CPU (x1.0 for 2 processes on this 2-vCPU VM,
   x3.0 for 4, x5.1 for 8).

Derived for a cluster of N processes (``fit_calibration``, pure arithmetic; ``C(b)``,
``M(b)``: the cost model's compute and memory-bound seconds of a one-rank layout at the
probe's N-process rates; ``O``: its AdamW at the lone-process bandwidth):

- ``matmul_efficiency`` = slope of C / (contention x slope of T - slope of M);
- ``pass_overhead_s`` = P's intercept (b -> 0): a pass's fixed cost;
- ``step_overhead_s`` = T's intercept - pass_overhead_s - O: the trainer's fixed cost per step;
- ``tp_pass_overhead_s`` / ``tp_token_overhead_s``: intercept and slope (per token) of D - P;
  ``tp_step_overhead_s``: DTensor clip + AdamW less the plain one;
- ``fsdp_pass_overhead_s`` / ``fsdp_token_overhead_s``: the same of F - P, F(b) the pass under
  FSDP2 on a one-rank mesh (its hooks and buffer copies, no byte on a link);
- every overhead (CPU time of one process) x contention.

So a one-rank layout on the calibrated cluster of one process replays the trainer's measured
step at every batch on the line through the two measured. Only for models that train here
in seconds, fp32.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import os
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

from trainforge.errors import TrainforgeError
from trainforge.plan.probe import PROBE_TIMEOUT_S, MeasuredCluster, probe_lock
from trainforge.plan.spec import Layout, Workload

TRAINER_STEPS, TRAINER_LOG_INTERVAL = 12, 4  # three logging windows; the first (warm-up) is dropped


@dataclass(frozen=True)
class Calibration:
    """The figures ``fit_calibration`` derives (module docstring) for one cluster's process count."""

    matmul_efficiency: float
    step_overhead_s: float
    pass_overhead_s: float
    tp_pass_overhead_s: float
    tp_token_overhead_s: float
    tp_step_overhead_s: float
    source: str
    fsdp_pass_overhead_s: float = 0.0
    fsdp_token_overhead_s: float = 0.0


def default_batch_sizes(workload: Workload) -> tuple[int, int]:
    """b_lo, b_hi: a quarter of the global batch and all of it (the micro-batches a layout of
    2..8 processes gives one rank lie between)."""
    hi = max(2, workload.global_batch)
    return max(1, hi // 4), hi


def _train_command(workload: Workload, batch_size: int, run_dir: Path) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=1", "-m", "trainforge",
            "train", "--run_dir", str(run_dir), "--model.flavor", workload.flavor,
            "--training.seq_len", str(workload.seq_len), "--training.batch_size", str(batch_size),
            "--training.steps", str(TRAINER_STEPS), "--training.warmup_steps", "2",
            "--training.log_interval", str(TRAINER_LOG_INTERVAL), "--training.val_interval", "0",
            "--training.val_batches", "1", "--training.threads", "1", "--checkpoint.interval", "0",
            "--sample.max_new_tokens", "0", "--monitor.enabled", "false", "--precision.policy", workload.precision]


def _run(cmd: list[str], what: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=PROBE_TIMEOUT_S, env=env)
    except subprocess.TimeoutExpired as e:
        raise TrainforgeError(f"the calibration's {what} ran past {PROBE_TIMEOUT_S:.0f} s: the machine is too "
                              "loaded or the model too large to calibrate here") from e
    if r.returncode != 0:
        raise TrainforgeError(f"the calibration's {what} failed (rc {r.returncode}): {' '.join(cmd)}\n"
                              f"{r.stderr[-3000:]}")
    return r


def window_step_s(records: Sequence[dict], tokens_per_step: float) -> list[float]:
    """Seconds per step of each logging window after the first, from ``metrics.jsonl``
    records (each training record carries its window's ``tokens_per_s``; a window's records
    share ``time_unix_s``)."""
    windows: dict[float, float] = {}
    for r in sorted((r for r in records if "tokens_per_s" in r), key=lambda r: r["step"]):
        windows.setdefault(r["time_unix_s"], tokens_per_step / r["tokens_per_s"])
    return list(windows.values())[1:]


def measure_trainer_step_s(workload: Workload, batch_size: int) -> float:
    """The trainer's seconds per step on one process at ``batch_size`` (module docstring, 1)."""
    if not workload.flavor:
        raise ValueError("calibration needs the workload's model flavor (the trainer is run with --model.flavor)")
    with tempfile.TemporaryDirectory(prefix="trainforge-calibrate-") as tmp:
        run_dir = Path(tmp) / "run"
        _run(_train_command(workload, batch_size, run_dir), f"trainer run (batch {batch_size})")
        records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = window_step_s(records, batch_size * workload.seq_len)
    if not steps:
        raise TrainforgeError(f"the calibration's trainer run (batch {batch_size}) logged no window after the first")
    return min(steps)


def _worker(workload: Workload, batch_sizes: tuple[int, int], n_procs: int, out: Path) -> dict:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={n_procs}",
           "-m", "trainforge.plan.calibrate_worker", "--out", str(out), "--flavor", workload.flavor,
           "--seq_len", str(workload.seq_len), "--batch_sizes", ",".join(map(str, batch_sizes))]
    what = f"model timing on {n_procs} process{'es' if n_procs > 1 else ''}"
    try:
        _run(cmd, what)
    except TrainforgeError:
        # Once seen in ~10 launches on 2 processes: gloo aborted a rank ("terminate called
        # without an active exception"). A measurement, not training: one more launch.
        _run(cmd, what)
    return json.loads(out.read_text())


def measure_samples(workload: Workload, batch_sizes: tuple[int, int] | None = None,
                    n_procs: Sequence[int] = ()) -> dict:
    """Run the trainer and the worker (module docstring) under the probe lock; raw samples.
    ``n_procs``: process counts to time the concurrent passes at (``concurrent[N]``)."""
    lo, hi = batch_sizes or default_batch_sizes(workload)
    if not 1 <= lo < hi:
        raise ValueError(f"calibration batch sizes must be 1 <= b_lo < b_hi, got {lo}, {hi}")
    with probe_lock(), tempfile.TemporaryDirectory(prefix="trainforge-calibrate-") as tmp:
        worker = _worker(workload, (lo, hi), 1, Path(tmp) / "worker.json")
        concurrent = {str(n): _worker(workload, (lo, hi), n, Path(tmp) / f"worker{n}.json")
                      for n in sorted(set(n_procs)) if n > 1}
        trainer = {str(b): measure_trainer_step_s(workload, b) for b in (lo, hi)}
    return {"date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
            "flavor": workload.flavor, "seq_len": workload.seq_len, "batch_sizes": [lo, hi],
            "trainer_step_s": trainer, **worker, "concurrent": concurrent}


def _line(samples: dict[str, float], lo: int, hi: int) -> tuple[float, float]:
    """(intercept, slope per sequence) of the line through the samples at lo and hi."""
    slope = (samples[str(hi)] - samples[str(lo)]) / (hi - lo)
    return samples[str(lo)] - slope * lo, slope


def contention(samples: dict, n_procs: int) -> float:
    """How much longer a pass's per-sequence cost is with ``n_procs`` processes running it at
    once than alone (``concurrent[N]`` against ``pass_s``; >= 1; 1 for one process)."""
    conc = samples.get("concurrent", {}).get(str(n_procs))
    if n_procs <= 1:
        return 1.0
    if conc is None:
        raise ValueError(f"the calibration samples have no concurrent timing on {n_procs} processes: "
                         f"measure them with n_procs including {n_procs}")
    lo, hi = samples["batch_sizes"]
    return max(1.0, _line(conc["pass_s"], lo, hi)[1] / _line(samples["pass_s"], lo, hi)[1])


def fit_calibration(cluster: MeasuredCluster, workload: Workload, samples: dict) -> Calibration:
    """The figures of ``samples`` (``measure_samples``) for ``cluster``'s N processes: one
    process's measured costs x ``contention`` against the cost model's one-rank estimates at
    the probe's N-process rates (module docstring)."""
    from trainforge.plan.cost_model import estimate

    if workload.precision != "fp32":
        raise ValueError(f"calibration runs fp32 (the probe's matmul rate), not {workload.precision!r}")
    lo, hi = samples["batch_sizes"]
    n = cluster.n_gpus
    k = contention(samples, n)
    one_rank = dataclasses.replace(cluster, matmul_efficiency=1.0)  # a 1-process layout at the N-process rates
    est = {b: estimate(dataclasses.replace(workload, global_batch=b), Layout(), one_rank).breakdown for b in (lo, hi)}
    compute, memory_bound = ({str(b): est[b][key] for b in (lo, hi)} for key in ("compute_s", "memory_bound_s"))
    t_intercept, t_slope = _line(samples["trainer_step_s"], lo, hi)
    _, c_slope = _line(compute, lo, hi)
    _, m_slope = _line(memory_bound, lo, hi)
    # A trainer slope at or under the memory-bound one would be noise: keep efficiency <= 1.
    efficiency = min(1.0, c_slope / max(k * t_slope - m_slope, c_slope))
    p_intercept, _ = _line(samples["pass_s"], lo, hi)
    pass_overhead = max(0.0, p_intercept)
    solo = dataclasses.replace(cluster, n_gpus=1, gpus_per_node=1, memory_bandwidth_bytes_per_s=cluster.solo[
        "memory_bytes_per_s"])
    optimizer = estimate(workload, Layout(), solo).breakdown["optimizer_s"]  # AdamW as the lone trainer ran it
    step_overhead = max(0.0, t_intercept - pass_overhead - optimizer)
    dtensor = {b: samples["tp_pass_s"][b] - samples["pass_s"][b] for b in samples["pass_s"]}
    d_intercept, d_slope = _line(dtensor, lo, hi)
    tp_step = max(0.0, samples["tp_opt_s"] - samples["opt_s"])
    # FSDP2's own cost (older samples lack it: 0)
    fsdp = {b: samples["fsdp_pass_s"][b] - samples["pass_s"][b] for b in samples.get("fsdp_pass_s", {})}
    f_intercept, f_slope = _line(fsdp, lo, hi) if fsdp else (0.0, 0.0)
    t = samples["trainer_step_s"]
    source = (f"measured on this machine {samples['date']}: {samples['flavor']} at batch {lo} and {hi} x "
              f"{samples['seq_len']}, one thread: trainer steps {t[str(lo)] * 1e3:.0f} / {t[str(hi)] * 1e3:.0f} ms "
              f"(per sequence {t_slope * 1e3:.1f} ms; fixed {t_intercept * 1e3:.0f} ms = pass "
              f"{pass_overhead * 1e3:.0f} + AdamW {optimizer * 1e3:.0f} + trainer {step_overhead * 1e3:.0f} ms); "
              f"DTensor (TP plan on a one-rank mesh) adds {max(0.0, d_intercept) * 1e3:.0f} ms per pass + "
              f"{max(0.0, d_slope) * 1e3:.1f} ms per sequence, {tp_step * 1e3:.0f} ms to clip + AdamW; FSDP2 (on a "
              f"one-rank mesh) adds {max(0.0, f_intercept) * 1e3:.0f} ms per pass + "
              f"{max(0.0, f_slope) * 1e3:.1f} ms per sequence; "
              f"{n} processes at once: x {k:.2f} per sequence (the model's pass on every process, no "
              f"communication), so per sequence {k * t_slope * 1e3:.1f} ms against the cost model's compute "
              f"{c_slope * 1e3:.1f} + memory-bound {m_slope * 1e3:.1f} ms at the probe's {n}-process rates")
    return Calibration(matmul_efficiency=efficiency, step_overhead_s=k * step_overhead,
                       pass_overhead_s=k * pass_overhead, tp_pass_overhead_s=k * max(0.0, d_intercept),
                       tp_token_overhead_s=k * max(0.0, d_slope) / samples["seq_len"],
                       tp_step_overhead_s=k * tp_step, source=source,
                       fsdp_pass_overhead_s=k * max(0.0, f_intercept),
                       fsdp_token_overhead_s=k * max(0.0, f_slope) / samples["seq_len"])


def apply_calibration(cluster: MeasuredCluster, cal: Calibration) -> MeasuredCluster:
    """``cluster`` with ``cal``'s figures (fitted for its process count) and their source."""
    fields = ("matmul_efficiency", "step_overhead_s", "pass_overhead_s", "tp_pass_overhead_s", "tp_token_overhead_s",
              "tp_step_overhead_s", "fsdp_pass_overhead_s", "fsdp_token_overhead_s")
    return dataclasses.replace(cluster, sources={**cluster.sources, **{k: cal.source for k in fields}},
                               **{k: getattr(cal, k) for k in fields})


def calibrate(cluster: MeasuredCluster, workload: Workload, samples: dict | None = None,
              batch_sizes: tuple[int, int] | None = None) -> MeasuredCluster:
    """``cluster`` calibrated to ``workload``: measured now (``measure_samples``) unless
    ``samples`` of an earlier measurement are given."""
    samples = samples if samples is not None else measure_samples(workload, batch_sizes, n_procs=(cluster.n_gpus,))
    return apply_calibration(cluster, fit_calibration(cluster, workload, samples))
