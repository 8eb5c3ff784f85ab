"""MoE decode speed through the engine: moe-tiny in fp32, with int8 and with int4 weights
(linears and routed experts; routers fp32), beside the dense tiny model of the same width.

    OMP_NUM_THREADS=1 python bench/moe_inference.py --threads 1

Seeded random weights, fused and packed by ``prepare_model``. Per variant: batch-1 decode
tok/s (wall clock, after the first token) and tokens per CPU second of the whole request
(prefill included; steadier on a shared machine at 1 thread), the generated tok/s of
8 concurrent requests, and the CPU ms of one decode step of 1 and of 8 rows (the runner's
step alone, no sampling or bookkeeping: the steadiest number on a loaded machine). The variants run interleaved round by round (same-run A/B), and each
number is the best round: on a shared machine the fastest run is the least disturbed.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time
from typing import Callable

import torch

from trainforge.infer.engine import Engine, EngineConfig
from trainforge.infer.prepare import describe_model, prepare_model
from trainforge.infer.quantize import quantize_model
from trainforge.infer.sampling import SamplingParams
from trainforge.model import FLAVORS, build_model


def variants(group_size: int) -> dict[str, torch.nn.Module]:
    out = {}
    for name, flavor, mode in (("tiny fp32 (dense)", "tiny", None), ("moe-tiny fp32", "moe-tiny", None),
                               ("moe-tiny int8", "moe-tiny", "int8"), ("moe-tiny int4", "moe-tiny", "int4")):
        model = build_model(dataclasses.replace(FLAVORS[flavor], max_seq_len=512), seed=0).eval()
        if mode:
            quantize_model(model, mode, group_size=group_size, pack=False)
        out[name] = prepare_model(model)
    return out


def batch1(model, prompt: list[int], n: int) -> tuple[float, float]:
    engine = Engine(model, EngineConfig(max_batch_size=1, max_context=len(prompt) + n))
    c0 = time.process_time()
    req = engine.generate([prompt], SamplingParams(max_new_tokens=n, temperature=0, ignore_eos=True))[0]
    return (n - 1) / (req.finished_s - req.first_token_s), n / (time.process_time() - c0)


def batched(model, prompts: list[list[int]], n: int) -> float:
    engine = Engine(model, EngineConfig(max_batch_size=len(prompts), max_context=max(map(len, prompts)) + n))
    t0 = time.perf_counter()
    engine.generate(prompts, SamplingParams(max_new_tokens=n, temperature=0, ignore_eos=True))
    return len(prompts) * n / (time.perf_counter() - t0)


def step_ms(model, rows: int, context: int = 64, calls: int = 10) -> Callable[[], float]:
    """A probe: CPU ms of one decode step of ``rows`` rows (each attending to ``context``
    slots of the padding block: the shape of a real step, not its values)."""
    engine = Engine(model, EngineConfig(max_batch_size=rows, max_context=context))
    r = engine.runner
    r.slots.zero_()
    r.gather.zero_()
    r.bias.zero_()

    @torch.no_grad()
    def probe() -> float:
        r.decode(rows, context)
        t0 = time.process_time()
        for _ in range(calls):
            r.decode(rows, context)
        return (time.process_time() - t0) / calls * 1e3
    return probe


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--new_tokens", type=int, default=64)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--group_size", type=int, default=64, help="int4 group (moe-tiny's dense ffn 704 = 11 x 64)")
    p.add_argument("--json", default=None)
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    models = variants(a.group_size)
    gen = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, 8192, (32,), generator=gen).tolist()
    prompts = [torch.randint(0, 8192, (8 + 4 * i,), generator=gen).tolist() for i in range(8)]
    res = {name: {"decode_tok_s": 0.0, "cpu_tok_s": 0.0, "batch8_tok_s": 0.0, "step1_cpu_ms": float("inf"),
                  "step8_cpu_ms": float("inf")} for name in models}
    probes = {name: {1: step_ms(m, 1), 8: step_ms(m, 8)} for name, m in models.items()}
    for name, m in models.items():  # warm-up
        batch1(m, prompt, 4)
    for _ in range(a.rounds):
        for name, m in models.items():
            wall, cpu = batch1(m, prompt, a.new_tokens)
            r = res[name]
            r["decode_tok_s"], r["cpu_tok_s"] = max(r["decode_tok_s"], wall), max(r["cpu_tok_s"], cpu)
            r["batch8_tok_s"] = max(r["batch8_tok_s"], batched(m, prompts, a.new_tokens // 2))
            for rows in (1, 8):
                for _ in range(3):
                    r[f"step{rows}_cpu_ms"] = min(r[f"step{rows}_cpu_ms"], probes[name][rows]())
    for name, m in models.items():
        res[name]["kernels"] = describe_model(m)["quant_kernels"]
        r = res[name]
        print(f"{name:18s} batch-1 decode {r['decode_tok_s']:6.1f} tok/s, {r['cpu_tok_s']:6.1f} tok/cpu-s | "
              f"8 requests {r['batch8_tok_s']:6.1f} tok/s | decode step cpu: 1 row {r['step1_cpu_ms']:5.2f} ms, "
              f"8 rows {r['step8_cpu_ms']:5.2f} ms | {r['kernels']}")
    meta = {"threads": a.threads, "new_tokens": a.new_tokens, "rounds": a.rounds, "torch": torch.__version__}
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"meta": meta, "results": res}, f, indent=1)


if __name__ == "__main__":
    main()
