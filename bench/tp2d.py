"""2-D (SUMMA) vs 1-D (Megatron) tensor parallelism: bytes sent per rank per step, analytic and
counted from a real training step, and step time on a bandwidth-limited link (issue 23).

    python bench/tp2d.py                  # all three parts, ~10 min on 2 cores
    python bench/tp2d.py --skip-timing    # the byte tables only (~2 min)
    python bench/tp2d.py --json out.json

1. Analytic (``parallel/tp2d/comm_bytes.py``, no processes): bytes one rank sends per step for
   the transformer blocks, 1-D without and with sequence parallel against 2-D, for the ``small``
   (16 x 2048 tokens) and ``llama-8b`` (16 x 8192) shapes at tp 4, 16 and 64 in bf16; plus the
   model's edges (embedding, output layer, loss: ``summa_edge_collectives`` for 2-D; for 1-D
   the embedding's and the output's stream message and the loss's three per-token all-reduces)
   and the token count per step above which 2-D's blocks send less (both are affine in tokens).
2. Counted: ``trainforge train`` under torchrun, 4 gloo processes, ``--parallel.tp 4
   --parallel.tp_mode 1d|2d``, ``tiny`` at width 256 (vocab 512), fp32, batch 4 x 64 tokens
   (below the widths' break-even: 2-D sends more) and 8 x 256 (the timed shape: 2-D sends less);
   every collective of the 3rd step (forward, backward, clipping, optimizer) is recorded on every
   rank by a ``TorchDispatchMode`` (``CollectiveCounter``: c10d and functional collectives,
   DTensor's and the hand-written SUMMA ones alike) with the bytes the ring model says this rank
   sends. Run at 1 and 2 blocks: the difference is one block's bytes, set beside
   ``comm_bytes``' per-block count; the rest (total - blocks) is the edges'.
3. Step time on a shaped link (``bench/shaped_link.py``: a network namespace whose loopback is a
   tc tbf of ``--rate``, one shared medium for all 4 ranks; a labelled simulation where no
   namespace can be made): ``tiny`` with 2 blocks, batch 8 x 256 tokens (where 2-D's blocks send
   ~40% less), ``--rounds`` rounds each running 1d and 2d once in alternating order; a run's step
   time is the median of its logging windows after the first (windows of 2 steps); the headline
   is the median over rounds of the paired ratio t(1d) / t(2d), with min-max.

A benchmark, not a test: prints the tables (markdown) and exits 0. Where ``parallel.tp_mode``
does not exist (the trainer before issue 23's integration), the 2d arms say so and are skipped.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # run as a script: the sibling benches and the package's checkout
    sys.path.insert(0, str(ROOT))

from trainforge.model.config import FLAVORS  # noqa: E402
from trainforge.parallel.tp2d.comm_bytes import (  # noqa: E402
    BlockShape,
    summa_bytes_per_rank,
    summa_edge_collectives,
    tp1d_bytes_per_rank,
)
from trainforge.parallel.tp2d.grid import grid_side  # noqa: E402

MB = 1e6
NPROC = 4
ANALYTIC_SHAPES = {"small": (16, 2048), "llama-8b": (16, 8192)}  # flavor -> (batch, seq) per step
ANALYTIC_TPS = (4, 16, 64)
# Counted and timed runs: tiny's widths (dim 256, 8 heads, 4 KV heads, ffn 704), vocab 512.
# (batch, seq) counted: below tiny's break-even token count, and the timed runs' shape above it
COUNT_SHAPES, COUNT_STEP, COUNT_VOCAB = ((4, 64), (8, 256)), 3, 512  # vocab: bench_data's tokenizer
TIME_BATCH, TIME_SEQ, TIME_LAYERS, TIME_STEPS, TIME_WINDOW = 8, 256, 2, 9, 2


# ------------------------------------------------------------------------ analytic (pure)

def block_shape(flavor: str, batch: int, seq: int) -> BlockShape:
    c = FLAVORS[flavor]
    return BlockShape(batch, seq, c.dim, c.ffn_hidden_dim, c.n_heads, c.n_kv_heads)


def tp1d_edge_bytes(tokens: int, dim: int, tp: int, elem_bytes: int) -> float:
    """1-D's edges per step (the cost model's count): the embedding's reduce-scatter + all-gather
    of the (tokens, dim) stream, the output layer's all-gather + reduce-scatter of its input, and
    the vocab-parallel loss's three float32 all-reduces of per-token values."""
    if tp == 1:
        return 0.0
    return 2 * 2 * (tp - 1) / tp * tokens * dim * elem_bytes + 3 * 2 * (tp - 1) / tp * tokens * 4


def tp1d_problem(flavor: str, tp: int) -> str:
    c = FLAVORS[flavor]
    bad = [f"{n} {v}" for n, v in (("heads", c.n_heads), ("kv heads", c.n_kv_heads), ("ffn", c.ffn_hidden_dim))
           if v % tp]
    return f"1-D refused: tp does not divide {', '.join(bad)}" if bad else ""


def tp2d_problem(flavor: str, tp: int, batch: int) -> str:
    c = FLAVORS[flavor]
    q = grid_side(tp)
    bad = [f"{n} {v}" for n, v in (("heads", c.n_heads), ("kv heads", c.n_kv_heads), ("dim", c.dim),
                                   ("ffn", c.ffn_hidden_dim), ("vocab", c.vocab_size), ("batch", batch)) if v % q]
    return f"2-D refused: q = {q} does not divide {', '.join(bad)}" if bad else ""


def break_even_tokens(flavor: str, tp: int, seq: int, elem_bytes: int = 2) -> float:
    """Tokens per step above which 2-D's blocks send less than sequence-parallel 1-D's (both
    bytes are affine in the token count: two evaluations fix the lines). q must divide the
    heads and widths; batch is taken in multiples of q."""
    q = grid_side(tp)
    pts = []
    for batch in (q, 2 * q):
        shape = block_shape(flavor, batch, seq)
        pts.append((shape.tokens, summa_bytes_per_rank(shape, tp, elem_bytes)
                    - tp1d_bytes_per_rank(shape, tp, True, elem_bytes)))
    (n0, d0), (n1, d1) = pts
    slope = (d1 - d0) / (n1 - n0)
    return n0 - d0 / slope if slope < 0 else float("inf")


def analytic_rows(elem_bytes: int = 2) -> list[dict[str, Any]]:
    """Per (flavor, tp): the blocks' bytes per rank per step (1-D, 1-D SP, 2-D), the edges'
    and the whole step's, and 2-D's change against 1-D SP (blocks, and whole)."""
    rows = []
    for flavor, (batch, seq) in ANALYTIC_SHAPES.items():
        c = FLAVORS[flavor]
        shape = block_shape(flavor, batch, seq)
        for tp in ANALYTIC_TPS:
            q = grid_side(tp)
            one = c.n_layers * tp1d_bytes_per_rank(shape, tp, False, elem_bytes)
            one_sp = c.n_layers * tp1d_bytes_per_rank(shape, tp, True, elem_bytes)
            edges_1d = tp1d_edge_bytes(shape.tokens, c.dim, tp, elem_bytes)
            why = tp2d_problem(flavor, tp, batch)
            two = edges_2d = None
            if not why:
                two = c.n_layers * summa_bytes_per_rank(shape, tp, elem_bytes)
                edges_2d = sum(x.sent_bytes for x in summa_edge_collectives(shape.tokens, c.dim, c.vocab_size, q,
                                                                           elem_bytes))
            rows.append({
                "flavor": flavor, "tp": tp, "q": q, "tokens": shape.tokens, "layers": c.n_layers,
                "tp1d_blocks_bytes": one, "tp1d_sp_blocks_bytes": one_sp, "tp2d_blocks_bytes": two,
                "tp1d_edges_bytes": edges_1d, "tp2d_edges_bytes": edges_2d,
                "blocks_change_vs_sp": None if two is None else two / one_sp - 1,
                "step_change_vs_sp": None if two is None else (two + edges_2d) / (one_sp + edges_1d) - 1,
                "break_even_tokens": None if why and "batch" not in why else break_even_tokens(flavor, tp, seq,
                                                                                               elem_bytes),
                "note": "; ".join(x for x in (tp1d_problem(flavor, tp), why) if x),
            })
    return rows


def _mb(x: float | None) -> str:
    return "-" if x is None else f"{x / MB:,.0f}"


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:+.0f}%"


def analytic_table(rows: list[dict[str, Any]]) -> str:
    lines = ["| shape (tokens/step) | tp | 1-D MB | 1-D SP MB | 2-D MB | 2-D vs 1-D SP (blocks) | edges 1-D SP / 2-D MB "
             "| 2-D vs 1-D SP (step) | 2-D sends less above | note |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
    for r in rows:
        even = r["break_even_tokens"]
        even_s = "-" if even is None else ("never" if even == float("inf") else f"{even:,.0f} tokens")
        lines.append(f"| {r['flavor']} ({r['tokens']:,}) | {r['tp']} | {_mb(r['tp1d_blocks_bytes'])} | "
                     f"{_mb(r['tp1d_sp_blocks_bytes'])} | {_mb(r['tp2d_blocks_bytes'])} | "
                     f"{_pct(r['blocks_change_vs_sp'])} | {_mb(r['tp1d_edges_bytes'])} / {_mb(r['tp2d_edges_bytes'])} | "
                     f"{_pct(r['step_change_vs_sp'])} | {even_s} | {r['note'] or '-'} |")
    return "\n".join(lines)


# ----------------------------------------------------------------- counting collectives

def ring_sent_bytes(kind: str, group_size: int, full_bytes: float) -> float:
    """Bytes one rank sends for a collective whose full tensor is ``full_bytes`` (an all-gather's
    output, a reduce-scatter's input, an all-reduce's tensor, an all-to-all's or broadcast's
    input), by the ring model of ``comm_bytes.py``."""
    p = group_size
    if p <= 1:
        return 0.0
    return (2 if kind == "all_reduce" else 1) * (p - 1) / p * full_bytes


def _nbytes(x: Any) -> int:
    if isinstance(x, torch.Tensor):
        return x.numel() * x.element_size()
    if isinstance(x, (list, tuple)):
        return sum(_nbytes(y) for y in x)
    return 0


# op name -> (kind, index of the argument holding the full tensor); functional all-gathers'
# full tensor is group_size x their input.
_C10D = {"allreduce_": ("all_reduce", 0), "allreduce_coalesced_": ("all_reduce", 0),
         "_allgather_base_": ("all_gather", 0), "allgather_": ("all_gather", 0),
         "allgather_into_tensor_coalesced_": ("all_gather", 0), "_reduce_scatter_base_": ("reduce_scatter", 1),
         "reduce_scatter_": ("reduce_scatter", 1), "reduce_scatter_tensor_coalesced_": ("reduce_scatter", 1),
         "alltoall_base_": ("all_to_all", 1), "alltoall_": ("all_to_all", 1), "broadcast_": ("broadcast", 0)}
_FUNCTIONAL = {"all_reduce": "all_reduce", "all_reduce_coalesced": "all_reduce",
               "all_gather_into_tensor": "all_gather", "all_gather_into_tensor_coalesced": "all_gather",
               "reduce_scatter_tensor": "reduce_scatter", "reduce_scatter_tensor_coalesced": "reduce_scatter",
               "all_to_all_single": "all_to_all", "broadcast": "broadcast"}


def classify(namespace: str, name: str, args: tuple) -> tuple[str, int, int] | None:
    """(kind, group size, full tensor bytes) of a collective op's call, or None for any other op
    (waits, setup scatters, barriers). ``namespace`` / ``name``: the op's, e.g. ("c10d",
    "allreduce_") or ("_c10d_functional", "all_gather_into_tensor")."""
    if namespace == "c10d" and name in _C10D:
        kind, i = _C10D[name]
        return kind, _c10d_group_size(args), _nbytes(args[i])
    if namespace in ("_c10d_functional", "c10d_functional", "_c10d_functional_autograd") and name in _FUNCTIONAL:
        kind = _FUNCTIONAL[name]
        size = next((a for a in args[1:] if isinstance(a, int) and not isinstance(a, bool)), None) \
            if kind in ("all_gather", "reduce_scatter") else None
        if size is None:
            from torch.distributed.distributed_c10d import _resolve_process_group

            size = _resolve_process_group(args[-1]).size()
        full = _nbytes(args[0]) * (size if kind == "all_gather" else 1)
        return kind, size, full
    return None


def _c10d_group_size(args: tuple) -> int:
    from torch._C._distributed_c10d import ProcessGroup

    for a in args:
        if isinstance(a, torch.ScriptObject):
            try:
                return ProcessGroup.unbox(a).size()
            except RuntimeError:  # a ReduceOp, not the group
                continue
    raise ValueError("a c10d collective without a process group argument")


class CollectiveCounter(TorchDispatchMode):
    """Records every collective dispatched while active (forward and, on CPU, backward: autograd
    runs it on this thread), with the bytes this rank sends by the ring model. A functional
    collective's own c10d call runs inside the mode's handler, where the mode is off, so each
    collective is counted once; DTensor ops are handed back to DTensor, whose own collectives
    then come through the mode."""

    def __init__(self):
        super().__init__()
        self.records: list[dict[str, Any]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if any(t is not torch.Tensor and issubclass(t, torch.Tensor) for t in types):
            # A DTensor op: let DTensor run it (CommDebugMode's way), so the collectives it issues
            # inside (the loss's reductions, a norm's Partial) come back through this mode.
            return NotImplemented
        found = classify(func.namespace, func.__name__.split(".")[0], args)  # "allreduce_.default"
        if found is not None:
            kind, size, full = found
            self.records.append({"op": f"{func.namespace}.{func.__name__}", "kind": kind, "group_size": size,
                                 "full_bytes": full, "sent_bytes": ring_sent_bytes(kind, size, full)})
        return func(*args, **(kwargs or {}))


def summarize(records: list[dict[str, Any]]) -> dict[str, Any]:
    """Total bytes sent, the count, and both by (kind, group size)."""
    by: dict[str, dict[str, float]] = {}
    for r in records:
        key = f"{r['kind']} /{r['group_size']}"
        entry = by.setdefault(key, {"count": 0, "sent_bytes": 0.0})
        entry["count"] += 1
        entry["sent_bytes"] += r["sent_bytes"]
    return {"sent_bytes": sum(r["sent_bytes"] for r in records), "count": len(records), "by_kind": by}


def paired_ratio_stats(base: list[float], ours: list[float]) -> dict[str, float]:
    """Median and min-max of base[i] / ours[i] over paired samples (> 1: ours is faster)."""
    if len(base) != len(ours) or not base:
        raise ValueError(f"paired_ratio_stats: {len(base)} and {len(ours)} samples; need as many, >= 1")
    ratios = [b / o for b, o in zip(base, ours)]
    return {"median": statistics.median(ratios), "min": min(ratios), "max": max(ratios), "n": len(ratios),
            "ratios": ratios}


# --------------------------------------------------------------------------- the runs

def tp_mode_available() -> bool:
    """Whether this checkout's trainer has ``parallel.tp_mode`` (issue 23's integration)."""
    from trainforge.parallel.section import ParallelSection

    return "tp_mode" in {f.name for f in dataclasses.fields(ParallelSection)}


def train_argv(run_dir: Path, data: Path, mode: str, n_layers: int, batch: int, seq: int, steps: int,
               log_interval: int) -> list[str]:
    return ["train", "--run_dir", str(run_dir), "--data.path", str(data), "--model.flavor", "tiny",
            "--model.n_layers", str(n_layers), "--training.seq_len", str(seq), "--training.batch_size", str(batch),
            "--training.steps", str(steps), "--training.warmup_steps", "1", "--training.log_interval",
            str(log_interval), "--training.val_interval", "0", "--training.val_batches", "1",
            "--training.threads", "1", "--checkpoint.interval", "0", "--sample.max_new_tokens", "0",
            "--precision.policy", "fp32", "--parallel.tp", str(NPROC), "--parallel.tp_mode", mode]


def _torchrun(port: int | None) -> list[str]:
    rdzv = ["--master_addr", "127.0.0.1", "--master_port", str(port)] if port else ["--standalone"]
    return [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", f"--nproc_per_node={NPROC}", *rdzv]


def count_step(mode: str, n_layers: int, batch: int, seq: int, data: Path, tmp: Path) -> list[dict[str, Any]]:
    """Every rank's collectives of step ``COUNT_STEP`` (``bench/_tp2d_worker.py``)."""
    tag = f"{mode}-{n_layers}-{batch}x{seq}"
    out = tmp / f"count-{tag}"
    cmd = [*_torchrun(None), "-m", "bench._tp2d_worker",
           *train_argv(tmp / f"run-count-{tag}", data, mode, n_layers, batch, seq, COUNT_STEP, 1)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT), "TP2D_COUNT_OUT": str(out),
           "TP2D_COUNT_STEP": str(COUNT_STEP)}
    r = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=900, cwd=ROOT)
    if r.returncode != 0:
        raise RuntimeError(f"counting run {tag} failed (rc {r.returncode}):\n{r.stderr[-4000:]}")
    return [json.loads((out / f"rank{i}.json").read_text()) for i in range(NPROC)]


def counted_table(counts: dict[str, dict[int, list[dict]]], batch: int, seq: int) -> tuple[str, dict]:
    """Per mode: bytes per rank per step at 1 and 2 blocks (max over ranks), one block's
    (the difference) against comm_bytes' per-block count, and the edges' (the rest)."""
    c = FLAVORS["tiny"]
    shape = BlockShape(batch, seq, c.dim, c.ffn_hidden_dim, c.n_heads, c.n_kv_heads)
    analytic = {"1d": tp1d_bytes_per_rank(shape, NPROC, True), "2d": summa_bytes_per_rank(shape, NPROC)}
    edges_analytic = {"1d": tp1d_edge_bytes(shape.tokens, c.dim, NPROC, 4),
                      "2d": sum(x.sent_bytes for x in summa_edge_collectives(shape.tokens, c.dim, COUNT_VOCAB,
                                                                             grid_side(NPROC), 4))}
    out, lines = {}, ["| tp_mode | bytes/rank/step, 1 block | 2 blocks | one block (difference) | comm_bytes per "
                      "block | counted / analytic | edges (2 blocks - 2 x one block) | edges analytic | "
                      "collectives/step (2 blocks) |",
                      "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for mode, by_layers in counts.items():
        totals = {n: max(r["sent_bytes"] for r in ranks) for n, ranks in by_layers.items()}
        spread = {n: max(r["sent_bytes"] for r in ranks) - min(r["sent_bytes"] for r in ranks)
                  for n, ranks in by_layers.items()}
        block = totals[2] - totals[1]
        edges = totals[2] - 2 * block
        out[mode] = {"totals": totals, "rank_spread": spread, "block": block, "analytic_block": analytic[mode],
                     "edges": edges, "analytic_edges": edges_analytic[mode], "collectives": by_layers[2][0]["count"],
                     "by_kind": by_layers[2][0]["by_kind"]}
        lines.append(f"| {mode} | {totals[1]:,.0f} | {totals[2]:,.0f} | {block:,.0f} | {analytic[mode]:,.0f} | "
                     f"{block / analytic[mode]:.4f} | {edges:,.0f} | {edges_analytic[mode]:,.0f} | "
                     f"{by_layers[2][0]['count']} |")
    if len(out) == 2:
        lines.append(f"\n2-D vs 1-D: one block {out['2d']['block'] / out['1d']['block'] - 1:+.1%}, whole step "
                     f"(2 blocks) {out['2d']['totals'][2] / out['1d']['totals'][2] - 1:+.1%}")
    return "\n".join(lines), out


def timed_run(link, mode: str, data: Path, run_dir: Path) -> dict[str, Any]:
    from trainforge.monitor.jsonl import read_jsonl

    cmd = [*_torchrun(link.free_port()), "-m", "trainforge",
           *train_argv(run_dir, data, mode, TIME_LAYERS, TIME_BATCH, TIME_SEQ, TIME_STEPS, TIME_WINDOW)]
    before = link.qdisc_stats()
    t0 = time.perf_counter()
    r = link.run(cmd, env=link.torch_env(PYTHONPATH=str(ROOT)), timeout_s=900, cwd=ROOT)
    wall = time.perf_counter() - t0
    if r.returncode != 0:
        raise RuntimeError(f"{mode} on {link.label} failed:\n{r.stdout[-2000:]}\n{r.stderr[-4000:]}")
    after = link.qdisc_stats()
    recs = [x for x in read_jsonl(run_dir / "metrics.jsonl") if "tokens_per_s" in x]
    windows = sorted({x["step"]: x for x in recs if x["step"] % TIME_WINDOW == 0}.items())[1:]  # not the first
    tokens = TIME_BATCH * TIME_SEQ  # every tp rank reads the same batch: one data-parallel rank
    step_s = [tokens / x["tokens_per_s"] for _, x in windows]
    return {"step_s": statistics.median(step_s), "windows_s": step_s, "wall_s": wall,
            "qdisc_bytes": (after.get("sent_bytes", 0) - before.get("sent_bytes", 0)) if after else None,
            "qdisc_dropped": (after.get("dropped", 0) - before.get("dropped", 0)) if after else None,
            "load": os.getloadavg()[0]}


def timing(rate: str, rounds: int, data: Path, tmp: Path, modes: list[str]) -> dict[str, Any]:
    from bench.shaped_link import open_link

    runs: dict[str, list[dict]] = {m: [] for m in modes}
    with open_link(None if rate == "none" else rate) as link:
        label = link.label
        for rnd in range(rounds):
            for mode in (modes if rnd % 2 == 0 else modes[::-1]):
                res = timed_run(link, mode, data, tmp / f"time-{rnd}-{mode}")
                runs[mode].append(res)
                print(f"  [{label}] round {rnd} {mode}: {1e3 * res['step_s']:7.0f} ms/step (windows "
                      f"{[round(1e3 * s) for s in res['windows_s']]}; load {res['load']:.1f})", flush=True)
    out: dict[str, Any] = {"link": label, "simulated": getattr(link, "simulated", False), "runs": runs}
    if len(modes) == 2:
        out["speedup_2d"] = paired_ratio_stats([r["step_s"] for r in runs["1d"]], [r["step_s"] for r in runs["2d"]])
    return out


def cpu_info() -> dict[str, str]:
    info = {}
    try:
        text = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=30).stdout
        for line in text.splitlines():
            key, _, value = line.partition(":")
            if key.strip() in ("Model name", "CPU(s)", "Flags"):
                info[key.strip()] = value.strip()
    except (OSError, subprocess.SubprocessError):
        pass
    return info


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rate", default="1gbit", help="tc rate of the shaped link, or none: the namespace "
                                                     "unshaped (default 1gbit)")
    ap.add_argument("--rounds", type=int, default=6, help="timing rounds, each 1d and 2d once (default 6)")
    ap.add_argument("--skip-timing", action="store_true")
    ap.add_argument("--skip-counting", action="store_true")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    from bench.grad_compression import bench_data

    cpu = cpu_info()
    report: dict[str, Any] = {"command": " ".join(["python", "bench/tp2d.py", *sys.argv[1:]]),
                              "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                              "cpu": cpu.get("Model name", "unknown"), "cpus": cpu.get("CPU(s)", "?"),
                              "flags": cpu.get("Flags", ""), "load_start": os.getloadavg()}
    rows = analytic_rows()
    report["analytic"] = rows
    print("analytic, bf16, bytes per rank per step (parallel/tp2d/comm_bytes.py):\n")
    print(analytic_table(rows))
    modes = ["1d", "2d"] if tp_mode_available() else ["1d"]
    if modes == ["1d"]:
        print("\n2d arm: parallel.tp_mode is not available in this checkout's trainer (issue 23's integration); "
              "only 1d is measured")
    data = bench_data(Path(os.environ.get("TRAINFORGE_CACHE", Path.home() / ".cache" / "trainforge")))
    with tempfile.TemporaryDirectory(prefix="tf-tp2d-") as tmp:
        if not args.skip_counting:
            report["counted"] = {}
            for batch, seq in COUNT_SHAPES:
                counts = {m: {n: count_step(m, n, batch, seq, data, Path(tmp)) for n in (1, 2)} for m in modes}
                table, report["counted"][f"{batch}x{seq}"] = counted_table(counts, batch, seq)
                print(f"\ncounted, tp 4 (2 x 2 grid), {NPROC} gloo processes, tiny widths, fp32, batch {batch} x "
                      f"{seq} tokens, step {COUNT_STEP}; max over ranks:\n")
                print(table, flush=True)
        if not args.skip_timing:
            print(f"\nstep time at {args.rate}, tiny x {TIME_LAYERS} blocks, batch {TIME_BATCH} x {TIME_SEQ}:",
                  flush=True)
            report["timing"] = t = timing(args.rate, args.rounds, data, Path(tmp), modes)
            for mode, runs in t["runs"].items():
                print(f"  {mode}: median {1e3 * statistics.median(r['step_s'] for r in runs):.0f} ms/step; wire "
                      f"{statistics.median(r['qdisc_bytes'] or 0 for r in runs) / MB:.0f} MB per run (all ranks); "
                      f"drops {sum(r['qdisc_dropped'] or 0 for r in runs)}")
            if "speedup_2d" in t:
                s = t["speedup_2d"]
                print(f"  t(1d) / t(2d): median {s['median']:.2f}x (min {s['min']:.2f}, max {s['max']:.2f}, "
                      f"{s['n']} paired rounds) on {t['link']}")
    report["load_end"] = os.getloadavg()
    print(f"\n{report['cpu']} ({report['cpus']} CPUs), {report['date']}, load {report['load_start'][0]:.1f} at "
          f"start, {report['load_end'][0]:.1f} at end")
    if args.json:
        args.json.write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
