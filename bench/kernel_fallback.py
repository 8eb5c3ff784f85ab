"""What a machine without a C++ compiler pays: decode speed and peak memory of each weight format
with the C++ CPU kernels against the fallback trainforge runs on when they cannot be built.

    python -m bench.kernel_fallback                    # 5 rounds, 2 threads, every format: ~6 min on 2 cores
    python -m bench.kernel_fallback --rounds 3 --formats f32 q4_0 --threads 1

The model is ``bench/inference.py``'s 90m one (``SIZES["90m"]``, random weights, seed 0), written
once as a Hugging Face directory into ``--work`` (``cpu_decode_peer._write_hf_dir``); each format
is ``trainforge generate --quantize FORMAT`` of it. The two sides are the same command, in a fresh
process each:

- **kernels**: the environment as it is (the kernels built by ``make install``);
- **fallback**: ``PATH`` holding no C++ compiler and an empty kernel cache of its own, exactly what
  a machine without ``g++`` runs (its first process records the failure; the rest find it).

Each sample decodes ``--tokens`` tokens from a 1-token prompt (``--stats``: decode_steps /
decode_s) under GNU time (peak RSS). A round runs every format, kernels and fallback back to back,
the order swapped every round; the ratios (kernels / fallback speed, fallback / kernels RSS) are
paired within a round and summarised as the median with the min-max. The 1-min load average is
printed before and after each round.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.cpu_decode_peer import _write_hf_dir, parse_stats, run_process  # noqa: E402

FORMATS = ["f32", "int8", "int4", "q8_0", "q4_0"]


def sample(hf: Path, fmt: str, tokens: int, env: dict[str, str]) -> dict:
    cmd = [sys.executable, "-m", "trainforge", "generate", "--checkpoint", str(hf), "--quantize",
           "none" if fmt == "f32" else fmt, "--prompt_ids", "5", "--max_new_tokens", str(tokens + 1),
           "--temperature", "0", "--ignore_eos", "--print_ids", "--stats"]
    proc = run_process(cmd, env=env)
    stats = parse_stats(proc.stderr)
    return {"tok_s": stats["decode_steps"] / stats["decode_s"], "rss": proc.peak_rss}


def spread(xs: list[float]) -> str:
    return f"{statistics.median(xs):.2f} ({min(xs):.2f}-{max(xs):.2f})"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--formats", nargs="+", default=FORMATS, choices=FORMATS)
    p.add_argument("--work", default=str(Path.home() / ".cache" / "trainforge" / "kernel_fallback"))
    p.add_argument("--json", default=None)
    a = p.parse_args()
    work = Path(a.work)
    hf = work / "hf"
    if not (hf / "config.json").is_file():
        work.mkdir(parents=True, exist_ok=True)
        _write_hf_dir(work, hf)
    base = {**os.environ, "OMP_NUM_THREADS": str(a.threads)}
    scratch = Path(tempfile.mkdtemp(prefix="kernel_fallback-"))
    (scratch / "bin").mkdir()
    envs = {"kernels": base,
            "fallback": {**{k: v for k, v in base.items() if k != "CXX"}, "PATH": str(scratch / "bin"),
                         "TRAINFORGE_KERNEL_CACHE": str(scratch / "kernels")}}
    got = {f: {"kernels": [], "fallback": []} for f in a.formats}
    for r in range(a.rounds):
        print(f"round {r + 1}/{a.rounds}: load {os.getloadavg()[0]:.2f}", flush=True)
        for fmt in a.formats:
            order = ["kernels", "fallback"] if r % 2 == 0 else ["fallback", "kernels"]
            for side in order:
                got[fmt][side].append(sample(hf, fmt, a.tokens, envs[side]))
        print(f"  done: load {os.getloadavg()[0]:.2f}", flush=True)
    rows = []
    print(f"\n{a.threads} threads, {a.tokens} decode tokens, {a.rounds} rounds, {time.strftime('%Y-%m-%d %H:%M')}")
    print(f"{'format':<6} {'kernels tok/s':>14} {'fallback tok/s':>15} {'speed kernels/fallback':>24} "
          f"{'RSS MiB k / fb':>16} {'RSS fallback/kernels':>22}")
    for fmt in a.formats:
        k, fb = got[fmt]["kernels"], got[fmt]["fallback"]
        speed = [x["tok_s"] / y["tok_s"] for x, y in zip(k, fb)]
        rss = [y["rss"] / x["rss"] for x, y in zip(k, fb)]
        row = {"format": fmt, "kernels_tok_s": statistics.median(x["tok_s"] for x in k),
               "fallback_tok_s": statistics.median(y["tok_s"] for y in fb), "speed_ratio": speed,
               "kernels_rss_mib": statistics.median(x["rss"] for x in k) / 2**20,
               "fallback_rss_mib": statistics.median(y["rss"] for y in fb) / 2**20, "rss_ratio": rss}
        rows.append(row)
        print(f"{fmt:<6} {row['kernels_tok_s']:>14.1f} {row['fallback_tok_s']:>15.1f} {spread(speed):>24} "
              f"{row['kernels_rss_mib']:>7.0f} / {row['fallback_rss_mib']:<6.0f} {spread(rss):>22}")
    if a.json:
        Path(a.json).write_text(json.dumps({"threads": a.threads, "tokens": a.tokens, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
