"""Op-level speed of the trainforge CPU kernels against the kernels they would replace, in one
process, interleaved.

    python -m bench.cpu_kernels            # ~4 min on 2 cores
    python -m bench.cpu_kernels --quick    # ~2 min: fewer samples

Pairs, each on the same random weights (seeded), at 1 and 2 intra-op threads, M = 1 (decode)
and M = 512 (prefill), on the linear shapes of the 90m bench model (dim 768, ffn 2048, kv dim
256, vocab 8192) and 4096x4096:

- ``F.linear`` fp32 (MKL / oneDNN)                  vs ``trainforge_cpu.f32_linear``
- fbgemm dynamic int8 (per-channel prepacked)       vs ``trainforge_cpu.q8_0_linear``
- ``_weight_int4pack_mm_for_cpu`` (bf16 x, g=32)    vs ``trainforge_cpu.q4_0_linear``

Then the weight stream of a decode step, fp32 ``f32_linear_into`` over 32 weights of 2048 x 768
(192 MiB, past any L3), M = 1: weights 16-byte aligned (as numpy copies and file maps leave them)
vs 64-byte aligned (``torch.empty``), and 4 KiB pages (``torch.empty``) vs the huge-page weight
arena (``infer/weight_arena.py``).

Then the prompt GEMM (M = 512, fp32, the 90m shapes): ``F.linear`` (MKL) vs oneDNN's
``mkldnn._linear_pointwise`` on the same plain weight, the path ``infer/cpu_linear.GemvLinear``
takes for prompts on AVX-512 CPUs. And the decode step of a random 90m model (fp32 and q4_0,
prepared as the engine prepares it, batch 1 over 80 context slots): its bound calls run one by
one from Python vs the same calls as one C++ call program (``infer/cpu_kernels/call_program.py``).

Then the small GEMM of a batched decode step (fp32, M = 9, 16, 32, 64): every linear of the 90m
model (12 layers of qkv 1280 x 768, wo 768 x 768, gate-up 4096 x 768, down 768 x 2048, and the
8192 x 768 output: 330 MiB, streamed from memory as a step streams it), oneDNN's
``mkldnn._linear_pointwise`` (the path before) vs ``trainforge_cpu.f32_gemm_into``
(``cpu_kernels/small_gemm.cpp``), the path ``GemvLinear`` takes for 9-64 rows on AMD CPUs.

The baselines come from the engine's own kernels (``Int8Linear`` / ``Int4Linear``
``build_kernel``). Each sample times baseline then ours back to back (order alternated per
sample); the ratio baseline / ours (> 1: ours faster) is paired within the sample and
summarised by median and p10-p90 over samples. Measured sections hold /tmp/cpu.lock (flock),
so do not wrap this script in flock.
"""

import argparse
import datetime
import os
import subprocess
import time

import torch
import torch.nn.functional as F

from bench.advise import locked
from trainforge.infer.cpu_kernels import build, formats
from trainforge.infer.quantize.int4 import Int4Linear
from trainforge.infer.quantize.int8 import Int8Linear

SECTIONS = ["ops", "stream", "prompt_gemm", "step", "small_gemm"]
SHAPES = [(768, 768), (256, 768), (2048, 768), (768, 2048), (8192, 768), (4096, 4096)]


def machine() -> str:
    lscpu = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    model = next((line.split(":", 1)[1].strip() for line in lscpu.splitlines()
                  if line.startswith("Model name")), "?")
    flags = sorted({f for f in lscpu.split() if f.startswith(("avx2", "avx512", "fma", "f16c"))})
    return (f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M UTC}  CPU {model}  "
            f"flags {' '.join(flags)}  load {os.getloadavg()[0]:.2f}  torch {torch.__version__}")


def pairs(ops, n: int, k: int, m: int):
    gen = torch.Generator().manual_seed(n * 7 + k)
    w = torch.randn(n, k, generator=gen) * 0.02
    x = torch.randn(m, k, generator=gen)
    q8, d8 = formats.pack_x8(*formats.quantize_q8_0(w))
    q4, d4 = formats.pack_x8(*formats.quantize_q4_0(w))
    fbgemm = Int8Linear.quantize(w).build_kernel("fbgemm")
    int4 = Int4Linear.quantize(w, group_size=32).build_kernel("int4pack_cpu")
    yield "fp32", lambda: F.linear(x, w), lambda: ops.f32_linear(x, w)
    yield "q8_0", lambda: fbgemm(x), lambda: ops.q8_0_linear(x, q8, d8, n)
    yield "q4_0", lambda: int4(x), lambda: ops.q4_0_linear(x, q4, d4, n)


def stream_pairs(ops, count: int = 32, n: int = 2048, k: int = 768):
    """(name, baseline, ours) passes of ``f32_linear_into`` over ``count`` weights (module docstring)."""
    from trainforge.infer.weight_arena import place_weight

    gen = torch.Generator().manual_seed(5)
    src = [torch.randn(n, k, generator=gen) for _ in range(count)]
    x, out = torch.randn(1, k, generator=gen), torch.empty(1, n)

    def unaligned(w: torch.Tensor) -> torch.Tensor:
        buf = torch.empty(w.numel() + 4)  # 64-byte aligned: 4 floats in is 16
        buf[4:].copy_(w.reshape(-1))
        return buf[4:].view(n, k)

    def stream(ws):
        def run():
            for w in ws:
                ops.f32_linear_into(x, w, out)
        return run

    # Each pair's two sets are allocated alternately, weight by weight: on the KVM guest measured,
    # memory allocated later streamed up to 35% faster than the same layout allocated first
    # (host-side page backing), which an A-then-B allocation would count as the layout's gain.
    for name, make_base, make_ours in (("align", unaligned, torch.clone), ("thp", torch.clone, place_weight)):
        base, ours = [], []
        for w in src:
            base.append(make_base(w))
            ours.append(make_ours(w))
        yield name, stream(base), stream(ours)
        del base, ours


def prompt_gemm_pairs(m: int = 512):
    """(shape, MKL, oneDNN) products of M x K activations by each 90m weight (module docstring)."""
    for n, k in SHAPES[:5]:
        gen = torch.Generator().manual_seed(n + k)
        w, x = torch.randn(n, k, generator=gen) * 0.02, torch.randn(m, k, generator=gen)
        yield (n, k), (lambda x=x, w=w: F.linear(x, w)), \
            (lambda x=x, w=w: torch.ops.mkldnn._linear_pointwise(x, w, None, "none", [], ""))


def small_gemm_pairs(ops, ms=(9, 16, 32, 64)):
    """(M, oneDNN, small GEMM) over all the 90m model's linears at M rows (module docstring)."""
    shapes = [(1280, 768), (768, 768), (4096, 768), (768, 2048)] * 12 + [(8192, 768)]
    gen = torch.Generator().manual_seed(0)
    ws = [torch.randn(n, k, generator=gen) * 0.02 for n, k in shapes]
    for m in ms:
        xs = {k: torch.randn(m, k, generator=gen) for k in (768, 2048)}
        outs = [torch.empty(m, n) for n, _ in shapes]

        def onednn(xs=xs):
            for w in ws:
                torch.ops.mkldnn._linear_pointwise(xs[w.shape[1]], w, None, "none", [], "")

        def ours(xs=xs, outs=outs):
            for w, o in zip(ws, outs):
                ops.f32_gemm_into(xs[w.shape[1]], w, o)
        yield m, onednn, ours


def step_pairs(context: int = 80):
    """(mode, Python loop, C++ program) over one decode step of a random 90m model (module docstring)."""
    from bench.inference import SIZES
    from trainforge.infer.engine import Engine, EngineConfig
    from trainforge.infer.prepare import prepare_model
    from trainforge.infer.quantize import quantize_model
    from trainforge.model import build_model

    for mode in ("fp32", "q4_0"):
        model = build_model(SIZES["90m"], seed=0).eval().requires_grad_(False)
        if mode != "fp32":
            quantize_model(model, mode, pack=False)
        prepare_model(model)
        dec = Engine(model, EngineConfig(max_batch_size=1, max_queue=1, max_context=256)).runner.decoder
        dec._context[0] = context
        calls = dec._bind(1, context)
        program = dec.ws.kernels.compile(calls)

        def run(cs):
            def f():
                for c in cs:
                    c()
            return f
        yield f"{mode} ({len(calls)} calls -> {len(program)})", run(calls), run(program)
        del model, dec, calls, program


def measure(base, ours, samples: int, budget_s: float) -> tuple[float, float, float, float]:
    for _ in range(3):
        base(), ours()
    tb, ratios = [], []
    t_end = time.perf_counter() + budget_s
    for i in range(samples):
        fns = (base, ours) if i % 2 == 0 else (ours, base)
        ts = []
        for f in fns:
            t0 = time.perf_counter()
            f()
            ts.append(time.perf_counter() - t0)
        b, o = ts if i % 2 == 0 else ts[::-1]
        tb.append(b)
        ratios.append(b / o)
        if time.perf_counter() > t_end and i >= 8:
            break
    q = torch.tensor(ratios).quantile(torch.tensor([0.5, 0.1, 0.9])).tolist()
    return torch.tensor(tb).median().item() * 1e3, *q


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="fewer samples (~1 min)")
    p.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    p.add_argument("--m", type=int, nargs="+", default=[1, 512])
    p.add_argument("--sections", nargs="+", choices=SECTIONS, default=SECTIONS, help="which comparisons to run")
    args = p.parse_args()
    ops = build.load_kernels()
    if ops is None:
        raise SystemExit("trainforge CPU kernels did not build (see the warning); nothing to compare")
    samples, budget = (15, 0.3) if args.quick else (51, 1.2)
    print(machine())
    print(f"ours: isa {ops.isa()}; ratio = baseline ms / ours ms (> 1: ours faster), "
          "median [p10-p90] over paired samples")
    print(f"{'thr':>3} {'M':>4} {'shape (N,K)':>12} {'pair':>5} {'base ms':>8} {'ratio':>6} {'p10-p90':>11}")
    for threads in args.threads if "ops" in args.sections else []:
        torch.set_num_threads(threads)
        for m in args.m:
            for n, k in SHAPES:
                for name, base, ours in pairs(ops, n, k, m):
                    with locked("/tmp/cpu.lock"):
                        ms, med, p10, p90 = measure(base, ours, samples, budget)
                    print(f"{threads:>3} {m:>4} {str((n, k)):>12} {name:>5} {ms:8.3f} {med:6.2f} "
                          f"{p10:5.2f}-{p90:<5.2f}", flush=True)
    print(f"\nweight stream, M = 1, 32 x (2048, 768) fp32 = 192 MiB per pass: align = 16-byte / 64-byte "
          "aligned, thp = 4 KiB pages / huge-page arena; GB/s of ours")
    for threads in args.threads if "stream" in args.sections else []:
        torch.set_num_threads(threads)
        for name, base, ours in stream_pairs(ops):
            with locked("/tmp/cpu.lock"):
                ms, med, p10, p90 = measure(base, ours, samples, budget)
            print(f"{threads:>3} {name:>5} base {ms:7.2f} ms  ratio {med:5.2f} {p10:5.2f}-{p90:<5.2f}  "
                  f"ours {32 * 2048 * 768 * 4 / (ms / med * 1e-3) / 1e9:5.1f} GB/s", flush=True)
    print("\nprompt GEMM, fp32, M = 512: base = F.linear (MKL), ours = oneDNN on the same weight")
    for threads in args.threads if "prompt_gemm" in args.sections else []:
        torch.set_num_threads(threads)
        for shape, base, ours in prompt_gemm_pairs():
            with locked("/tmp/cpu.lock"):
                ms, med, p10, p90 = measure(base, ours, samples, budget)
            print(f"{threads:>3} {str(shape):>12} base {ms:7.3f} ms  ratio {med:5.2f} {p10:5.2f}-{p90:<5.2f}", flush=True)
    print("\ndecode step, random 90m model, batch 1, 80 slots: base = the bound calls from Python, ours = one "
          "C++ call program")
    for threads in args.threads if "step" in args.sections else []:
        torch.set_num_threads(threads)
        for name, base, ours in step_pairs():
            with torch.no_grad(), locked("/tmp/cpu.lock"):
                ms, med, p10, p90 = measure(base, ours, samples, budget)
            print(f"{threads:>3} {name:>24} base {ms:7.3f} ms  ratio {med:5.2f} {p10:5.2f}-{p90:<5.2f}", flush=True)
    print("\nsmall GEMM, fp32, all 90m linears (330 MiB): base = oneDNN, ours = f32_gemm_into")
    for threads in args.threads if "small_gemm" in args.sections else []:
        torch.set_num_threads(threads)
        for m, base, ours in small_gemm_pairs(ops):
            with locked("/tmp/cpu.lock"):
                ms, med, p10, p90 = measure(base, ours, samples // 3, budget * 3)
            print(f"{threads:>3} M={m:>3} base {ms:7.2f} ms  ratio {med:5.2f} {p10:5.2f}-{p90:<5.2f}", flush=True)
    print(f"load after: {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
