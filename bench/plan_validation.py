"""The planner's cost model against the world (issue 21, validation).

Published half (``published_table``): every row of ``trainforge.plan.published`` (Megatron-LM's
H100 weak-scaling table, torchtitan's Llama 3.1 8B/70B/405B H100 figures, the Llama 3 paper's
405B table, DeepSeek-V3 on 2048 H800) predicted by ``cost_model.estimate`` at the published layout, in the row's own
metric (TFLOP/s per GPU or tokens/s per GPU), with the relative error and the median absolute
error over the target rows (bf16, layouts ``Layout`` can express; target <= 15 %). Then the
memory check: DeepSpeed's documented ZeRO estimator outputs reproduced, and its ZeRO-3 model-
state figure against our estimate's params + grads + optimizer for FSDP on the same inputs.
Then which term moved which row (``term_table``: the cost model's terms switched on one at a
time from one efficiency for every FLOP to the shipped model) and the one free level
(``level_table``: matmul_efficiency fitted on one family, the other held out). Each row names
its training stack (``Workload.stack``). No GPU, no network: seconds of arithmetic.

    python bench/plan_validation.py            # the tables
    python bench/plan_validation.py --json     # one JSON object on stdout (--json PATH: to a file)
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import sys
from pathlib import Path
from typing import Any, Callable, Iterator

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the sibling script with the measured half
from plan_validation_measured import TABLE as MEASURED_TABLE  # noqa: E402

GIB = float(1 << 30)


def _layout_text(layout) -> str:
    parts = []
    if layout.dp_replicate > 1:
        parts.append(f"ddp{layout.dp_replicate}")
    if layout.dp_shard > 1:
        parts.append(f"fsdp{layout.dp_shard}")
    if layout.tp > 1:
        parts.append(f"tp{layout.tp}")
    if layout.ep > 1:
        parts.append(f"ep{layout.ep}")
    if layout.pp > 1:
        parts.append(f"pp{layout.pp}x{layout.microbatches}mb {layout.pp_schedule}")
    if layout.grad_accum_steps > 1:
        parts.append(f"ga{layout.grad_accum_steps}")
    if layout.activation_checkpoint:
        parts.append("ac")
    return " ".join(parts)


def _kernel_sources() -> dict[str, str]:
    from trainforge.plan import gemm_efficiency as ge
    from trainforge.plan import hardware

    out = {f"hopper {k}": v for k, v in ge.KERNEL_TABLES["hopper"].sources.items()}
    out["h100-96g-500w peak"] = hardware.VARIANTS["h100-96g-500w"].sources["peak_flops"]
    out["h800 peak"] = hardware.GPUS["h800"].sources["peak_flops"]
    return out


def published_table(estimate: Callable | None = None, cluster: Callable | None = None) -> dict[str, Any]:
    """Predicted vs published for every row, the median error, and the memory comparison.
    ``estimate``/``cluster`` default to ``trainforge.plan.cost_model.estimate`` and
    ``trainforge.plan.hardware.cluster``."""
    from trainforge.plan import published as pub
    from trainforge.plan import published_memory as mem

    if estimate is None or cluster is None:
        from trainforge.plan import cost_model, hardware
        estimate, cluster = estimate or cost_model.estimate, cluster or hardware.cluster
    comps = pub.compare(pub.ROWS, estimate=estimate, cluster=cluster)
    rows = []
    for c in comps:
        r, e = c.row, c.estimate
        rows.append({"id": r.id, "source": r.source, "model": r.model_name, "gpus": r.n_gpus,
                     "gpu": r.gpu, "stack": r.stack, "layout": _layout_text(r.layout), "precision": r.precision,
                     "seq_len": r.seq_len,
                     "global_batch": r.global_batch, "metric": r.metric, "published": r.value,
                     "predicted": round(c.predicted, 2), "rel_error": round(c.rel_error, 4),
                     "predicted_mfu": round(e.mfu, 4), "bubble": round(e.bubble_fraction, 4),
                     "comm_share": round(e.comm_share, 4), "memory_gib": round(e.memory_bytes_per_gpu / GIB, 1),
                     "feasible": e.feasible, "fits_memory": c.fits_memory, "why": e.why, "in_target": r.in_target, "excluded_why": r.excluded_why,
                     "quote": r.quote, "assumptions": list(r.assumptions)})
    skipped = [{"id": r.id, "why": r.excluded_why} for r in pub.ROWS if r.id not in {x["id"] for x in rows}]
    memory = [{"flavor": m.flavor, "gpus": m.n_gpus, "ours_gib": round(m.ours_bytes / GIB, 2),
               "ours_gathered_gib": round(m.ours_gathered_bytes / GIB, 2),
               "deepspeed_zero3_gib": round(m.deepspeed_bytes / GIB, 2),
               "deepspeed_sharded_only_gib": round(m.deepspeed_sharded_bytes / GIB, 2), "ratio": round(m.ratio, 3),
               "llm_analysis_gib": round(m.llm_analysis_bytes / GIB, 2) if m.llm_analysis_bytes else None,
               "llm_analysis_params_b": round(m.llm_analysis_params / 1e9, 2) if m.llm_analysis_params else None,
               "params_b": round(m.params / 1e9, 2)}
              for m in mem.compare_memory(estimate, cluster)]
    doc = [{"case": d.name, "documented_gb": d.documented_gb, "formula_gb": round(d.computed_gb(), 2)}
           for d in mem.DOC_CASES]
    base_mfu, base_err = pub.constant_mfu_baseline(pub.ROWS)
    families = {"megatron": [c for c in comps if c.row.source == "megatron"],
                "torchtitan": [c for c in comps if c.row.source.startswith("torchtitan")]}
    return {"rows": rows, "not_predicted": skipped, "baseline_constant_mfu": round(base_mfu, 4),
            "baseline_median_abs_error": round(base_err, 4), "median_abs_error": pub.median_abs_error(comps),
            "median_abs_error_all_predicted": pub.median_abs_error(comps, target_only=False),
            "median_abs_error_by_family": {k: pub.median_abs_error(v) for k, v in families.items()},
            "target": pub.TARGET_MEDIAN_ERROR, "n_target_rows": sum(r["in_target"] for r in rows),
            "sources": pub.SOURCES, "kernel_sources": _kernel_sources(), "memory": memory,
            "deepspeed_doc_cases": doc, "deepspeed_source": mem.SOURCE}


def print_published(t: dict[str, Any]) -> None:
    print("Cost model vs published training throughput (bf16 rows in the median; * = not counted; "
          "(over) = predicted memory above the GPU's, though the run fitted)")
    print(f"{'row':<44} {'GPUs':>6} {'stack':<18} {'layout':<34} {'metric':>8} {'published':>10} "
          f"{'predicted':>10} {'error':>7} {'MFU':>5} {'bubble':>6} {'comm':>5} {'GiB':>6}")
    for r in t["rows"]:
        metric = "TFLOP/s" if r["metric"] == "tflops_per_gpu" else "tok/s"
        mark = " " if r["in_target"] else "*"
        fit = "" if r["fits_memory"] else " (over)"
        fit += "" if r["feasible"] else f" infeasible: {r['why']}"
        print(f"{r['id']:<43}{mark} {r['gpus']:>6} {r['stack']:<18} {r['layout']:<34} {metric:>8} "
              f"{r['published']:>10.1f} "
              f"{r['predicted']:>10.1f} {r['rel_error']:>+7.1%} {r['predicted_mfu']:>5.1%} {r['bubble']:>6.1%} "
              f"{r['comm_share']:>5.0%} {r['memory_gib']:>6.1f}{fit}")
    print(f"median |error| over {t['n_target_rows']} target rows: {t['median_abs_error']:.1%} "
          f"(target <= {t['target']:.0%}); over all predicted rows: {t['median_abs_error_all_predicted']:.1%}")
    print("  by family: " + ", ".join(f"{k} {v:.1%}" for k, v in t["median_abs_error_by_family"].items()))
    print(f"yardstick: one MFU for every row ({t['baseline_constant_mfu']:.1%}, the median published) has median "
          f"|error| {t['baseline_median_abs_error']:.1%}")
    for s in t["not_predicted"]:
        print(f"  not predicted: {s['id']}: {s['why']}")
    excluded = sorted({r["excluded_why"] for r in t["rows"] if not r["in_target"]})
    for why in excluded:
        print(f"  * {why}")
    print("\nModel states per GPU (params + grads + optimizer), FSDP over all GPUs, bf16-mixed, vs DeepSpeed "
          "ZeRO-3 (4 x largest layer + 18 B/param / GPUs)")
    print(f"{'flavor':<12} {'GPUs':>5} {'params':>8} {'ours GiB':>9} {'+gathered':>10} {'DeepSpeed GiB':>14} "
          f"{'DS sharded only':>16} {'ours/DS':>8} {'llm-analysis GiB':>17} {'(its params)':>13}")
    for m in t["memory"]:
        la = f"{m['llm_analysis_gib']:>17.2f} {m['llm_analysis_params_b']:>12.2f}B" if m["llm_analysis_gib"] else ""
        print(f"{m['flavor']:<12} {m['gpus']:>5} {m['params_b']:>7.2f}B {m['ours_gib']:>9.2f} "
              f"{m['ours_gib'] + m['ours_gathered_gib']:>10.2f} "
              f"{m['deepspeed_zero3_gib']:>14.2f} {m['deepspeed_sharded_only_gib']:>16.2f} {m['ratio']:>8.3f} {la}")
    print("ours: 16 B/param sharded (fp32 param, fp32 grad, 2 fp32 Adam moments); +gathered adds FSDP's unsharded "
          "blocks in flight (DeepSpeed's 4 x largest layer: its largest layer here is the vocab x dim embedding)")
    print("llm-analysis 0.2.2 (stored figures, one run): 18 B/param like DeepSpeed, but it counts a two-matrix MLP "
          "and a tied embedding for these SwiGLU shapes, so fewer parameters")
    print("DeepSpeed's documented estimator outputs (memory.rst, t5-3b: 2851M params, 32M largest layer, 8 GPUs) "
          "reproduced by the formula:")
    for d in t["deepspeed_doc_cases"]:
        print(f"  {d['case']:<40} documented {d['documented_gb']:>6.2f} GB   formula {d['formula_gb']:>6.2f} GB")
    print("\nSources:")
    for k, v in t["sources"].items():
        print(f"  {k}: {v}")
    print(f"  deepspeed: {t['deepspeed_source']}")
    for k, v in t.get("kernel_sources", {}).items():
        print(f"  {k}: {v}")


# ---------------------------------------------------------------- which term moved which row
# The cost model's terms switched on one at a time, cumulatively, from the model before them
# (one matmul_efficiency for every FLOP, torchtitan's rows on the SXM entry) to the shipped one.
# A what-if: the stack and kernel-table entries are swapped for the duration of one compare().
_OFF = dict(board=False, table=False, attention=False, stack_bytes=False, overlap=False, chunks=False)
TERM_STEPS = (
    ("before: one efficiency, SXM board", _OFF),
    ("+ torchtitan's 500 W HBM2e board", {**_OFF, "board": True}),
    ("+ GEMM shape factor", {**_OFF, "board": True, "table": True}),
    ("+ flash-attention kernels", {**_OFF, "board": True, "table": True, "attention": True}),
    ("+ stack bytes (eager, fp32 loss)", {**_OFF, "board": True, "table": True, "attention": True,
                                          "stack_bytes": True}),
    ("+ Megatron TP overlap", {**_OFF, "board": True, "table": True, "attention": True, "stack_bytes": True,
                               "overlap": True}),
    ("+ TE's chunked GEMMs (shipped)", {k: True for k in _OFF}),
)


@contextlib.contextmanager
def _terms(attention: bool, stack_bytes: bool, overlap: bool, chunks: bool) -> Iterator[None]:
    from trainforge.plan import gemm_efficiency as ge

    stacks, tables = dict(ge.STACKS), dict(ge.KERNEL_TABLES)
    try:
        for name, st in stacks.items():
            ge.STACKS[name] = dataclasses.replace(
                st, stream_factor=st.stream_factor if stack_bytes else 1.0,
                loss_bytes_per_logit=st.loss_bytes_per_logit if stack_bytes else ge.FUSED_LOSS_BYTES,
                tp_overlap=st.tp_overlap and overlap, tp_chunked=st.tp_chunked and chunks)
        if not attention:  # the old count: full products at the GEMM level (0.72 x 3.5/6 for the causal half)
            for name, t in tables.items():
                flat = tuple((s, 0.42 * t.attention_peak_flops / 1e12, 0.42 * t.attention_peak_flops / 1e12)
                             for s, _, _ in next(iter(t.attention.values())))
                ge.KERNEL_TABLES[name] = dataclasses.replace(t, attention={k: flat for k in t.attention})
        yield
    finally:
        ge.STACKS.clear()
        ge.STACKS.update(stacks)
        ge.KERNEL_TABLES.clear()
        ge.KERNEL_TABLES.update(tables)


def term_table() -> dict[str, Any]:
    """Per target row, its error after each of ``TERM_STEPS``; medians per step and family."""
    from trainforge.plan import cost_model, hardware
    from trainforge.plan import published as pub

    steps = []
    for label, on in TERM_STEPS:
        def cluster(gpu: str, n: int, on=on):
            c = hardware.cluster(gpu if on["board"] else ("h100" if gpu == "h100-96g-500w" else gpu), n)
            return c if on["table"] else dataclasses.replace(c, kernel_table="")

        with _terms(on["attention"], on["stack_bytes"], on["overlap"], on["chunks"]):
            comps = [c for c in pub.compare(pub.ROWS, estimate=cost_model.estimate, cluster=cluster)
                     if c.row.in_target]
        fam = {k: pub.median_abs_error([c for c in comps if c.row.source.startswith(k)])
               for k in ("megatron", "torchtitan")}
        steps.append({"step": label, "median_abs_error": pub.median_abs_error(comps), **fam,
                      "errors": {c.row.id: round(c.rel_error, 4) for c in comps}})
    return {"steps": steps}


def print_terms(t: dict[str, Any]) -> None:
    steps = t["steps"]
    print("Which term moved which row: error per target row as the terms are switched on, cumulatively")
    print(f"{'row':<36}" + "".join(f"{i:>8}" for i in range(len(steps))))
    for rid in steps[0]["errors"]:
        print(f"{rid:<36}" + "".join(f"{s['errors'][rid]:>+8.1%}" for s in steps))
    for key in ("median_abs_error", "megatron", "torchtitan"):
        name = {"median_abs_error": "median |error|"}.get(key, f"  {key}")
        print(f"{name:<36}" + "".join(f"{s[key]:>8.1%}" for s in steps))
    for i, s in enumerate(steps):
        print(f"  {i}: {s['step']}")


def level_table(levels: tuple[float, ...] = tuple(x / 100 for x in range(50, 81))) -> dict[str, Any]:
    """The one level left free (the GPU's matmul_efficiency, shipped 0.72 from a GEMM benchmark):
    fitted on one family (the level with the least median |error| there) and scored on the other,
    held out. A check of the stack terms, not what ships."""
    from trainforge.plan import cost_model, hardware
    from trainforge.plan import published as pub

    by_level = {}
    for e in levels:
        comps = [c for c in pub.compare(pub.ROWS, estimate=cost_model.estimate,
                                        cluster=lambda g, n, e=e: dataclasses.replace(hardware.cluster(g, n),
                                                                                      matmul_efficiency=e))
                 if c.row.in_target]
        by_level[e] = {k: pub.median_abs_error([c for c in comps if c.row.source.startswith(k)])
                       for k in ("megatron", "torchtitan")} | {"all": pub.median_abs_error(comps)}
    out = []
    for fit, held in (("megatron", "torchtitan"), ("torchtitan", "megatron")):
        best = min(levels, key=lambda e: by_level[e][fit])
        out.append({"fitted_on": fit, "level": best, "fitted_error": by_level[best][fit], "held_out": held,
                    "held_out_error": by_level[best][held], "all": by_level[best]["all"]})
    return {"fits": out}


def print_levels(t: dict[str, Any]) -> None:
    print("The one free level (matmul_efficiency; shipped 0.72) fitted on one family, the other held out:")
    for f in t["fits"]:
        print(f"  fitted on {f['fitted_on']:<10}: {f['level']:.2f} -> {f['fitted_on']} {f['fitted_error']:.1%}, "
              f"{f['held_out']} (held out) {f['held_out_error']:.1%}, all 16 rows {f['all']:.1%}")


# The tables this script prints, in order: (name, build, print). The measured half
# (--machine measured against gloo runs on this machine) registers itself here.
TABLES: list[tuple[str, Callable[[], dict[str, Any] | None], Callable[[dict[str, Any]], None]]] = [
    ("published", published_table, print_published),
    ("terms", term_table, print_terms),
    ("level", level_table, print_levels),
    MEASURED_TABLE,  # runs only with TRAINFORGE_PLAN_MEASURED=1 (minutes of training runs)
]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--json", nargs="?", const="-", default=None, metavar="PATH",
                   help="write one JSON object (every table) to PATH, or to stdout without one")
    a = p.parse_args(argv)
    out: dict[str, Any] = {}
    for name, build, show in TABLES:
        table = build()
        if table is None:
            continue
        out[name] = table
        if a.json is None:
            show(table)
            print()
    if a.json == "-":
        json.dump(out, sys.stdout, indent=1)
        print()
    elif a.json:
        with open(a.json, "w") as fh:
            json.dump(out, fh, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
