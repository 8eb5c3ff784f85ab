"""``--machine measured``: this machine as a planner ``Cluster``, from a short probe.

A CPU cluster's "GPU" is one process with one thread (how the trainer runs under torchrun
with ``--training.threads 1``); ``n_procs`` of them share one node. ``probe_worker.py``,
launched under torchrun (the project's only launcher) with ``n_procs`` processes, measures
with all of them running at once (so on a machine with fewer cores than processes the rates
are each process's share, as a training job sees them):

- the matmul rate per process, fp32, and bf16 where ``precision/hardware.py``'s probe says
  bf16 matmuls are fast here (``peak_flops``; ``matmul_efficiency`` stays 1: the figure is an
  achieved rate, not a datasheet peak);
- memory bandwidth per process (a tensor copy larger than the last-level cache);
- gloo all-reduce, all-gather, reduce-scatter and ring send/recv for group sizes 2..n_procs
  (n_procs // k groups of k at once, as a layout's groups run) at 4 KB .. 16 MB, fitted per
  (op, group size) to ``seconds = alpha + beta x bytes`` (``fit_alpha_beta``; kept in
  ``MeasuredCluster.collectives``). The ``intra`` tier (and ``inter``: one node) is the one
  latency and bus bandwidth that best explain all those samples under ``comm_model``'s
  formulas (``fit_tier``: its all-reduce charges 2 log2(k) latencies, not one), so the cost
  model reads the figures it was measured for.
- synchronisation: a 4-byte all-reduce between compute chunks against back to back, per group
  size (``MeasuredCluster.sync_s``: the difference, what each blocking collective of a step
  costs beyond its own time).

With as many processes as cores or more, ``comm_overlaps_compute`` is False: gloo's
collective threads need the cores every rank computes on, so "overlapped" data-parallel
traffic is in fact added to the step. ``calibration.py`` adds what a step costs beyond the
FLOP and byte counts for one workload (matmul efficiency at its shapes, fixed CPU costs per
pass and per step, DTensor's dispatch), from short one-process runs of its model.

The profile is cached as JSON (``machine_profile.json`` in the cache directory) keyed by CPU
model, core count, torch version and process count: the probe takes tens of seconds, the
machine does not change between runs. Every probe holds an exclusive lock on ``PROBE_LOCK``
(``flock(1)`` takes the same lock): two probes at once would each measure half the machine.
The wait for it is bounded (``probe_lock``), and under an outer ``flock`` of the same file
(an ancestor holds it) the probe runs under that lock rather than waiting for itself.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import math
import os
import subprocess
import sys
import tempfile
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator, Sequence

import torch

from trainforge.errors import TrainforgeError
from trainforge.json_cache import read_json_cache, write_json_cache
from trainforge.plan.probe_worker import OPS
from trainforge.plan.spec import Cluster, LinkTier
from trainforge.storage.locks import wait_for_lock

CACHE_FILE = "machine_profile.json"
PROFILE_VERSION = 3  # bump when the worker measures differently: older cache entries are re-probed
# The lock heavy CPU jobs on a shared machine take (``flock /tmp/cpu.lock <command>``);
# TRAINFORGE_PROBE_LOCK overrides it, an empty value takes none.
PROBE_LOCK = "/tmp/cpu.lock"
# How long a probe waits for another job's lock (TRAINFORGE_PROBE_LOCK_WAIT_S overrides): a probe
# takes 20-60 s and a calibration ~3 min, so 10 min covers one of each queued ahead.
PROBE_LOCK_WAIT_S = 600.0
PROBE_TIMEOUT_S = 300.0
# lscpu flags worth naming in ``sources`` (what the matmul kernels can use); the full list is kept too.
_KEY_FLAGS = ("avx2", "fma", "avx512f", "avx512_bf16", "avx512_fp16", "amx_bf16", "amx_tile", "avx512_vnni")


@dataclass(frozen=True)
class OpFit:
    """``seconds = alpha_s + beta_s_per_byte x nbytes`` for one op at one group size, and how
    well it fits its samples (the largest |predicted - measured| / measured)."""

    alpha_s: float
    beta_s_per_byte: float
    max_rel_error: float


@dataclass(frozen=True)
class MeasuredCluster(Cluster):
    """A ``Cluster`` measured here; ``collectives[op][group_size]`` is the op's own fit
    (ops: all_reduce, all_gather, reduce_scatter, send_recv; nbytes of all_gather and
    reduce_scatter is the full, gathered tensor; of send_recv, one message)."""

    collectives: dict[str, dict[int, OpFit]] = field(default_factory=dict)
    # group size -> seconds a blocking collective adds between compute beyond its back-to-back
    # time (the worker's ``sync_s``: between_compute - back_to_back, >= 0)
    sync_s: dict[int, float] = field(default_factory=dict)
    # What one process reached alone (the others idle): fp32_flops_per_s, memory_bytes_per_s.
    solo: dict[str, float] = field(default_factory=dict)


def _weighted_lsq2(rows: Sequence[tuple[float, float]], seconds: Sequence[float]) -> tuple[float, float, float]:
    """(x, y, largest relative error) of the fit ``seconds ~ x * u + y * v`` over rows (u, v),
    least squares in relative terms (each residual over its measured time): the sizes span
    four decades, and a plain fit would be the 16 MB samples' alone, leaving the latency
    (microseconds) to their noise (milliseconds). Both come out positive: a negative x
    (latency; noise at small sizes) is replaced by the tightest bound the samples give,
    min(t / u), and y refitted with it fixed."""
    if len(rows) != len(seconds) or len(rows) < 2:
        raise ValueError(f"the alpha-beta fit needs >= 2 (nbytes, seconds) pairs, got {len(rows)} and {len(seconds)}")
    if min(seconds) <= 0:
        raise ValueError(f"the alpha-beta fit: times must be > 0, got {min(seconds)}")
    # Normal equations of sum(w (x u + y v - t)^2) with w = 1 / t^2.
    w = [1.0 / t**2 for t in seconds]
    suu = sum(wi * u * u for wi, (u, _) in zip(w, rows))
    suv = sum(wi * u * v for wi, (u, v) in zip(w, rows))
    svv = sum(wi * v * v for wi, (_, v) in zip(w, rows))
    sut = sum(wi * u * t for wi, (u, _), t in zip(w, rows, seconds))
    svt = sum(wi * v * t for wi, (_, v), t in zip(w, rows, seconds))
    det = suu * svv - suv * suv
    x = (svv * sut - suv * svt) / det if det > 0 else 0.0
    y = (suu * svt - suv * sut) / det if det > 0 else 0.0
    if x <= 0 or y <= 0:
        if x <= 0:
            x = min(t / u for (u, _), t in zip(rows, seconds) if u > 0)
        num = sum(wi * v * (t - x * u) for wi, (u, v), t in zip(w, rows, seconds))
        y = max(num / svv, 1e-15)  # flat samples: latency-bound at every size, bandwidth "infinite"
    err = max(abs(x * u + y * v - t) / t for (u, v), t in zip(rows, seconds))
    return x, y, err


def fit_alpha_beta(nbytes: Sequence[float], seconds: Sequence[float]) -> OpFit:
    """Least-squares fit of ``seconds = alpha + beta x nbytes`` (``_weighted_lsq2``)."""
    if len(nbytes) != len(seconds):
        raise ValueError(f"the alpha-beta fit needs as many sizes as times, got {len(nbytes)} and {len(seconds)}")
    alpha, beta, err = _weighted_lsq2([(1.0, float(n)) for n in nbytes], seconds)
    return OpFit(alpha, beta, err)


def _cost_model_terms(op: str, nbytes: float, k: int) -> tuple[float, float]:
    """(latency steps, bytes over the link) ``comm_model`` charges ``op`` of ``nbytes`` on k
    ranks: its time is steps x latency_s + bytes / bandwidth_bytes_per_s. Read off the cost
    model's own functions, so the tier fitted here is the one its formulas need."""
    from trainforge.plan import comm_model as cm

    def time(link: cm.Link) -> float:
        if op == "send_recv":
            return cm.p2p_s(nbytes, link)
        return {"all_reduce": cm.all_reduce_s, "all_gather": cm.all_gather_s,
                "reduce_scatter": cm.reduce_scatter_s}[op](nbytes, k, link)

    return time(cm.Link(math.inf, 1.0, "intra")), time(cm.Link(1.0, 0.0, "intra"))


def fit_tier(collectives: dict, source: str) -> tuple[LinkTier, float]:
    """The one ``LinkTier`` (latency per step, bus bandwidth) that best explains every sample
    (all ops, all group sizes) under the cost model's collective formulas, and its largest
    relative error. ``collectives``: the worker's {op: {k: [[nbytes, seconds], ...]}}."""
    rows, seconds = [], []
    for op, by_k in collectives.items():
        for k, samples in by_k.items():
            for nbytes, t in samples:
                rows.append(_cost_model_terms(op, nbytes, int(k)))
                seconds.append(t)
    latency, inv_bw, err = _weighted_lsq2(rows, seconds)
    return LinkTier(bandwidth_bytes_per_s=1.0 / inv_bw, latency_s=latency, source=source), err


def cache_path() -> Path:
    root = os.environ.get("TRAINFORGE_CACHE") or Path.home() / ".cache" / "trainforge"
    return Path(root) / CACHE_FILE


def lscpu() -> tuple[str, str]:
    """(model name, flags) from lscpu, or from /proc/cpuinfo where lscpu is missing."""
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=10, check=True).stdout
        info = {k.strip(): v.strip() for k, _, v in (line.partition(":") for line in out.splitlines())}
        if info.get("Model name"):
            return info["Model name"], info.get("Flags", "")
    except (OSError, subprocess.SubprocessError):
        pass
    from trainforge.precision.hardware import read_cpuinfo

    model, flags = read_cpuinfo()
    return model, " ".join(sorted(flags or ()))


def machine_key(n_procs: int, cpu_model: str | None = None) -> str:
    model = cpu_model or lscpu()[0]
    return f"{model}|{os.cpu_count()} cores|torch {torch.__version__}|{n_procs} procs|v{PROFILE_VERSION}"


@contextmanager
def probe_lock() -> Iterator[str]:
    """Hold ``PROBE_LOCK`` (``TRAINFORGE_PROBE_LOCK``; empty: none) while measuring. Bounded:
    after ``PROBE_LOCK_WAIT_S`` (``TRAINFORGE_PROBE_LOCK_WAIT_S``) a one-line error names the
    file and its holder; a lock held by an ancestor of this process (``flock /tmp/cpu.lock
    trainforge plan ...``) is taken as held for it, so the probe runs under it instead of
    waiting for itself. Yields "taken", "outer" or "none"."""
    path = os.environ.get("TRAINFORGE_PROBE_LOCK", PROBE_LOCK)
    if not path:
        yield "none"
        return
    raw = os.environ.get("TRAINFORGE_PROBE_LOCK_WAIT_S", "")
    try:
        wait_s = float(raw) if raw else PROBE_LOCK_WAIT_S
    except ValueError:
        wait_s = -1.0
    if not wait_s >= 0:  # also NaN
        raise TrainforgeError(f"TRAINFORGE_PROBE_LOCK_WAIT_S={raw!r}: give seconds >= 0")
    with wait_for_lock(path, wait_s, "the machine probe",
                       "wait for that job and run again, raise TRAINFORGE_PROBE_LOCK_WAIT_S, or set "
                       "TRAINFORGE_PROBE_LOCK= (empty) to measure without the lock (the figures then include "
                       "that job's load)") as how:
        yield how


def run_probe(n_procs: int, bf16: bool, extra_args: Sequence[str] = (), timeout_s: float = PROBE_TIMEOUT_S) -> dict:
    """Launch ``probe_worker`` on ``n_procs`` processes under torchrun and return its raw samples."""
    with tempfile.TemporaryDirectory(prefix="trainforge-probe-") as tmp:
        out = Path(tmp) / "samples.json"
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={n_procs}",
               "-m", "trainforge.plan.probe_worker", "--out", str(out), *(["--bf16"] if bf16 else []), *extra_args]
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        with probe_lock():
            try:
                r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, env=env)
            except subprocess.TimeoutExpired as e:
                raise TrainforgeError(f"the machine probe ({n_procs} processes) ran past {timeout_s:.0f} s; "
                                      "the machine is too loaded or n_procs too large: try fewer --gpus") from e
        if r.returncode != 0 or not out.is_file():
            raise TrainforgeError(f"the machine probe failed (rc {r.returncode}): {' '.join(cmd)}\n"
                                  f"{r.stderr[-3000:]}")
        return json.loads(out.read_text())


def fit_samples(samples: dict) -> dict[str, dict[int, OpFit]]:
    """{op: {group size: OpFit}} from the worker's ``collectives`` samples."""
    return {op: {int(k): fit_alpha_beta([n for n, _ in rows], [t for _, t in rows]) for k, rows in by_k.items()}
            for op, by_k in samples.get("collectives", {}).items()}


def _mem_total_bytes() -> float:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return float(line.split()[1]) * 1024
    except OSError:
        pass
    return float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))


def cluster_from_profile(profile: dict) -> MeasuredCluster:
    """The ``MeasuredCluster`` a cached (or fresh) profile describes."""
    s, n = profile["samples"], int(profile["n_procs"])
    when = f"measured on this machine {profile['date']}"
    fits = {op: {int(k): OpFit(*f) for k, f in by_k.items()} for op, by_k in profile["fits"].items()}
    peak = {"fp32": s["matmul_fp32_flops_per_s"]}
    if "matmul_bf16_flops_per_s" in s:
        peak["bf16"] = s["matmul_bf16_flops_per_s"]
    if n >= 2:
        tier, err = fit_tier(s["collectives"], f"{when}: gloo all-reduce, all-gather, reduce-scatter and send/recv "
                                               f"on 2..{n} processes, one alpha-beta fit under comm_model's formulas")
        tier = dataclasses.replace(tier, source=f"{tier.source} (largest error {err:.0%})")
    else:  # one process: nothing to communicate with
        tier = LinkTier(math.inf, 0.0, "one process: no links")
    shared = f"{n} processes at once, {s['threads']} thread each"
    cores = int(s.get("cpu_count") or os.cpu_count() or 1)
    overlaps = n < cores  # a spare core for gloo's threads while every rank computes
    sources = {
        "peak_flops": f"{when}: {s['matmul_n']}^3 matmul, best of the windows, {shared} "
                      f"(fp32 alone: {s['matmul_fp32_solo_flops_per_s'] / 1e9:.1f} GFLOP/s)",
        "memory_bandwidth_bytes_per_s": f"{when}: tensor copy (read + write), {shared} "
                                        f"(alone: {s['memory_solo_bytes_per_s'] / 1e9:.1f} GB/s)",
        "memory_bytes": f"MemTotal / {n} processes",
        "intra": tier.source, "inter": "one node: as intra",
        "cpu_model": profile["cpu_model"], "cpu_flags": profile["cpu_flags"],
        "cpu_key_flags": " ".join(f for f in _KEY_FLAGS if f in profile["cpu_flags"].split()),
        "bf16": profile["bf16_reason"], "probe_s": f"{s['probe_s']:.1f}",
        "comm_overlaps_compute": (f"{when}: {n} processes on {cores} cores: " + (
            "collectives hide behind compute" if overlaps else "gloo's threads take the cores the compute runs on, "
            "so data-parallel traffic is added to the step, not hidden")),
    }
    sync = s.get("sync_s", {})
    sync_s = {int(k): max(0.0, t - sync["back_to_back"][k]) for k, t in sync.get("between_compute", {}).items()}
    if sync_s:
        sources["sync_s"] = (f"{when}: a 4-byte all-reduce between ~3 ms matmul chunks against back to back, "
                             f"{shared}: " + ", ".join(f"{k} ranks +{t * 1e3:.2f} ms" for k, t in sorted(sync_s.items())))
    return MeasuredCluster(
        name=f"measured: {profile['cpu_model']}, {n} x 1-thread processes", n_gpus=n, gpus_per_node=n,
        peak_flops=peak, memory_bytes=_mem_total_bytes() / n,
        memory_bandwidth_bytes_per_s=s["memory_bytes_per_s"], intra=tier, inter=tier, sources=sources,
        matmul_efficiency=1.0, comm_overlaps_compute=overlaps, collectives=fits, sync_s=sync_s, cores=cores,
        solo={"fp32_flops_per_s": s["matmul_fp32_solo_flops_per_s"], "memory_bytes_per_s": s["memory_solo_bytes_per_s"]})


def measure_profile(n_procs: int) -> dict:
    """Probe now (under the lock) and return the profile as cached: raw samples, fits, CPU."""
    from trainforge.precision.hardware import cpu_capability

    model, flags = lscpu()
    bf16 = cpu_capability().support["bf16"]  # cached ~1 s probe: is a bf16 matmul faster than fp32 here
    samples = run_probe(n_procs, bf16=bf16.fast)
    fits = fit_samples(samples)
    return {"n_procs": n_procs, "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
            "cpu_model": model, "cpu_flags": flags, "bf16_reason": bf16.reason, "samples": samples,
            "fits": {op: {str(k): [f.alpha_s, f.beta_s_per_byte, f.max_rel_error] for k, f in by_k.items()}
                     for op, by_k in fits.items()}}


def measured_cluster(n_procs: int, cache: bool = True) -> MeasuredCluster:
    """This machine as ``n_procs`` one-thread "GPUs" on one node. ``cache``: reuse the
    profile measured before for the same CPU, core count, torch version and ``n_procs``
    (False: probe again and replace it)."""
    if not isinstance(n_procs, int) or n_procs < 1:
        raise ValueError(f"--gpus = {n_procs!r}: the measured machine needs a process count >= 1")
    path = cache_path()
    key = machine_key(n_procs)
    profile = read_json_cache(path).get(key) if cache else None
    if not isinstance(profile, dict):
        profile = measure_profile(n_procs)
        entries = read_json_cache(path)  # re-read: another process may have written meanwhile
        entries[key] = profile
        write_json_cache(path, entries)
    try:
        return cluster_from_profile(profile)
    except (KeyError, TypeError, ValueError):  # a damaged or foreign entry: measure again
        if not cache:
            raise
        return measured_cluster(n_procs, cache=False)
