"""The chunked loss (``training.loss_chunk_tokens``): what it saves in peak memory and what
it costs in step time, against the plain loss, on trainforge's real ``Trainer``.

    python bench/chunked_loss.py                     # ~5 min on 2 idle cores
    python bench/chunked_loss.py --json out.json

1. Peak memory: ``small`` (vocab 8192) at ``--mem_batch`` x ``--mem_seq`` (8 x 1024), two
   optimizer steps, plain and chunked each in its own process (peak RSS never goes down
   within a process), in fp32 and bf16-mixed. Workers run with glibc's
   ``MALLOC_MMAP_THRESHOLD_`` at 1 MiB (``--mmap_threshold_kb``; 0 = glibc's default), so
   freed activations go back to the OS and peak RSS follows live tensors.
2. Step time: one process holds a plain and a chunked fp32 trainer (``small``,
   ``--tps_batch`` x ``--tps_seq``); samples of one step alternate P C P C ... P, pair
   ratio = time(C_i) / mean(time(P_i), time(P_i+1)); median with min and max, and the share
   of the machine other processes used per sample.

A benchmark, not a test: it prints the table and exits 0.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import precision as pb  # noqa: E402  (bench/precision.py: trainer factory, timing, memory worker)
import torch  # noqa: E402

from trainforge.data.prepare import default_data_dir  # noqa: E402


def memory(args, policy: str, chunk: int) -> dict:
    """bench/precision.py's memory worker (its own process) for this policy and chunk size."""
    worker = pb.build_parser().parse_args(["--threads", "1", "--loss_chunk_tokens", str(chunk), "--mem_flavor",
                                           "small", "--mem_batch", str(args.mem_batch), "--mem_seq",
                                           str(args.mem_seq), "--mmap_threshold_kb", str(args.mmap_threshold_kb)])
    worker.data = args.data
    return pb.run_worker("memory", policy, worker)


def step_time(args) -> dict:
    make = argparse.Namespace(data=args.data, threads=args.threads, loss_chunk_tokens=0)
    plain = pb.make_trainer(make, "fp32", "small", args.tps_batch, args.tps_seq)
    make.loss_chunk_tokens = args.chunk
    chunked = pb.make_trainer(make, "fp32", "small", args.tps_batch, args.tps_seq)
    p_s, c_s = pb.alternating_samples(plain, chunked, 1, args.pairs)
    ratios = [c_s[i][0] / ((p_s[i][0] + p_s[i + 1][0]) / 2) for i in range(args.pairs)]
    return {"ratios": ratios, "plain_s": [s for s, _ in p_s], "chunked_s": [s for s, _ in c_s],
            "others_share": [o for _, o in p_s + c_s]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--chunk", type=int, default=1024, help="training.loss_chunk_tokens of the chunked runs")
    p.add_argument("--mem_batch", type=int, default=8)
    p.add_argument("--mem_seq", type=int, default=1024)
    p.add_argument("--mmap_threshold_kb", type=int, default=1024)
    p.add_argument("--tps_batch", type=int, default=4)
    p.add_argument("--tps_seq", type=int, default=512)
    p.add_argument("--pairs", type=int, default=6)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--json", default=None)
    args = p.parse_args()
    args.data = default_data_dir(8192)
    out: dict = {"memory": {}, "args": {k: str(v) for k, v in vars(args).items()}}
    print(f"memory: small, batch {args.mem_batch} x seq {args.mem_seq}, 2 steps, MALLOC_MMAP_THRESHOLD_ "
          f"{args.mmap_threshold_kb or 'default'} KiB; chunk {args.chunk} tokens")
    for policy in ("fp32", "bf16-mixed"):
        rows = {chunk: memory(args, policy, chunk) for chunk in (0, args.chunk)}
        out["memory"][policy] = rows
        a, b = rows[0]["peak_bytes"] / 2**20, rows[args.chunk]["peak_bytes"] / 2**20
        print(f"  {policy:<11} peak RSS plain {a:7.0f} MiB, chunked {b:7.0f} MiB: {b - a:+6.0f} MiB "
              f"({b / a - 1:+.1%})", flush=True)
    fp, bf = out["memory"]["fp32"], out["memory"]["bf16-mixed"]
    for chunk in (0, args.chunk):
        print(f"  bf16-mixed vs fp32, {'chunked' if chunk else 'plain'} loss: "
              f"{bf[chunk]['peak_bytes'] / fp[chunk]['peak_bytes'] - 1:+.1%} peak RSS")
    torch.set_num_threads(args.threads)
    t = step_time(args)
    out["step_time"] = t
    r = t["ratios"]
    print(f"step time, fp32 small {args.tps_batch} x {args.tps_seq}, {args.threads} threads: chunked / plain "
          f"median {statistics.median(r):.3f} [{min(r):.3f}, {max(r):.3f}] over {len(r)} pairs; other processes "
          f"up to {max(t['others_share']):.0%} of the machine per sample")
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
