"""The advisor's predicted gains: closed forms applied to what the run measured.

Each function takes measured seconds (or shares) and returns a tokens/s ratio after /
before. They keep what the run measured and change only the part the suggestion acts
on, so the run's own overheads (gloo, Python, the machine's load) carry over. A cost
model (``trainforge.plan.cost_model``) can replace a closed form: ``cost_model_speedup``
asks it for the ratio of two layouts' step times, where it exists.

Constants carry the measurement they come from."""

from __future__ import annotations

import dataclasses
import json
import statistics
from pathlib import Path
from typing import Any

from trainforge.model.config import FLAVORS, ModelConfig
from trainforge.parallel.pipeline import even_boundaries
from trainforge.parallel.stage_balance import choose_boundaries

# MFU a well-shaped micro-batch reaches, by device: on a CPU `tiny` at 8 x 256 tokens measured
# 0.13 of the matmul probe on this 2-core Xeon (and about the same at 16 x 256 in
# docs/benchmarks-archive.md "Training throughput"); on GPUs torchtitan's Llama-3 8B runs reach 0.4-0.5.
# The batch rule grows the micro-batch toward this ceiling and never predicts past it.
MFU_REACHABLE = {"cpu": 0.15, "cuda": 0.40}
# Share of a step in matmuls when the run has no profile (monitor.profile_every = 0): the
# profiled `tiny` steps spend 55-65% of self time in aten::mm / addmm / bmm.
MATMUL_SHARE_DEFAULT = 0.6
# Extra time of a profiled step over a plain one when the run profiled every step (no plain
# step to compare): `debug` with profile_every 1 vs 100 measured 0.85-1.27x over 4 pairs on
# a loaded 2-core machine (bench/advise.py), median ~1.0; docs/benchmarks-archive.md "Monitoring
# overhead" measured a profiled `tiny` step ~2% longer. 5% is the upper end of that.
PROFILED_STEP_SLOWDOWN = 0.05
CODEC_BITS = {"int8": 8, "int4": 4}
# DDP's gradient all-reduce where no measured profile of this machine is cached (``trainforge
# plan --machine measured`` writes one): gloo over loopback on this 2-core Xeon, the probe's
# all-reduce fit at 2 processes (machine_profile.json, 2026-12-02): 0.67 ms + 2.1 GB/s.
ALLREDUCE_FALLBACK_LATENCY_S = 6.7e-4
ALLREDUCE_FALLBACK_BYTES_PER_S = 2.1e9
# Bytes per parameter a data-parallel replica holds beyond its activations: fp32 weight,
# gradient and AdamW's two moments (16), plus DDP's gradient buckets (a second gradient copy).
DDP_BYTES_PER_PARAM = 20
_MATMUL_OPS = ("mm", "addmm", "bmm", "baddbmm", "matmul", "linear", "_scaled_dot_product", "mkldnn")


def model_shape(config: dict[str, Any]) -> ModelConfig:
    """The run's model shape from its config dict: the flavor with ``[model]`` overrides
    and the vocabulary of its data (the manifest's when data.path is set)."""
    model = config.get("model", {}) or {}
    base = FLAVORS.get(str(model.get("flavor", "tiny")), FLAVORS["tiny"])
    fields = {f.name for f in dataclasses.fields(ModelConfig)}
    changes = {k: v for k, v in model.items() if k in fields and k != "vocab_size" and v is not None}
    data = config.get("data", {}) or {}
    vocab = data.get("vocab_size")
    if data.get("path"):
        try:
            vocab = json.loads((Path(data["path"]) / "manifest.json").read_text())["vocab_size"]
        except (OSError, ValueError, KeyError, TypeError):
            pass
    if isinstance(vocab, int) and vocab > 0:
        changes["vocab_size"] = vocab
    return dataclasses.replace(base, **changes)


# ------------------------------------------------------------------------ pipeline


def stage_starts(split: str, n_layers: int, n_stages: int) -> list[int]:
    if split in ("even", "auto"):
        return even_boundaries(n_layers, n_stages)
    return [int(x) for x in split.split(",")]


def layer_costs_from_stages(stage_s: list[float], starts: list[int], n_layers: int) -> list[float]:
    """Per-layer seconds that reproduce the measured stage times: uniform blocks (the
    median per-block time of the middle stages, or of stage 0 with two stages), the rest
    of the first stage on block 0 (embedding) and of the last on the last block (norm,
    output projection, loss: where ``split_model`` puts them)."""
    counts = [b - a for a, b in zip(starts, [*starts[1:], n_layers])]
    middle = [t / n for t, n in zip(stage_s[1:-1], counts[1:-1]) if n > 0]
    c = statistics.median(middle) if middle else stage_s[0] / max(counts[0], 1)
    costs = [c] * n_layers
    costs[0] += max(0.0, stage_s[0] - counts[0] * c)
    costs[-1] += max(0.0, stage_s[-1] - counts[-1] * c)
    return costs


def resplit_speedup(stage_s: list[float], n_layers: int, split: str) -> tuple[float, float, list[int]]:
    """(speedup, predicted slowest stage s, its stage starts) of the best contiguous split
    of the inferred per-layer costs (``stage_balance.choose_boundaries``, the chooser
    ``pp_split = auto`` uses, here fed with what the running pipeline measured rather than
    a start-up profile); a pipeline step runs at the pace of its slowest stage."""
    starts = stage_starts(split, n_layers, len(stage_s))
    costs = layer_costs_from_stages(stage_s, starts, n_layers)
    new = choose_boundaries(costs, len(stage_s))
    ends = [*new[1:], n_layers]
    new_max = max(sum(costs[a:b]) for a, b in zip(new, ends))
    return max(1.0, max(stage_s) / new_max), new_max, list(new)


def analytic_bubble(p: int, m: int, schedule: str) -> float:
    """Idle share of a p-stage pipeline step with m microbatches and free communication:
    the schedule's own action list replayed with unit costs (``plan.pipeline_sim``, the
    cost model's) where that module exists, else the closed forms: (p-1)/(m+p-1) for GPipe
    and 1F1B (what the replay gives exactly); (p-1)/(v m + p-1) interleaved (v = 2); zbv
    and dualpipev (p-1)/(6m + p-1), a fit to the replayed torch action lists
    (docs/benchmarks-archive.md "Pipeline schedules": 0.020 at p=2, 0.059 at p=4, m=8)."""
    if p < 2:
        return 0.0
    try:
        from trainforge.plan.pipeline_sim import schedule_profile  # type: ignore[import-not-found]

        return schedule_profile(schedule, p, m).bubble_fraction
    except (ImportError, ValueError):
        pass
    k = {"interleaved-1f1b": 2, "zbv": 6, "dualpipev": 6}.get(schedule, 1)
    return (p - 1) / (k * m + p - 1)


def bubble_speedup(bubble: float, p: int, m: int, new_m: int, schedule: str, new_schedule: str) -> float:
    """The measured bubble's excess over the analytic one (gloo, Python per action) is
    kept; the analytic part follows the new microbatch count or schedule. Compute time is
    unchanged, so step time scales as 1 / (1 - bubble)."""
    excess = max(0.0, bubble - analytic_bubble(p, m, schedule))
    new = min(0.95, analytic_bubble(p, new_m, new_schedule) + excess)
    return max(1.0, (1 - new) / (1 - min(bubble, 0.95)))


# ------------------------------------------------------------------------ communication


def wire_ratio(codec: str, block_size: int = 256) -> float:
    """Bytes on the wire against fp32, from the codec itself (``Codec.nbytes``, what the
    hooks send): ``bits`` per value plus one fp32 scale per block (int8 at block 256:
    0.254, int4: 0.129)."""
    from trainforge.compression.codecs import make_codec

    n = 1 << 20
    return make_codec(codec, block_size).nbytes(n) / (4 * n)


def compression_speedup(step_s: float, comm_s: float, ratio: float) -> float:
    return step_s / max(step_s - comm_s * (1 - ratio), 1e-9)


# ------------------------------------------------------------------------ layout


def measured_link(world: int) -> tuple[Any, str]:
    """(``comm_model.Link``, source) of this machine's collectives at ``world`` processes:
    the cost model's alpha-beta fit from the cached probe profile (``plan.probe``; nothing
    is measured here), else the fallback constants above."""
    from trainforge.plan import comm_model as cm

    try:
        from trainforge.json_cache import read_json_cache
        from trainforge.plan import probe

        profile = read_json_cache(probe.cache_path()).get(probe.machine_key(world))
        if isinstance(profile, dict):
            tier = probe.cluster_from_profile(profile).intra
            return cm.Link(tier.bandwidth_bytes_per_s, tier.latency_s, "intra"), \
                f"this machine's probe ({profile.get('date', '?')})"
    except (ImportError, KeyError, TypeError, ValueError, OSError):
        pass
    return cm.Link(ALLREDUCE_FALLBACK_BYTES_PER_S, ALLREDUCE_FALLBACK_LATENCY_S, "intra"), \
        "gloo loopback measured on a 2-core Xeon (no probe profile cached here)"


def ddp_step_s(compute_s: float, optimizer_s: float, allreduce_s: float) -> float:
    """A DDP step: the compute it keeps, the optimizer over the whole model on every rank and
    the gradient all-reduce (the cost model's ``comm_model.all_reduce_s``) counted whole (not
    overlapped with backward: on CPU gloo's thread competes with the backward for the same cores)."""
    return compute_s + optimizer_s + allreduce_s


# ------------------------------------------------------------------------ memory


def logits_bytes(batch: int, seq_len: int, vocab: int) -> float:
    """fp32 logits, their softmax and the gradient: 3 x B x T x V x 4 bytes at the peak."""
    return 3.0 * batch * seq_len * vocab * 4


# ------------------------------------------------------------------------ batch


def batch_speedup(step_s: float, fixed_s: float, accum: int, k: int, keep_global: bool, mfu: float,
                  reachable: float) -> float:
    """Micro-batch x k. step = fixed (optimizer, data wait) + accum x per-micro-batch
    overhead + compute, where compute is the step's tokens at the ``reachable`` MFU (what
    scales with tokens); the overhead is what is left. Keeping the global batch
    (accum / k) divides the overhead by k; otherwise tokens per step grow k-fold for the
    same overhead. Capped at ``reachable / mfu`` (compute-bound)."""
    compute = min(step_s * mfu / reachable, max(step_s - fixed_s, 0.0))
    per_mb = max(0.0, step_s - fixed_s - compute) / accum
    if keep_global:
        new_step = fixed_s + (accum // k) * per_mb + compute
        gain = step_s / max(new_step, 1e-9)
    else:
        new_step = fixed_s + accum * per_mb + k * compute
        gain = k * step_s / max(new_step, 1e-9)
    return max(1.0, min(gain, reachable / max(mfu, 1e-9)))


# ------------------------------------------------------------------------ monitoring


def profiler_speedup(every: int, advised_every: int, wall_s: float, profiled_s: list[float],
                     plain_s: list[float]) -> tuple[float, str]:
    """(speedup, how) of profiling 1 step in ``advised_every`` instead of 1 in ``every``:
    profiled minus plain ``step_s`` where the run has both, else ``PROFILED_STEP_SLOWDOWN``.

    Not the monitor's share of wall time: with the profiler on every step ``monitor_s``
    reads 26-29% of wall time on `debug`, yet that time lies inside ``step_s`` (wall per
    step = step_s + 2 ms) and profiling every 100th step instead measured 0.85-1.27x
    (median ~1.0, 4 pairs, bench/advise.py): it is not time the run would get back."""
    base = statistics.median(plain_s) if plain_s else (statistics.median(profiled_s) if profiled_s else wall_s)
    if profiled_s and plain_s:
        extra = max(0.0, statistics.median(profiled_s) - base)
        how = f"profiled steps measured {1e3 * extra:.1f} ms slower than plain ones ({1e3 * base:.1f} ms)"
    else:
        base = base / (1 + PROFILED_STEP_SLOWDOWN)
        extra = PROFILED_STEP_SLOWDOWN * base
        how = (f"every step profiled (no plain step to compare): a profiled step taken as "
               f"{PROFILED_STEP_SLOWDOWN:.0%} slower, as measured on a small model here")
    return (base + extra / every) / (base + extra / advised_every), how


# ------------------------------------------------------------------------ precision


def matmul_share(top_ops: dict[str, float], step_s: float) -> float:
    """Share of the step in matmul kernels: the profiled step's top operators, else
    ``MATMUL_SHARE_DEFAULT``."""
    if not top_ops or step_s <= 0:
        return MATMUL_SHARE_DEFAULT
    mm = sum(v for k, v in top_ops.items() if any(op in k.split("::")[-1] for op in _MATMUL_OPS))
    total = sum(top_ops.values())
    return min(0.95, mm / total) if total > 0 else MATMUL_SHARE_DEFAULT


# ------------------------------------------------------------------------ cost model


def cost_model_speedup(workload: Any, old_layout: Any, new_layout: Any, cluster: Any) -> float | None:
    """Step-time ratio of two layouts from ``trainforge.plan.cost_model.estimate`` where
    that module exists (None otherwise, or when either layout is infeasible)."""
    try:
        from trainforge.plan import cost_model  # type: ignore[attr-defined]
    except ImportError:
        return None
    old, new = cost_model.estimate(workload, old_layout, cluster), cost_model.estimate(workload, new_layout, cluster)
    if not (old.feasible and new.feasible) or new.step_s <= 0:
        return None
    return old.step_s / new.step_s
