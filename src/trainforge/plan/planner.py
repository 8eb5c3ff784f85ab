"""The layout planner: every layout of a workload on n GPUs, each priced by the cost
model, ranked by predicted step time (feasible ones first).

    ests = plan(workload, cluster("h100", 64), top=5)
    print(config_toml(workload, ests[0]))       # what `trainforge train --config` reads

Explored: tp in powers of two up to a node (dividing the GPU count), each as 1-D tensor
parallelism and, where tp is a square (4, 16, 64), as 2-D too (``tp_mode = "2d"``: SUMMA on a
sqrt(tp) x sqrt(tp) grid, priced by ``tp2d_cost``, which refuses models and batches the grid
cannot split), pp over the divisors of what is left, every split of the remaining data-parallel ranks into dp_replicate x
dp_shard, ep over the divisors of dp that divide the routed experts (MoE only), the
pipeline schedules of ``parallel/pipeline.py``, activation checkpointing off and on, and
gradient accumulation: for each of those the planner keeps the fewest accumulation steps
that fit in memory (more steps only repeat the data-parallel traffic for the same compute),
so a model whose whole batch does not fit still gets a plan. Compression and precision come
from the workload.

Microbatches (``microbatch_counts``) are derived as Megatron derives them: a data-parallel
rank's micro-step of b = global_batch / (dp x grad_accum_steps) sequences runs as
b / micro_batch_size microbatches, for every micro batch size dividing b; so any count
dividing b, not a fixed grid (DeepSeek-V3's 15,360 sequences on dp 128 give 120 per rank,
which no multiple of pp = 16 divides). Pruned to what the schedule cares about, which keeps
the search as bounded as the old grid {pp, 2pp, 4pp, 8pp}: m >= pp (fewer leaves a stage
idle most of the step; 1F1B refuses it), and one count per octave of m / pp: the smallest
count at or above each of pp, 2pp, 4pp and 8pp (the bubble (p-1)/(m+p-1) roughly halves per
octave; counts between two rungs trade a little bubble for smaller microbatches). At most 4
counts per micro-step; where b is a multiple of those rungs they are the old grid. (All
divisors in [pp, 8pp] instead priced 4x the layouts: DeepSeek-V3 on 2048 GPUs took 48 s.)
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterator
from typing import Any

from trainforge.parallel.pipeline import SCHEDULES
from trainforge.plan.cost_model import estimate
from trainforge.plan.lr_scaling import LRRecipe
from trainforge.plan.spec import Cluster, Estimate, Layout, Workload

# Rungs of microbatches / pp: per rung the smallest count the batch allows at or above it.
MICROBATCH_RUNGS = (1, 2, 4, 8)


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _powers_of_two(limit: int) -> list[int]:
    out, p = [], 1
    while p <= limit:
        out.append(p)
        p *= 2
    return out


def _tp_modes(tp: int) -> tuple[str, ...]:
    """1-D always; 2-D too where the tp ranks form a q x q grid with q >= 2."""
    q = math.isqrt(tp)
    return ("1d", "2d") if q >= 2 and q * q == tp else ("1d",)


def enumerate_layouts(workload: Workload, n_gpus: int, gpus_per_node: int = 8,
                      schedules: tuple[str, ...] | None = None) -> Iterator[Layout]:
    """Every candidate layout using exactly ``n_gpus`` (module docstring), gradient
    accumulation steps ascending within each otherwise equal layout. Candidates the
    trainer would reject (tp not dividing the heads, pp over the layers...) are yielded
    too: the cost model says why."""
    cfg = workload.model
    schedules = schedules or tuple(SCHEDULES)
    for tp in _powers_of_two(min(gpus_per_node, n_gpus)):
        if n_gpus % tp:
            continue
        for pp in _divisors(n_gpus // tp):
            if pp > cfg.n_layers:
                continue
            dp = n_gpus // (tp * pp)
            eps = [e for e in _divisors(dp) if cfg.n_routed_experts % e == 0] if cfg.is_moe else [1]
            for rep in _divisors(dp):
                for ep, ac, sched, mode in itertools.product(eps, (False, True),
                                                             schedules if pp > 1 else ("1f1b",), _tp_modes(tp)):
                    yield from _accumulation_variants(workload, dp, Layout(
                        dp_replicate=rep, dp_shard=dp // rep, tp=tp, pp=pp, ep=ep, pp_schedule=sched,
                        activation_checkpoint=ac, tp_mode=mode))


def microbatch_counts(batch_size: int, pp: int) -> list[int]:
    """Pipeline microbatch counts for a micro-step of ``batch_size`` sequences per data-parallel
    rank (``training.batch_size``) on ``pp`` stages: batch_size / micro_batch_size for each micro
    batch size dividing it (Megatron's num_microbatches = global_batch / (micro_batch_size x
    dp)), pruned as the module docstring says: ``microbatch_counts(120, 16)`` -> [20, 40, 120];
    [1] without a pipeline; [] when fewer than pp sequences cannot feed every stage."""
    if pp <= 1:
        return [1]
    counts = [m for m in _divisors(batch_size) if m >= pp]
    out: list[int] = []
    for rung in MICROBATCH_RUNGS:
        m = next((c for c in counts if c >= rung * pp), None)
        if m is not None and m not in out:
            out.append(m)
    return out


def _accumulation_variants(workload: Workload, dp: int, base: Layout) -> Iterator[Layout]:
    """``base`` with each (grad_accum_steps, microbatches) that splits the batch evenly,
    accumulation steps ascending (``plan`` keeps the fewest that fit)."""
    if workload.global_batch % dp:
        yield base  # infeasible: the cost model names the batch
        return
    local = workload.global_batch // dp
    for accum in _divisors(local):
        for m in microbatch_counts(local // accum, base.pp):
            yield Layout(**{**base.__dict__, "microbatches": m, "grad_accum_steps": accum})


def plan(workload: Workload, cluster: Cluster, top: int | None = None) -> list[Estimate]:
    """Estimates of the candidate layouts on all of ``cluster``'s GPUs, feasible ones
    first by predicted step time, then the infeasible ones (smallest memory first, each
    with ``why``). Of the layouts differing only in gradient accumulation, only the one
    with the fewest steps that fits is kept (or, if none fits, the smallest)."""
    best: dict[tuple, Estimate] = {}
    for layout in enumerate_layouts(workload, cluster.n_gpus, cluster.gpus_per_node):
        key = (*{**layout.__dict__, "grad_accum_steps": 0}.values(),)
        kept = best.get(key)
        if kept is not None and kept.feasible:
            continue  # fewer accumulation steps already fit
        est = estimate(workload, layout, cluster)
        if kept is None or est.feasible or _memory(est) < _memory(kept):
            best[key] = est
    ranked = sorted(best.values(), key=lambda e: (not e.feasible, e.step_s if e.feasible else _memory(e)))
    return ranked[:top] if top else ranked


def _memory(est: Estimate) -> float:
    m = est.memory_bytes_per_gpu
    return m if m == m else float("inf")  # nan (invalid layout) last


# ---------------------------------------------------------------- the best layout as a config


def config_tables(workload: Workload, est: Estimate, lr: LRRecipe | None = None) -> dict[str, dict[str, Any]]:
    """The TOML tables that train ``workload`` with ``est.layout``: model.flavor,
    training.seq_len and training.batch_size (sequences per data-parallel rank per
    micro-step: global_batch / (dp x grad_accum_steps)), the layout's [parallel] keys
    (``compile`` for the trainforge-compile stack), precision and compression; with ``lr``,
    training.lr and its batch-size rule (optimizer.lr_scaling, lr_reference_batch), so the
    run trains at the rule's peak LR for the workload's global batch whatever the layout."""
    layout = est.layout
    tables = layout.overrides()
    batch_size = workload.global_batch // (layout.dp * layout.grad_accum_steps)
    tables["training"] = {"seq_len": workload.seq_len, "batch_size": batch_size, **tables["training"]}
    if lr is not None:
        tables["training"]["lr"] = lr.lr
        if lr.rule != "none":
            tables["optimizer"] = {"lr_scaling": lr.rule, "lr_reference_batch": lr.reference_batch}
    if workload.flavor:
        tables = {"model": {"flavor": workload.flavor}, **tables}
    if workload.precision in ("bf16", "fp16"):  # low-precision parameters: a preset plus the storage dtype
        tables["precision"] = {"policy": f"{workload.precision}-mixed", "param_dtype": workload.precision}
    else:
        tables["precision"] = {"policy": workload.precision}
    if workload.compression != "none":
        tables["compression"] = {"codec": workload.compression}
    if workload.stack == "trainforge-compile":  # the stack the prediction assumed: torch.compile'd blocks
        tables["parallel"]["compile"] = True
    return tables


def _toml_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return repr(v)
    return '"' + str(v).replace("\\", "\\\\").replace('"', '\\"') + '"'


def config_toml(workload: Workload, est: Estimate, header: str = "", lr: LRRecipe | None = None) -> str:
    """``config_tables`` as TOML text, ``header`` (one or more lines) as comments on top."""
    lines = [f"# {line}" for line in header.splitlines()]
    for name, table in config_tables(workload, est, lr).items():
        lines += ["", f"[{name}]"] + [f"{k} = {_toml_value(v)}" for k, v in table.items()]
    return "\n".join(lines).lstrip("\n") + "\n"
