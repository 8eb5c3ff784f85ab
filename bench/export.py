"""``trainforge export`` conversion time against the disk's own sequential write bandwidth,
measured in the same run, alternating.

    python -m bench.export --flavors small llama-1b --dtypes fp32 bf16 int4 --rounds 3

Per flavor, a random-weight model is saved once as a trainforge checkpoint. Then each round
runs, back to back: (A) a plain sequential write of as many bytes as the export writes
(``write`` + ``fsync`` of a 64 MiB buffer, the disk's ceiling), and (B) each export in a
fresh process (``export()`` timed inside it: load the checkpoint, convert, stream, fsync,
rename; its allocated memory, RssAnon sampled every 10 ms above what the interpreter and
imports hold, against the largest tensor; and the RSS peak, mapped checkpoint pages included). The result per export is GB/s written and its ratio to
(A)'s GB/s of the same round, median over rounds with the min-max spread. The checkpoint is
read from the page cache after its first read (the machine has RAM for it); that is the
usual case right after training, and the issue's target is the write side. A benchmark, not a
test: it prints a table (and ``--json``) and exits 0.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

_CHILD = r"""
import json, resource, sys, threading, time, torch
torch.set_num_threads(int(sys.argv[5]))
from trainforge.infer.hf_export import export
peak = [0]
def anon():  # RssAnon: memory the export allocated (the mapped checkpoint's pages are file-backed)
    for line in open("/proc/self/status"):
        if line.startswith("RssAnon:"):
            return int(line.split()[1]) * 1024
    return 0
base = anon()
def sample():
    while True:
        peak[0] = max(peak[0], anon())
        time.sleep(0.01)
threading.Thread(target=sample, daemon=True).start()
t0 = time.perf_counter()
q = None if sys.argv[4] == "none" else sys.argv[4]
r = export(sys.argv[1], sys.argv[2], dtype=sys.argv[3], quantize=q, group_size=128)
dt = time.perf_counter() - t0
peak[0] = max(peak[0], anon())
print(json.dumps({"s": dt, "bytes": sum(f.stat().st_size for f in r.files), "anon_peak": peak[0] - base,
                  "peak_rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}))
"""

def disk_write(path: Path, nbytes: int) -> float:
    """Seconds to write ``nbytes`` sequentially and fsync (what the export's files cost at best)."""
    buf = os.urandom(1 << 20) * 64  # 64 MiB, incompressible
    t0 = time.perf_counter()
    with open(path, "wb") as f:
        left = nbytes
        while left > 0:
            n = min(left, len(buf))
            f.write(memoryview(buf)[:n])
            left -= n
        f.flush()
        os.fsync(f.fileno())
    dt = time.perf_counter() - t0
    path.unlink()
    return dt


def cpu_model() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=10).stdout
    except OSError:
        return "unknown"
    fields = dict(line.split(":", 1) for line in out.splitlines() if ":" in line)
    flags = set(fields.get("Flags", "").split())
    simd = [f for f in ("avx2", "avx512f", "avx512_bf16", "amx_bf16") if f in flags]
    return f"{fields.get('Model name', '?').strip()}, {os.cpu_count()} CPUs, flags {' '.join(simd)}"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--flavors", nargs="+", default=["small", "llama-1b"])
    p.add_argument("--dtypes", nargs="+", default=["fp32", "bf16", "int4"],
                   help="fp32, bf16, fp16 (float exports) or int8, int4 (compressed-tensors, bf16 rest)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--dir", default=None, help="scratch directory on the disk to measure (default: a temp dir)")
    p.add_argument("--json", default=None)
    a = p.parse_args()

    import torch

    from trainforge.model import FLAVORS, build_model
    from trainforge.train import checkpoint as ckpt

    torch.set_num_threads(a.threads)
    root = Path(tempfile.mkdtemp(prefix="tf-bench-export-", dir=a.dir))
    results = []
    print(f"# {cpu_model()}; scratch {root}; load before {os.getloadavg()[0]:.1f}")
    try:
        for flavor in a.flavors:
            cfg = dataclasses.replace(FLAVORS[flavor], max_seq_len=2048)
            t0 = time.perf_counter()
            model = build_model(cfg, seed=0)
            ck = ckpt.save_checkpoint(root / flavor / "checkpoints", 1, model, {}, {}, dataclasses.asdict(cfg), None,
                                      keep_last=1)
            del model
            print(f"# {flavor}: {cfg.num_params() / 1e9:.2f}B params, checkpoint in {time.perf_counter() - t0:.0f} s")
            rows: dict[str, list[dict]] = {d: [] for d in a.dtypes}
            for r in range(a.rounds):
                for d in a.dtypes:
                    quant = d if d in ("int8", "int4") else "none"
                    dtype = "bf16" if quant != "none" else d
                    out = root / flavor / f"out-{d}"
                    cmd = [sys.executable, "-c", _CHILD, str(ck), str(out), dtype, quant, str(a.threads)]
                    proc = subprocess.run(cmd, capture_output=True, text=True)
                    if proc.returncode:
                        raise SystemExit(f"export {flavor} {d} failed:\n{proc.stderr[-3000:]}")
                    e = json.loads(proc.stdout.strip().splitlines()[-1])
                    shutil.rmtree(out)
                    disk_s = disk_write(root / "probe.bin", e["bytes"])
                    e.update(disk_s=disk_s, gbps=e["bytes"] / e["s"] / 1e9, disk_gbps=e["bytes"] / disk_s / 1e9)
                    e["ratio"] = e["gbps"] / e["disk_gbps"]
                    rows[d].append(e)
            for d, es in rows.items():
                ratios = [e["ratio"] for e in es]
                res = {"flavor": flavor, "export": d, "params": cfg.num_params(), "bytes": es[0]["bytes"],
                       "export_s": statistics.median(e["s"] for e in es),
                       "export_gbps": statistics.median(e["gbps"] for e in es),
                       "disk_gbps": statistics.median(e["disk_gbps"] for e in es),
                       "ratio": statistics.median(ratios), "ratio_min": min(ratios), "ratio_max": max(ratios),
                       "peak_rss_gb": max(e["peak_rss"] for e in es) / 1e9,
                       "anon_peak_gb": max(e["anon_peak"] for e in es) / 1e9,
                       "largest_tensor_gb": cfg.vocab_size * cfg.dim * 4 / 1e9}
                results.append(res)
                print(f"{flavor:9s} {d:5s} {res['bytes'] / 1e9:6.2f} GB written in {res['export_s']:6.1f} s = "
                      f"{res['export_gbps']:.2f} GB/s; disk alone {res['disk_gbps']:.2f} GB/s; ratio "
                      f"{res['ratio']:.2f} [{res['ratio_min']:.2f}, {res['ratio_max']:.2f}]; allocated peak "
                      f"{res['anon_peak_gb']:.2f} GB (largest fp32 tensor {res['largest_tensor_gb']:.2f} GB), "
                      f"RSS peak {res['peak_rss_gb']:.2f} GB incl. mapped pages")
            shutil.rmtree(root / flavor)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    print(f"# load after {os.getloadavg()[0]:.1f}")
    if a.json:
        Path(a.json).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
