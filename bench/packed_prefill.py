"""Packed prefill against one prompt at a time, in one process, interleaved (issue 24).

    python -m bench.packed_prefill               # ~1 min on 2 cores
    python -m bench.packed_prefill --isa avx2    # the same with every kernel held to AVX2

The 90m bench model (fp32, prepared as the engine prepares it) and 32 prompts of 8-48 tokens
(855 tokens, ``bench/inference.py``'s continuous-batching prompts), each asking for one token,
submitted together to two engines that differ only in ``max_prefill_tokens``: 1 (every prompt
prefills alone, the engine before packed prefill) and 512 (packs of up to 512 tokens, the
default). Reported: each engine's prefill seconds (``counters["prefill_s"]``) per round, and the
paired ratio alone / packed (> 1: packed faster), median and range; the engines alternate
which goes first.
"""

import argparse
import os
import statistics
import subprocess
import sys

import numpy as np
import torch

from bench.cpu_decode_peer import ISA_ENV



def run(rounds: int, threads: int) -> None:
    from bench.cpu_kernels import machine
    from bench.inference import SIZES
    from trainforge.infer.engine import Engine, EngineConfig
    from trainforge.infer.prepare import prepare_model
    from trainforge.infer.sampling import SamplingParams
    from trainforge.model import build_model

    torch.set_num_threads(threads)
    cfg = SIZES["90m"]
    model = prepare_model(build_model(cfg, seed=0).eval().requires_grad_(False))
    rng = np.random.default_rng(32)  # bench/inference.py's batching prompts at N = 32
    prompts = [rng.integers(0, cfg.vocab_size, int(rng.integers(8, 49))).tolist() for _ in range(32)]
    params = SamplingParams(max_new_tokens=1, temperature=0, ignore_eos=True)
    engines = {k: Engine(model, EngineConfig(max_batch_size=32, max_queue=32, max_context=80, max_prefill_tokens=k))
               for k in (1, 512)}
    for e in engines.values():
        e.generate(prompts, params)  # warm-up
    times: dict[int, list[float]] = {k: [] for k in engines}
    for r in range(rounds):
        for k in (1, 512) if r % 2 else (512, 1):
            engines[k].counters["prefill_s"] = 0.0
            engines[k].generate(prompts, params)
            times[k].append(engines[k].counters["prefill_s"])
    ratios = sorted(a / b for a, b in zip(times[1], times[512]))
    print(machine())
    print(f"threads {threads}, kernels {os.environ.get('TRAINFORGE_CPU_ISA') or 'native'}, "
          f"ATen {torch.backends.cpu.get_cpu_capability()}; {sum(map(len, prompts))} prompt tokens in 32 prompts")
    print(f"prefill s, median of {rounds}: alone {statistics.median(times[1]):.3f}, packed "
          f"{statistics.median(times[512]):.3f}; ratio alone / packed {statistics.median(ratios):.2f} "
          f"({ratios[0]:.2f}-{ratios[-1]:.2f}); load after {os.getloadavg()[0]:.2f}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rounds", type=int, default=8)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--isa", choices=sorted(ISA_ENV), default="native",
                   help="avx2 / avx512: a fresh process with every kernel held to that path (cpu_decode_peer.ISA_ENV)")
    p.add_argument("--_child", action="store_true", help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.isa != "native" and not a._child:  # the ISA settings are read at library load: a fresh process
        cmd = [sys.executable, "-m", "bench.packed_prefill", "--rounds", str(a.rounds), "--threads", str(a.threads),
               "--isa", a.isa, "--_child"]
        raise SystemExit(subprocess.run(cmd, env={**os.environ, **ISA_ENV[a.isa]}).returncode)
    run(a.rounds, a.threads)


if __name__ == "__main__":
    main()
