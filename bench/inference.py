"""Inference speed: trainforge's engine against Hugging Face ``generate()`` and a plain
KV-cache loop, on the same weights, in one process, interleaved.

    python -m bench.inference                        # tiny + 90m, fp32 / int8 / int4 / q8_0 / q4_0
    python -m bench.inference --compile              # adds torch.compile'd decode (slow start)
    python -m bench.inference --sizes tiny --json out.json

Run from the repository root (``-m`` puts it on the path). CPU, ``--threads`` intra-op
threads (default 2). Random weights (seeded): speed does not depend on what they are.

Sizes: ``tiny`` (the flavor, 10.1M parameters) and ``90m`` (the ``small`` flavor with
vocabulary 8192: 88.1M parameters, 352 MB in fp32, ten times the 32 MB LLC).

What is measured, per size:

- **Batch-1 decode** for ``hf`` (``LlamaForCausalLM.generate``, greedy, SDPA attention),
  ``plain`` (the model's own static KV cache, one ``model(token)`` call and one ``.item()``
  per token: the loop ``trainforge generate`` had before the engine), and the engine
  ``fp32`` / ``int8`` / ``int4`` / ``q8_0`` / ``q4_0`` (fused, quantised in memory by the two-phase transform;
  ``compiled`` with ``--compile``). One prompt of 16 tokens; each run generates
  ``--new_tokens`` tokens greedily (EOS ignored). TTFT = request to first token (prefill
  included); decode tok/s = (n - 1) / (last token - first token). Rounds run every variant
  once, in an order rotated each round; ratios are paired within a round and summarised by
  median and IQR over rounds.
- **Bandwidth bound**: decoding one token reads every weight once, so tok/s <= copy
  bandwidth / weight bytes per token. Copy bandwidth is measured in this run (a 256 MB
  ``copy_``, STREAM convention: read + write bytes / time, best of 5) before and after; the
  bound uses their mean. Weight bytes per token: every linear and norm weight in the
  variant's storage (int8 codes + scales, int4 codes + scales and zeros) plus one embedding
  row. "share" = measured tok/s / bound.
- **What a 2-core guest can stream**, measured beside the copy bandwidth: a 256 MB ``sum``
  (pure read, bytes read / time, best of 5; decode only reads weights) and the fp32 engine's
  linears alone, through its own kernel, on its own weights (the "matmul ceiling": a decode
  step with every other op free). fp32's share of each is printed, so a low share of the
  copy bound can be told apart from a slow engine.
- **Peak memory**: the variant's resident bytes (weights, KV cache / pool, engine
  workspace) plus the peak of allocations made during one generation (profiler memory
  events; not timed).
- **Greedy-token agreement** of int8 / int4 with fp32, teacher-forced: the quantised model
  reads fp32's greedy sequence and we count positions whose argmax matches fp32's. Random
  weights give near-uniform next-token distributions, where small perturbations flip the
  argmax far more often than in a trained model: a pessimistic proxy, printed but not judged.
  The 95% target is judged on a trained checkpoint (``--agreement_checkpoint``); the test
  suite checks perplexity on a trained model.
- **Continuous batching**: N = 8 and 32 requests (prompts of 8-48 tokens, ``--batch_new_tokens``
  each) through one engine with ``max_batch_size = N``, against the same requests one at a
  time (sequential; at 90m on the first 8 requests, throughput being per token). Generated
  tokens / wall time; sequential and batched alternate, ratio against the mean of the
  neighbouring sequential runs.
- **Operator count** of one decode step without and with the fusion pass (``fusion.count_ops``).

Load: like ``bench/train_throughput.py``, every sample carries the share of the machine's
CPU other processes used meanwhile (from /proc/stat), and the busiest other processes are
named. A benchmark, not a test: it prints the targets' PASS / FAIL and exits 0.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import statistics
import time
from datetime import datetime, timezone

import numpy as np
import torch
import transformers
from torch import nn

from bench.train_throughput import cpu_counters, cpu_model, load_note, process_cpu_s
from trainforge.infer.engine import Engine, EngineConfig
from trainforge.infer.fusion import count_ops
from trainforge.infer.prepare import prepare_model
from trainforge.infer.quantize import QuantLinear, measure_kernels, quantize_model
from trainforge.infer.sampling import SamplingParams
from trainforge.model import FLAVORS, build_model
from trainforge.model.attention_cache import StaticCache
from trainforge.model.hf import to_hf_config_dict, to_hf_state_dict

SIZES = {"tiny": FLAVORS["tiny"], "90m": dataclasses.replace(FLAVORS["small"], vocab_size=8192)}
PROMPT_TOKENS = 16
TARGETS = {"fp32_share": 0.70, "int8_vs_plain": 3.0, "int4_vs_plain": 4.0, "q8_0_vs_plain": 3.0, "q4_0_vs_plain": 4.0,
           "agreement": 0.95, "vs_hf": 2.0, "batching_32": 4.0}


def best_seconds(fn, repeats: int = 5) -> float:
    """Shortest of ``repeats`` timed calls of ``fn``, after one untimed warm-up call."""
    fn()
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def copy_bandwidth_gbs(mb: int = 256, repeats: int = 5) -> float:
    a = torch.ones(mb * 2**20 // 4)
    b = torch.empty_like(a)
    return 2 * a.nbytes / best_seconds(lambda: b.copy_(a), repeats) / 1e9


def read_bandwidth_gbs(mb: int = 256, repeats: int = 5) -> float:
    """Streaming read rate: ``sum`` of a 256 MB tensor, best of 5 (bytes read / time). Decode
    only reads weights, so this, not copy, is the rate it could at best reach."""
    a = torch.ones(mb * 2**20 // 4)
    return a.nbytes / best_seconds(a.sum, repeats) / 1e9


def matmul_ceiling_tok_s(engine: Engine, repeats: int = 5) -> float:
    """Tokens/s if a batch-1 decode step were only its linears, run by the engine's own kernel
    (``decode_workspace.LinearInto``) on its own weights: best of 5. What the rest of the step costs is the gap
    between this and the measured decode speed."""
    calls = []
    for into in engine.runner.decoder.linears.values():
        n, k = into.mod.weight.shape
        calls.append(into.bind(torch.randn(1, k), torch.empty(1, n)))

    def step() -> None:
        for c in calls:
            c()
    return 1 / best_seconds(step, repeats)


def weight_bytes_per_token(model: nn.Module) -> int:
    """Bytes of weights one decoded token reads: linears and norms, one embedding row."""
    total = 0
    for m in model.modules():
        if isinstance(m, QuantLinear):
            total += m.weight_bytes
        elif isinstance(m, nn.Linear):
            total += m.weight.nbytes
        elif isinstance(m, nn.Embedding):
            total += m.weight[0].nbytes
        elif hasattr(m, "eps") and hasattr(m, "weight"):  # RMSNorm
            total += m.weight.nbytes
    return total


def resident_bytes(model: nn.Module) -> int:
    seen, total = set(), 0
    for t in [*model.parameters(), *model.buffers()]:
        if t.data_ptr() not in seen:
            seen.add(t.data_ptr())
            total += t.nbytes
    return total + sum(m.weight_bytes for m in model.modules() if isinstance(m, QuantLinear))


def peak_transient_bytes(fn) -> int:
    """Peak of (allocated - freed) bytes while ``fn`` runs, from the profiler's memory events."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    events = sorted((e.start_ns(), e.nbytes()) for e in prof.profiler.kineto_results.events() if e.name() == "[memory]")
    live = peak = 0
    for _, n in events:
        live += n
        peak = max(peak, live)
    return peak


@dataclasses.dataclass
class Sample:
    ttft_s: float
    decode_tok_s: float
    ids: list[int]


class HFGenerate:
    name = "hf"

    def __init__(self, base):
        cfg = transformers.LlamaConfig(**to_hf_config_dict(base.cfg), attn_implementation="sdpa")
        self.model = transformers.LlamaForCausalLM(cfg).eval()
        self.model.load_state_dict(to_hf_state_dict(base.state_dict(), base.cfg), strict=True)
        self.bytes_per_token = weight_bytes_per_token(base)
        self.resident = resident_bytes(self.model)

    def run(self, prompt: list[int], n: int) -> Sample:
        stamps: list[float] = []

        class Stamp(transformers.StoppingCriteria):
            def __call__(self, input_ids, scores, **kwargs):
                stamps.append(time.perf_counter())
                return torch.zeros(input_ids.shape[0], dtype=torch.bool)

        t0 = time.perf_counter()
        with torch.no_grad():
            out = self.model.generate(torch.tensor([prompt]), max_new_tokens=n, min_new_tokens=n, do_sample=False,
                                      stopping_criteria=[Stamp()], pad_token_id=0, eos_token_id=None)
        return Sample(stamps[0] - t0, (n - 1) / (stamps[-1] - stamps[0]), out[0, len(prompt):].tolist())


class PlainLoop:
    """The loop ``trainforge generate`` used before the engine: a static cache
    (``StaticCache``), one ``model(token, positions, cache)`` call and one ``.item()`` per token."""

    name = "plain"

    def __init__(self, base):
        self.model = base
        self.bytes_per_token = weight_bytes_per_token(base)
        self.resident = resident_bytes(base)

    @torch.no_grad()
    def run(self, prompt: list[int], n: int) -> Sample:
        model = self.model
        t0 = time.perf_counter()
        cache = StaticCache.for_model(model, 1, len(prompt) + n)
        logits = model(torch.tensor([prompt]), cache.advance(len(prompt)), cache)[:, -1]
        nxt = logits.argmax(dim=-1, keepdim=True)
        ids = [int(nxt.item())]
        t1 = time.perf_counter()
        for _ in range(n - 1):
            logits = model(nxt, cache.advance(1), cache)[:, -1]
            nxt = logits.argmax(dim=-1, keepdim=True)
            ids.append(int(nxt.item()))
        t2 = time.perf_counter()
        return Sample(t1 - t0, (n - 1) / (t2 - t1), ids)


class Ours:
    def __init__(self, name: str, model, context: int, compile: bool = False):
        self.name, self.model = name, prepare_model(model)
        self.engine = Engine(model, EngineConfig(max_batch_size=1, max_queue=1, max_context=context, compile=compile))
        self.bytes_per_token = weight_bytes_per_token(model)
        self.resident = resident_bytes(model) + self.engine.pool.nbytes + self.engine.runner.workspace_bytes

    def run(self, prompt: list[int], n: int) -> Sample:
        req = self.engine.generate([prompt], SamplingParams(max_new_tokens=n, temperature=0, ignore_eos=True))[0]
        return Sample(req.ttft_s, (n - 1) / (req.finished_s - req.first_token_s), req.output_ids)


def summary(xs: list[float]) -> dict[str, float]:
    q = np.percentile(xs, [25, 50, 75])
    return {"median": float(q[1]), "q1": float(q[0]), "q3": float(q[2]), "min": min(xs), "max": max(xs)}


@torch.no_grad()
def teacher_forced_agreement(model_q, model_f, seq: list[int], n_prompt: int) -> float:
    x = torch.tensor([seq])
    a = model_q(x)[0, n_prompt - 1:-1].argmax(-1)
    b = model_f(x)[0, n_prompt - 1:-1].argmax(-1)
    return float((a == b).float().mean())


def bench_size(size: str, args) -> dict:
    cfg = SIZES[size]
    n = args.new_tokens or (64 if size == "tiny" else 32)
    rounds = args.rounds or (7 if size == "tiny" else 5)
    print(f"\n== {size}: {cfg.num_params() / 1e6:.1f}M parameters, {n} new tokens, {rounds} rounds", flush=True)
    base = build_model(cfg, seed=0).eval().requires_grad_(False)
    prompt = torch.randint(0, cfg.vocab_size, (PROMPT_TOKENS,), generator=torch.Generator().manual_seed(1)).tolist()
    ctx = PROMPT_TOKENS + n
    variants = [HFGenerate(base), PlainLoop(base), Ours("fp32", copy.deepcopy(base), ctx)]
    # int4 groups: the largest of 128 / 64 / 32 that divides every linear's input size, so no
    # layer is left in fp32 (tiny's 704-wide MLP takes 64).
    group_size = args.group_size or next(g for g in (128, 64, 32) if cfg.dim % g == 0 and cfg.ffn_hidden_dim % g == 0)
    for mode in args.modes:
        m = copy.deepcopy(base)
        info = quantize_model(m, mode, pack=False, **({"group_size": group_size} if mode == "int4" else {}))
        assert not info["skipped"], info["skipped"]
        variants.append(Ours(mode, m, ctx))
    if args.compile:
        compiled = Ours("compiled", variants[2].model, ctx, compile=True)
        print(f"compiled decode step: compile took {compiled.engine.compile_s:.1f} s", flush=True)
        variants.append(compiled)
    bw_before, read_before = copy_bandwidth_gbs(), read_bandwidth_gbs()
    ceiling_before = matmul_ceiling_tok_s(variants[2].engine)
    for v in variants:  # warm-up (allocator, first-call paths), untimed
        v.run(prompt, 4)
    samples: dict[str, list[Sample]] = {v.name: [] for v in variants}
    loads = []
    for r in range(rounds):
        order = variants[r % len(variants):] + variants[:r % len(variants)]
        for v in order:
            c0, t0 = cpu_counters(), time.perf_counter()
            samples[v.name].append(v.run(prompt, n))
            loads.append(load_note(c0, cpu_counters(), time.perf_counter() - t0)["other_processes_share"])
        print(f"  round {r}: " + ", ".join(f"{v.name} {samples[v.name][-1].decode_tok_s:.1f}" for v in variants),
              flush=True)
    bw_after, read_after = copy_bandwidth_gbs(), read_bandwidth_gbs()
    ceiling_after = matmul_ceiling_tok_s(variants[2].engine)
    bw, read = (bw_before + bw_after) / 2, (read_before + read_after) / 2
    out: dict = {"params": cfg.num_params(), "new_tokens": n, "rounds": rounds, "int4_group_size": group_size,
                 "copy_bandwidth_gbs": {"before": bw_before, "after": bw_after},
                 "read_bandwidth_gbs": {"before": read_before, "after": read_after},
                 "fp32_matmul_ceiling_tok_s": {"before": ceiling_before, "after": ceiling_after},
                 "variants": {}, "other_processes_share": summary(loads)}
    fp32_ids = samples["fp32"][0].ids
    for v in variants:
        s = samples[v.name]
        tok_s = [x.decode_tok_s for x in s]
        bound = bw * 1e9 / v.bytes_per_token
        row = {"decode_tok_s": summary(tok_s), "ttft_ms": summary([x.ttft_s * 1e3 for x in s]),
               "bytes_per_token": v.bytes_per_token, "bound_tok_s": bound,
               "bound_share": statistics.median(tok_s) / bound,
               "read_bound_share": statistics.median(tok_s) / (read * 1e9 / v.bytes_per_token),
               "peak_memory_mb": (v.resident + peak_transient_bytes(lambda: v.run(prompt, n))) / 2**20,
               "resident_mb": v.resident / 2**20,
               "same_tokens_as_fp32": s[0].ids == fp32_ids}
        for ref in ("plain", "hf"):
            row[f"vs_{ref}"] = summary([a.decode_tok_s / b.decode_tok_s for a, b in zip(s, samples[ref])])
            row[f"ttft_vs_{ref}"] = summary([b.ttft_s / a.ttft_s for a, b in zip(s, samples[ref])])
        if isinstance(v, Ours) and v.name in args.modes:
            row["agreement_teacher_forced"] = teacher_forced_agreement(v.model, variants[2].model,
                                                                       prompt + fp32_ids, len(prompt))
            row["agreement_free_running"] = float(np.mean([a == b for a, b in zip(s[0].ids, fp32_ids)]))
        if v.name == "fp32":
            row["matmul_ceiling_share"] = statistics.median(tok_s) / ((ceiling_before + ceiling_after) / 2)
        if v.name == "compiled":
            row["compile_s"] = v.engine.compile_s
        out["variants"][v.name] = row
    out["ops"] = decode_op_counts(base)
    out["batching"] = {N: batching(variants[2].model, cfg, N, size, args) for N in (8, 32)}
    return out


def checkpoint_agreement(path: str, group_size: int, modes: list[str], n_prompts: int = 8, n_new: int = 64
                         ) -> dict:
    """Greedy-token agreement of the quantised modes with fp32 on a trained checkpoint: prompts are
    the first 32 tokens of standard-library modules, continued greedily by fp32."""
    import sysconfig
    from pathlib import Path

    from trainforge.infer.loading import load_model

    loaded = load_model(path)
    tok, fp32 = loaded.tokenizer, loaded.model
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    names = ("heapq.py", "bisect.py", "colorsys.py", "fnmatch.py", "shlex.py", "glob.py", "keyword.py", "this.py")
    prompts = [tok.encode((stdlib / n).read_text()).ids[:32] for n in names[:n_prompts]]
    params = SamplingParams(max_new_tokens=n_new, temperature=0, ignore_eos=True)
    ref = Engine(prepare_model(copy.deepcopy(fp32)), EngineConfig(max_batch_size=n_prompts, max_context=32 + n_new)).generate(
        prompts, params)
    out = {"checkpoint": str(loaded.path), "params": fp32.cfg.num_params(), "prompts": n_prompts, "new_tokens": n_new}
    for mode in modes:
        m = copy.deepcopy(fp32)
        quantize_model(m, mode, **({"group_size": group_size} if mode == "int4" else {}))
        got = Engine(prepare_model(m), EngineConfig(max_batch_size=n_prompts, max_context=32 + n_new)).generate(prompts, params)
        tf = [teacher_forced_agreement(m, fp32, p + r.output_ids, len(p)) for p, r in zip(prompts, ref)]
        free = [np.mean([a == b for a, b in zip(g.output_ids, r.output_ids)]) for g, r in zip(got, ref)]
        out[mode] = {"teacher_forced": float(np.mean(tf)), "free_running": float(np.mean(free))}
    print(f"agreement on {path}: {json.dumps(out)}", flush=True)
    return out


def decode_op_counts(base) -> dict:
    res = {}
    for fuse in (False, True):
        model = base if not fuse else copy.deepcopy(base)
        e = Engine(prepare_model(model, fuse=fuse), EngineConfig(max_batch_size=1, max_context=64))
        e.submit([1, 2, 3], SamplingParams(max_new_tokens=8, temperature=0))
        e.step()
        ops = count_ops(e.runner.decode, 1, 16)
        res["fused" if fuse else "unfused"] = {"compute": ops["compute"], "total": ops["total"]}
    return res


def batching(model, cfg, N: int, size: str, args) -> dict:
    new = args.batch_new_tokens or (64 if size == "tiny" else 32)
    rng = np.random.default_rng(N)
    prompts = [rng.integers(0, cfg.vocab_size, int(rng.integers(8, 49))).tolist() for _ in range(N)]
    params = SamplingParams(max_new_tokens=new, temperature=0, ignore_eos=True)
    n_seq = N if size == "tiny" else min(N, 8)
    seq = Engine(model, EngineConfig(max_batch_size=1, max_queue=1, max_context=48 + new))
    batched = Engine(model, EngineConfig(max_batch_size=N, max_queue=N, max_context=48 + new))
    seq.generate(prompts[:1], params)
    batched.generate(prompts[:2], params)  # warm-up

    def run_seq():
        t0 = time.perf_counter()
        for p in prompts[:n_seq]:
            seq.generate([p], params)
        return n_seq * new / (time.perf_counter() - t0)

    def run_batched():
        t0 = time.perf_counter()
        reqs = batched.generate(prompts, params)
        dt = time.perf_counter() - t0
        return N * new / dt, [r.ttft_s for r in reqs]

    seq_tps, bat_tps, ttfts = [run_seq()], [], []
    for _ in range(args.batch_rounds):
        tps, tt = run_batched()
        bat_tps.append(tps)
        ttfts += tt
        seq_tps.append(run_seq())
    ratios = [b / ((seq_tps[i] + seq_tps[i + 1]) / 2) for i, b in enumerate(bat_tps)]
    pool = batched.pool
    res = {"requests": N, "new_tokens": new, "sequential_tok_s": summary(seq_tps), "batched_tok_s": summary(bat_tps),
           "ratio": summary(ratios), "batched_ttft_ms": summary([t * 1e3 for t in ttfts]),
           "pool_peak_block_utilisation": pool.peak_blocks_used / pool.usable_blocks,
           "pool_mb": pool.nbytes / 2**20}
    print(f"  batching N={N}: sequential {res['sequential_tok_s']['median']:.1f} tok/s, batched "
          f"{res['batched_tok_s']['median']:.1f} tok/s, ratio {res['ratio']['median']:.2f}", flush=True)
    return res


def report(results: dict, machine: dict, trained: dict | None, modes: list[str]) -> None:
    print("\n" + json.dumps(machine, indent=1))
    for size, r in results.items():
        bw = r["copy_bandwidth_gbs"]
        print(f"\n### {size} ({r['params'] / 1e6:.1f}M params, int4 group {r['int4_group_size']}; copy bandwidth "
              f"{bw['before']:.1f} / {bw['after']:.1f} GB/s before/after; other processes "
              f"{100 * r['other_processes_share']['median']:.0f}% of the machine, median over samples)\n")
        rd, ce, f32 = r["read_bandwidth_gbs"], r["fp32_matmul_ceiling_tok_s"], r["variants"]["fp32"]
        print(f"streaming read (sum) {rd['before']:.1f} / {rd['after']:.1f} GB/s: fp32 is {100 * f32['read_bound_share']:.0f}% "
              f"of the read bound; its linears alone (engine kernel, no other op) run at {ce['before']:.1f} / "
              f"{ce['after']:.1f} tok/s: fp32 decode is {100 * f32['matmul_ceiling_share']:.0f}% of that\n")
        print("| variant | decode tok/s median [min, max] | x plain (IQR) | x HF (IQR) | TTFT ms | "
              "bound tok/s | share of bound | peak MB | agreement (teacher-forced / free) |")
        print("|---|---|---|---|---|---|---|---|---|")
        for name, v in r["variants"].items():
            d = v["decode_tok_s"]
            agree = (f"{100 * v['agreement_teacher_forced']:.1f}% / {100 * v['agreement_free_running']:.1f}%"
                     if "agreement_teacher_forced" in v else ("same tokens" if v["same_tokens_as_fp32"] else "-"))
            print(f"| {name} | {d['median']:.1f} [{d['min']:.1f}, {d['max']:.1f}] | "
                  f"{v['vs_plain']['median']:.2f} ({v['vs_plain']['q1']:.2f}-{v['vs_plain']['q3']:.2f}) | "
                  f"{v['vs_hf']['median']:.2f} ({v['vs_hf']['q1']:.2f}-{v['vs_hf']['q3']:.2f}) | "
                  f"{v['ttft_ms']['median']:.1f} | {v['bound_tok_s']:.1f} | {100 * v['bound_share']:.0f}% | "
                  f"{v['peak_memory_mb']:.0f} | {agree} |")
        print(f"\ndecode-step ops (compute / with views): unfused {r['ops']['unfused']['compute']} / "
              f"{r['ops']['unfused']['total']}, fused {r['ops']['fused']['compute']} / {r['ops']['fused']['total']}")
        for N, b in r["batching"].items():
            print(f"continuous batching, {N} requests: {b['batched_tok_s']['median']:.1f} tok/s vs sequential "
                  f"{b['sequential_tok_s']['median']:.1f} -> x{b['ratio']['median']:.2f} "
                  f"(TTFT median {b['batched_ttft_ms']['median']:.0f} ms, max {b['batched_ttft_ms']['max']:.0f} ms; "
                  f"KV pool peak {100 * b['pool_peak_block_utilisation']:.0f}% of {b['pool_mb']:.0f} MB)")
    if trained:
        print(f"\ngreedy-token agreement with fp32 on the trained checkpoint {trained['checkpoint']} "
              f"({trained['params'] / 1e6:.1f}M params, {trained['prompts']} prompts x {trained['new_tokens']} "
              "tokens): "
              + ", ".join(f"{m} {100 * trained[m]['teacher_forced']:.1f}% teacher-forced / "
                          f"{100 * trained[m]['free_running']:.1f}% free-running" for m in modes))
    print("\ntargets:")
    for size, r in results.items():
        v = r["variants"]
        checks = {
            "fp32 >= 70% of the bandwidth bound": v["fp32"]["bound_share"] >= TARGETS["fp32_share"],
            **{f"{m} >= {TARGETS[f'{m}_vs_plain']:.0f}x plain": v[m]["vs_plain"]["median"] >=
               TARGETS[f"{m}_vs_plain"] for m in modes},
            "fp32 >= 2x HF generate": v["fp32"]["vs_hf"]["median"] >= TARGETS["vs_hf"],
            "batching >= 4x sequential at 32": r["batching"][32]["ratio"]["median"] >= TARGETS["batching_32"],
        }
        for what, ok in checks.items():
            print(f"  {size}: {what}: {'PASS' if ok else 'FAIL'}")
    # The agreement target is judged on a trained model only: random weights give near-uniform next-token
    # distributions whose argmax a quantisation error flips (int8 read 68.8% there and 98.8% on the trained
    # checkpoint, docs/benchmarks-archive.md), so their figure is printed above as a pessimistic proxy, not judged.
    if trained:
        ok = min(trained[m]["teacher_forced"] for m in modes) >= TARGETS["agreement"]
        print(f"  trained checkpoint: quantised agreement >= 95% (teacher-forced): {'PASS' if ok else 'FAIL'}")
    else:
        print("  quantised agreement >= 95% (teacher-forced, trained checkpoint): not measured; give "
              "--agreement_checkpoint (the random-weights figures above are a proxy, not judged)")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", nargs="+", default=list(SIZES), choices=list(SIZES))
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--rounds", type=int, default=0, help="0 = 7 (tiny) / 5 (90m)")
    p.add_argument("--new_tokens", type=int, default=0, help="0 = 64 (tiny) / 32 (90m)")
    p.add_argument("--batch_new_tokens", type=int, default=0, help="0 = 64 (tiny) / 32 (90m)")
    p.add_argument("--batch_rounds", type=int, default=2)
    p.add_argument("--modes", nargs="+", default=["int8", "int4", "q8_0", "q4_0"],
                   choices=["int8", "int4", "q8_0", "q4_0"],
                   help="quantised variants (q8_0 / q4_0: the 32-value block formats on the C++ CPU kernels)")
    p.add_argument("--group_size", type=int, default=0,
                   help="int4 group size; 0 = the largest of 128/64/32 dividing every layer's input size")
    p.add_argument("--compile", action="store_true", help="also a torch.compile'd decode step (minutes to compile)")
    p.add_argument("--agreement_checkpoint", default=None,
                   help="a trained checkpoint on which to also measure int8 / int4 greedy-token agreement")
    p.add_argument("--json", default=None, help="also write every number here")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    transformers.logging.set_verbosity_error()
    before_procs, c0, t0 = process_cpu_s(), cpu_counters(), time.perf_counter()
    kernels = {"int8": measure_kernels("int8", "cpu"), "int4": measure_kernels("int4", "cpu", group_size=128)}
    print("kernel ms per call, batch-1 4096 x 4096: " + json.dumps(kernels), flush=True)
    results = {size: bench_size(size, args) for size in args.sizes}
    trained = checkpoint_agreement(args.agreement_checkpoint, args.group_size or 64, args.modes) \
        if args.agreement_checkpoint \
        else None
    wall = time.perf_counter() - t0
    after_procs = process_cpu_s()
    busiest = sorted(((after_procs[pid][0] - before_procs[pid][0], after_procs[pid][1]) for pid in after_procs
                      if pid in before_procs), reverse=True)[:5]
    machine = {"cpu": cpu_model(), "threads": args.threads, "torch": torch.__version__,
               "transformers": transformers.__version__,
               "date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"), "wall_s": round(wall, 1),
               "load": load_note(c0, cpu_counters(), wall),
               "busiest_other_processes_cpu_s": [(round(s, 1), cmd) for s, cmd in busiest],
               "kernel_ms_4096x4096": kernels}
    report(results, machine, trained, args.modes)
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"machine": machine, "results": results, "trained_agreement": trained}, fh, indent=1)


if __name__ == "__main__":
    main()
