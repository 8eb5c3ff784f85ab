"""Latent attention's KV cache against standard attention's: bytes per token, what fits a
fixed pool, and decode speed at a long context through the engine.

    OMP_NUM_THREADS=1 python -m bench.mla                              # a few minutes on one core
    OMP_NUM_THREADS=1 python -m bench.mla --context 2048 --batch 8 --rounds 5 --json mla.json

1. From configs (no weights): paged-pool bytes per token (``attention_cache.cache_layout``:
   MLA keeps kv_lora_rank + qk_rope_head_dim values per layer, GQA 2 x n_kv_heads x head_dim)
   for dsv3-tiny against moe-tiny / tiny (same width and depth, GQA) and for
   deepseek-v3-671b against a GQA model of its width and depth (head_dim = dim / n_heads, 8 KV
   heads), plus the naive MLA cache (per-head keys and values, what ``StaticCache`` holds);
   and the largest batch x context that fits a fixed pool (``--pool_gib``, bf16) for each.
2. Measured: decode tokens/s of dsv3-tiny (absorbed MLA over its latent pool; the engine's
   plain forward path, MLA has no allocation-free step) and moe-tiny (the same MoE model with
   GQA attention) on its allocation-free step and on the plain forward path, random weights, ``--batch`` rows at ``--context``
   tokens of context (prompt ``--context`` - ``--new_tokens``, then ``--new_tokens`` decoded).
   Decode tok/s = tokens decoded / the engine's decode seconds (prefill excluded). Each round
   runs the three, each first in turn; the ratios MLA / GQA are paired within a round and
   summarised by median and IQR. A benchmark, not a test: it
   prints tables (and ``--json``) and exits 0.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics

import torch

from trainforge.infer.engine import Engine, EngineConfig
from trainforge.infer.prepare import prepare_model
from trainforge.infer.sampling import SamplingParams
from trainforge.model import FLAVORS, build_model
from trainforge.model.attention_cache import kv_bytes_per_token

GIB = 1024 ** 3


def naive_mla_bytes(cfg, elem: int) -> int:
    """Per-head keys (nope + rope) and values (v) per token, over all layers (StaticCache)."""
    return cfg.n_layers * cfg.n_heads * (cfg.qk_nope_head_dim + cfg.qk_rope_head_dim + cfg.v_head_dim) * elem


def cache_table(pool_gib: float, contexts: list[int]) -> list[dict]:
    v3 = FLAVORS["deepseek-v3-671b"]
    v3_gqa = dataclasses.replace(v3, kv_lora_rank=0, q_lora_rank=0, qk_nope_head_dim=0, qk_rope_head_dim=0,
                                 v_head_dim=0, n_kv_heads=8, rope_factor=1.0, rope_mscale=1.0,
                                 rope_mscale_all_dim=0.0)  # YaRN is for latent attention only
    rows = [("dsv3-tiny (MLA)", FLAVORS["dsv3-tiny"], None), ("moe-tiny (GQA 4 kv)", FLAVORS["moe-tiny"], None),
            ("tiny (GQA 4 kv)", FLAVORS["tiny"], None),
            ("dsv3-tiny naive MLA", FLAVORS["dsv3-tiny"], naive_mla_bytes(FLAVORS["dsv3-tiny"], 2)),
            ("deepseek-v3-671b (MLA)", v3, None), ("671b shape, GQA 8 kv", v3_gqa, None),
            ("671b naive MLA", v3, naive_mla_bytes(v3, 2))]
    pool = int(pool_gib * GIB)
    out = []
    for name, cfg, per in rows:
        per = per if per is not None else kv_bytes_per_token(cfg, 2)
        tokens = pool // per
        out.append({"model": name, "dim": cfg.dim, "n_layers": cfg.n_layers, "bytes_per_token_bf16": per,
                    "pool_tokens": tokens, "max_batch": {c: tokens // c for c in contexts}})
    return out


def decode_round(engine: Engine, prompts: list[list[int]], n: int) -> float:
    c = engine.counters
    tokens0, secs0 = c["generated_tokens"], c["decode_s"]
    engine.generate(prompts, SamplingParams(max_new_tokens=n, temperature=0, ignore_eos=True))
    # The first token of each request comes from its prefill, not a decode step.
    return (c["generated_tokens"] - tokens0 - len(prompts)) / (c["decode_s"] - secs0)


ENGINES = {"mla": "dsv3-tiny (MLA absorbed)", "gqa": "moe-tiny (GQA)", "gqa_forward": "moe-tiny (GQA, forward)"}


def speed(context: int, batch: int, n: int, rounds: int, block_size: int) -> dict:
    engines = {}
    for key, flavor in (("mla", "dsv3-tiny"), ("gqa", "moe-tiny"), ("gqa_forward", "moe-tiny")):
        cfg = dataclasses.replace(FLAVORS[flavor], max_seq_len=max(context, FLAVORS[flavor].max_seq_len))
        model = prepare_model(build_model(cfg, seed=0).eval())
        engines[key] = Engine(model, EngineConfig(max_batch_size=batch, max_context=context, block_size=block_size))
    # The same GQA model on the plain forward path, as MLA's absorbed decode runs (it has no
    # allocation-free step): separates the attention's cost from the decode path's.
    engines["gqa_forward"].runner.decoder = None
    gen = torch.Generator().manual_seed(0)
    V = FLAVORS["moe-tiny"].vocab_size
    prompts = [torch.randint(0, V, (context - n,), generator=gen).tolist() for _ in range(batch)]
    tps: dict[str, list[float]] = {k: [] for k in engines}
    ratios: dict[str, list[float]] = {"gqa": [], "gqa_forward": []}
    for r in range(rounds):
        order = list(engines)[r % 3:] + list(engines)[:r % 3]  # each engine first in turn
        got = {k: decode_round(engines[k], prompts, n) for k in order}
        for k, v in got.items():
            tps[k].append(v)
        for k in ratios:
            ratios[k].append(got["mla"] / got[k])

    def spread(xs):
        q = statistics.quantiles(xs, n=4) if len(xs) > 1 else [xs[0]] * 3
        return {"median": q[1], "iqr": [q[0], q[2]], "samples": xs}

    return {"context": context, "batch": batch, "new_tokens": n, "rounds": rounds,
            "tok_s": {k: statistics.median(v) for k, v in tps.items()},
            "path": {k: "fast_decode" if e.runner.decoder is not None else "forward" for k, e in engines.items()},
            "ratio_mla_over": {k: spread(v) for k, v in ratios.items()},
            "pool_bytes": {k: e.pool.nbytes for k, e in engines.items()},
            "pool_bytes_per_token_fp32": {k: e.pool.bytes_per_token for k, e in engines.items()}}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--pool_gib", type=float, default=16.0, help="the fixed pool for the batch x context table")
    p.add_argument("--contexts", type=int, nargs="+", default=[4096, 32768, 163840])
    p.add_argument("--context", type=int, default=1024, help="context of the decode measurement")
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--new_tokens", type=int, default=32)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--block_size", type=int, default=16)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--skip_speed", action="store_true", help="only the table from configs")
    p.add_argument("--json", default=None, help="also write every number here")
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    table = cache_table(a.pool_gib, a.contexts)
    print(f"KV cache per token (bf16, all layers) and the largest batch in a {a.pool_gib:g} GiB pool")
    print(f"{'model':<24} {'dim x layers':>12} {'bytes/token':>12} {'pool tokens':>12} "
          + " ".join(f"{'B@' + str(c):>9}" for c in a.contexts))
    for r in table:
        print(f"{r['model']:<24} {str(r['dim']) + ' x ' + str(r['n_layers']):>12} {r['bytes_per_token_bf16']:>12,} "
              f"{r['pool_tokens']:>12,} " + " ".join(f"{r['max_batch'][c]:>9,}" for c in a.contexts))
    results = {"cache": table}
    if not a.skip_speed:
        s = speed(a.context, a.batch, a.new_tokens, a.rounds, a.block_size)
        results["speed"] = s
        print(f"\ndecode at {a.context} tokens of context, batch {a.batch}, {a.new_tokens} new tokens, "
              f"{a.rounds} rounds, {a.threads} thread(s), random weights, fp32")
        print(f"{'model':<26} {'path':<12} {'tok/s':>8} {'pool MiB':>9} {'bytes/token':>12} {'MLA / this (IQR)':>20}")
        for k, label in ENGINES.items():
            rr = s["ratio_mla_over"].get(k)
            ratio = f"{rr['median']:.2f} ({rr['iqr'][0]:.2f}-{rr['iqr'][1]:.2f})" if rr else ""
            print(f"{label:<26} {s['path'][k]:<12} {s['tok_s'][k]:>8.1f} {s['pool_bytes'][k] / 2**20:>9.1f} "
                  f"{s['pool_bytes_per_token_fp32'][k]:>12,} {ratio:>20}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
