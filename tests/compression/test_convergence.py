"""Convergence with compressed gradients, as a claim over seeds: int4 with error feedback
and the adaptive codec end as low as uncompressed (fp32) training, within the seed-to-seed
spread.

Setup (the same as the convergence section of ``bench/grad_compression.py``; keep the
two in sync): the ``tiny`` flavor cut to width 128 and 4 blocks (``SHAPE``, 0.87M
parameters; the 256-wide ``tiny`` took 2.4x the CPU time, ~530 vs ~220 CPU s for all 9
runs, for the same verdicts), 2 ranks under
torchrun (DDP, gloo), batch 4 x 32 tokens per rank, 150 steps, compression from step 10,
validation on the first 16 validation batches (the same tokens for every seed and codec).
Each codec runs with seeds 1, 2, 3; a seed fixes the initial weights and the data order,
so seed s of a codec and seed s of fp32 differ only in what compression does.

Why seeds: a single run asserts noise. Any change in rounding (a codec, or the same code
on a CPU with another vector width: AVX2 vs AVX-512) sends a run on its own path, and
after 150 steps two such paths end up to ~0.1 nat (2%) apart. One seed with a 1%
bound passed on an AVX-512 machine and failed on an AVX2-only one (+1.45%). The bound below
is set from the spread measured over seeds, which covers that rounding spread, so it holds
on either kind of machine.

The test can fail: every run must have learned (final loss far below the initial one),
and a codec that costs accuracy fails the bound: top-k 5% + int4 + EF, 0.44 nats (9 seed
standard deviations) worse, is rejected by it (measured in the same set of runs).
"""

from __future__ import annotations

import json
import math
import statistics
from pathlib import Path

import pytest

from tests.parallel.torchrun import run_torchrun
from trainforge.monitor.jsonl import read_jsonl

pytestmark = pytest.mark.slow
WORKERS = Path(__file__).parent / "workers"

SEEDS = (1, 2, 3)
CODECS = {
    "fp32": ["--compression.codec", "none"],
    "int4+EF": ["--compression.codec", "int4"],
    "adaptive": ["--compression.codec", "adaptive"],
}
STEPS = 150
SHAPE = ["--model.flavor", "tiny", "--model.dim", "128", "--model.n_heads", "4", "--model.n_kv_heads", "2",
         "--model.ffn_hidden_dim", "352", "--model.n_layers", "4"]

# The bound on mean(codec) - mean(fp32), in nats of validation loss:
#   K_STD x pooled seed std + MARGIN.
# Measured here (AMD EPYC, AVX2 only) on SHAPE: final val loss for seeds 1 / 2 / 3, fp32
# 4.4022 / 4.4963 / 4.4368, int4+EF 4.4305 / 4.5289 / 4.4660, adaptive 4.4297 / 4.5275 /
# 4.4598. Pooled seed std 0.049 nats (1.1%); paired regret int4+EF +0.030 (+0.028 to
# +0.033), adaptive +0.027 (+0.023 to +0.031). A difference of two 3-run means has a
# standard error of sqrt(2/3) = 0.82 seed std, so K_STD = 4 sits ~4.9 standard errors out.
# On the 256-wide ``tiny`` (docs/benchmarks-archive.md: seed std 0.060, regret +0.044, +0.038) a
# simulation (a true regret of +0.044 kept, seed std 0.06-0.10, the std itself estimated
# from 9 runs as here) gave an honest codec failing the bound on ~0.4% of machine kinds
# (K_STD = 3: ~1.4%); SHAPE's regret is a smaller fraction of its seed std (0.6 vs 0.7),
# so no worse. MARGIN keeps the bound sane when three seeds happen to agree closely.
# Power: the bound is 0.22 nats here; top-k 5% + int4 + EF ends +0.44 (+0.41 to +0.49)
# above fp32 and fails it (on the 256-wide tiny: bound 0.26, top-k +0.61).
K_STD = 4.0
MARGIN = 0.02
# "It learned": ln(512) = 6.24 at random init; every run measured ends >= 1.73 nats lower
# (top-k 5% + int4: 1.33); a run that diverges or does not update stays near 6.2.
MIN_DROP = 1.0


def val_losses(run_dir) -> tuple[float, float]:
    """(initial, final) validation loss of a finished run."""
    vals = [r["val_loss"] for r in read_jsonl(run_dir / "metrics.jsonl") if "val_loss" in r]
    return vals[0], vals[-1]


def train_all(out, data) -> dict[tuple[str, int], tuple[float, float]]:
    """Every (codec, seed) run, one after another in ONE torchrun launch (workers/train_many.py:
    the same Trainer as ``trainforge train``, bit-identical results, without 9 launches);
    (codec, seed) -> (initial, final) validation loss."""
    base = ["--data.path", str(data), *SHAPE, "--training.seq_len", "32", "--training.batch_size", "4",
            "--training.steps", str(STEPS), "--training.warmup_steps", "15", "--training.log_interval", "50",
            "--training.val_interval", "0", "--training.val_batches", "16", "--training.threads", "1",
            "--checkpoint.interval", "0", "--sample.max_new_tokens", "0", "--parallel.dp_replicate", "2",
            "--compression.warmup_steps", "10"]
    runs = {f"{name}-{seed}": [*base, "--training.seed", str(seed), *codec]
            for name, codec in CODECS.items() for seed in SEEDS}
    # Generous timeout: ~220 CPU s in all (~2 min on a quiet 2-core machine); 4.7 min measured at load 10.
    run_torchrun(WORKERS / "train_many.py", 2, str(out), json.dumps(runs), timeout_s=1500)
    return {(name, seed): val_losses(out / f"{name}-{seed}") for name in CODECS for seed in SEEDS}


def pooled_std(groups: list[list[float]]) -> float:
    """Within-group sample std, pooled over the groups (each group: one codec over seeds)."""
    ss = sum(sum((x - statistics.fmean(g)) ** 2 for x in g) for g in groups)
    df = sum(len(g) - 1 for g in groups)
    return math.sqrt(ss / df)


def test_int4_with_error_feedback_and_adaptive_converge_like_fp32_over_seeds(tmp_path, small_data):
    vals = train_all(tmp_path, small_data)
    final: dict[str, list[float]] = {}
    for name in CODECS:
        final[name] = []
        for seed in SEEDS:
            first, last = vals[name, seed]
            assert last <= first - MIN_DROP, f"{name} seed {seed} did not learn: val loss {first:.4f} -> {last:.4f}"
            final[name].append(last)
    std = pooled_std(list(final.values()))
    bound = K_STD * std + MARGIN
    base = statistics.fmean(final["fp32"])
    report = {k: [round(v, 4) for v in vs] for k, vs in final.items()}
    for name in ("int4+EF", "adaptive"):
        regret = statistics.fmean(final[name]) - base
        assert regret <= bound, (f"{name}: mean final val loss {regret:+.4f} above fp32, bound {bound:.4f} "
                                 f"(pooled seed std {std:.4f}); per seed {report}")
