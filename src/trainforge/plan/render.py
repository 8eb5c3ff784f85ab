"""``trainforge plan``'s output: the ranked layouts as a table or as JSON, the cluster a
``--gpu`` names, and the check that ``--precision fp8`` is asked of a board that has it.
Errors a user can fix raise ``ConfigError`` in one line naming the option."""

from __future__ import annotations

import dataclasses
import math

from trainforge.errors import ConfigError


def check_fp8(gpu: str, output: str | None) -> None:
    """``--precision fp8`` needs a board with FP8 tensor cores (before any probe is run) and
    no ``--output`` (the trainer has no FP8 policy to write)."""
    from trainforge.plan.hardware import GPUS, VARIANTS, has_fp8

    spec = GPUS.get(gpu.lower()) or VARIANTS.get(gpu.lower())
    if gpu == "measured" or (spec is not None and not has_fp8(spec.peak_flops)):
        with_fp8 = ", ".join(k for k, g in GPUS.items() if has_fp8(g.peak_flops))
        peaks = ("a CPU probe measures fp32 and bf16" if spec is None
                 else f"its peaks: {', '.join(sorted(spec.peak_flops))}")
        raise ConfigError(f"--precision fp8: {gpu} has no FP8 tensor cores ({peaks}); plan it with --precision "
                          f"bf16-mixed, or fp8 on {with_fp8}")
    if output:
        raise ConfigError(f"--output {output} with --precision fp8: the trainer has no FP8 policy to write; plan with "
                          "--precision bf16-mixed for a config to run")


def plan_cluster(gpu: str, n: int):
    """The cluster of ``n`` GPUs a ``--gpu`` names: a board from the table, or ``measured`` (this machine)."""
    if gpu == "measured":
        try:
            from trainforge.plan.probe import measured_cluster  # the probe of this machine, when it exists
        except ImportError:
            raise ConfigError("--gpu measured: the machine probe (trainforge.plan.probe) is not available in this "
                              "version; name a GPU from the table (h100, h200, h800, a100-80g, mi300x)") from None
        return measured_cluster(n)
    from trainforge.plan.hardware import cluster

    try:
        return cluster(gpu, n)
    except ValueError as e:
        raise ConfigError(f"--gpu {gpu}: {e}") from None


def layout_label(layout) -> str:
    """``dp_shard=4 tp=2``: the degrees above 1 (dp_shard always)."""
    parts = [f"{k}={getattr(layout, k)}" for k in ("dp_replicate", "dp_shard", "tp", "pp", "ep")
             if getattr(layout, k) > 1 or k == "dp_shard"]
    return " ".join(parts)


def estimate_json(e) -> dict:
    """One ranked layout as JSON (a non-finite time or memory, an infeasible layout's, as null)."""
    def num(x: float):
        return x if math.isfinite(x) else None

    return {"layout": dataclasses.asdict(e.layout), "feasible": e.feasible, "why": e.why,
            "step_s": num(e.step_s), "memory_bytes_per_gpu": num(e.memory_bytes_per_gpu), "mfu": e.mfu,
            "comm_share": e.comm_share, "bubble_fraction": e.bubble_fraction,
            "tokens_per_s_per_gpu": e.tokens_per_s_per_gpu,
            "breakdown": {k: num(v) for k, v in e.breakdown.items()}}


def plan_json(shown, workload, cluster, gpus: int) -> dict:
    """``trainforge plan --json``: the request and the ranked layouts."""
    return {"model": workload.flavor, "gpu": cluster.name, "gpus": gpus, "seq_len": workload.seq_len,
            "global_batch": workload.global_batch, "precision": workload.precision,
            "compression": workload.compression, "stack": workload.stack,
            "layouts": [estimate_json(e) for e in shown]}


def print_plan(shown, cluster, workload, n_total: int) -> None:
    """The ranked layouts as a table on stdout (and a line when none fits)."""
    from rich.console import Console
    from rich.table import Table

    n_ok = sum(e.feasible for e in shown)
    table = Table(title=f"{workload.flavor} on {cluster.n_gpus} x {cluster.name}: seq_len {workload.seq_len}, "
                        f"global batch {workload.global_batch}, {workload.precision}, compression "
                        f"{workload.compression} ({n_total} layouts priced)")
    for col in ("#", "layout", "tp mode", "microbatches / schedule", "grad accum", "act. ckpt", "GiB/GPU", "step s",
                "tokens/s/GPU", "MFU", "comm", "bubble"):
        table.add_column(col, justify="left" if col in ("layout", "microbatches / schedule") else "right")
    for i, e in enumerate(shown, 1):
        L = e.layout
        sched = f"{L.microbatches} {L.pp_schedule}" if L.pp > 1 else "-"
        mem = f"{e.memory_bytes_per_gpu / 2**30:.1f}" if e.memory_bytes_per_gpu == e.memory_bytes_per_gpu else "-"
        if e.feasible:
            nums = [f"{e.step_s:.3f}", f"{e.tokens_per_s_per_gpu:,.0f}", f"{e.mfu:.1%}", f"{e.comm_share:.1%}",
                    f"{e.bubble_fraction:.1%}"]
        else:
            nums = ["-", "-", "-", "-", f"[red]{e.why}[/red]"]
        # tp_mode: 1d (Megatron) or 2d (SUMMA grid); the printed layout runs with --parallel.tp_mode <it>
        table.add_row(str(i), layout_label(L), L.tp_mode if L.tp > 1 else "-", sched, str(L.grad_accum_steps),
                      "full" if L.activation_checkpoint else "none", mem, *nums)
    Console(width=max(160, Console().width)).print(table)
    if n_ok == 0:
        print("no layout fits: try more GPUs, a shorter --seq_len or a smaller --global_batch")
