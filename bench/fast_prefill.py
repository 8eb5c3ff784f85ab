"""A short prompt's prefill: the fast decode step (T one-token rows, ``ModelRunner.prefill``)
against the model's plain forward (``ModelRunner.prefill_forward``), in one process.

    python -m bench.fast_prefill                    # 90m model, fp32 and q4_0, ~1 min on 2 cores
    python -m bench.fast_prefill --threads 1 --json out.json

The model is ``bench/inference.py``'s 90m (random weights, seed 0); q4_0 is its block
quantisation (``quantize_model(..., "q4_0")``), both prepared as ``generate`` prepares them
(fusion, kernels). For each prompt length T the two paths alternate over ``--samples`` pairs
(the order swapping every pair), each writing the same prompt into its own slots; reported: the
median of the paired time ratios forward / fast with min-max, the fast path's median ms, and the
largest logit difference between the two: rounding for fp32; for q4_0 the two paths' kernels
round the int8 activations differently, ~5e-2 apart, each ~0.8 from the fp32 model's logits (the
format's own error on these random weights; measured 2026-12-07). Correctness is
``tests/infer/test_fast_prefill.py``'s (float32, 1e-5); this measures speed.
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import time
from pathlib import Path

import torch

from bench.cpu_decode_peer import cpu_summary
from bench.inference import SIZES
from bench.train_throughput import cpu_counters, others_share
from trainforge.infer.kv_pool import KVPool
from trainforge.infer.prepare import prepare_model
from trainforge.infer.quantize import quantize_model
from trainforge.infer.runner import ModelRunner
from trainforge.model import build_model


def measure(model, lengths: list[int], samples: int) -> dict:
    cfg = model.cfg
    pool = KVPool(cfg.n_layers, cfg.n_kv_heads, cfg.head_dim, 8, 16)
    runner = ModelRunner(model, pool, 1, 64)
    pool.add(0, 16)
    pool.add(1, 16)
    fast_slots, ref_slots = (torch.tensor(pool.append_slots(i, 16)) for i in range(2))
    out = {}
    for T in lengths:
        prompt = torch.randint(0, cfg.vocab_size, (T,), generator=torch.Generator().manual_seed(T))
        runs = {"fast": lambda: runner.prefill(prompt, fast_slots[:T]),
                "forward": lambda: runner.prefill_forward(prompt, ref_slots[:T])}
        for f in runs.values():  # warm-up: binds the step for T rows, first-call paths
            f()
        times: dict[str, list[float]] = {"fast": [], "forward": []}
        for i in range(samples):
            for name in (("fast", "forward") if i % 2 == 0 else ("forward", "fast")):
                t0 = time.perf_counter()
                runs[name]()
                times[name].append(time.perf_counter() - t0)
        ratios = [b / a for a, b in zip(times["fast"], times["forward"])]
        diff = (runs["fast"]().float() - runs["forward"]().float()).abs().max().item()
        out[T] = {"forward_over_fast": statistics.median(ratios), "min": min(ratios), "max": max(ratios),
                  "fast_ms": 1e3 * statistics.median(times["fast"]),
                  "forward_ms": 1e3 * statistics.median(times["forward"]), "max_abs_logit_diff": diff}
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--threads", type=int, default=torch.get_num_threads())
    p.add_argument("--lengths", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    p.add_argument("--samples", type=int, default=15, help="paired samples per prompt length")
    p.add_argument("--json", type=Path)
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    if max(a.lengths) > ModelRunner.FAST_PREFILL_TOKENS:
        p.error(f"--lengths: the fast path takes at most {ModelRunner.FAST_PREFILL_TOKENS} tokens")
    base = build_model(SIZES["90m"], seed=0).eval().requires_grad_(False)
    q4 = copy.deepcopy(base)
    quantize_model(q4, "q4_0", pack=False)
    c0, t0 = cpu_counters(), time.perf_counter()
    results = {}
    with torch.inference_mode():
        for name, m in (("fp32", base), ("q4_0", q4)):
            results[name] = measure(prepare_model(m), a.lengths, a.samples)
    share = others_share(c0, cpu_counters(), time.perf_counter() - t0)
    cpu = cpu_summary()
    print(f"{cpu['model']}; flags {' '.join(cpu['flags'])}; torch {torch.__version__}; {a.threads} threads; other processes used "
          f"{100 * share:.0f}% of the CPUs meanwhile")
    print("model   T | forward / fast, median (min-max) | fast ms | forward ms | max |logit diff|")
    for name, rows in results.items():
        for T, r in rows.items():
            print(f"{name:5s} {T:3d} | {r['forward_over_fast']:5.2f} ({r['min']:.2f}-{r['max']:.2f})"
                  f"{'':14s} | {r['fast_ms']:7.2f} | {r['forward_ms']:10.2f} | {r['max_abs_logit_diff']:.2e}")
    if a.json:
        a.json.write_text(json.dumps({"machine": cpu, "threads": a.threads, "others_share": share,
                                      "results": results}, indent=1) + "\n")


if __name__ == "__main__":
    main()
