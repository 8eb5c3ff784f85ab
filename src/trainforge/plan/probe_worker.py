"""torchrun worker of ``probe.measured_cluster``: measures this machine as the planner sees a
CPU cluster (one process with one thread per "GPU") and writes the raw samples as JSON.
Not a command on its own; ``probe.py`` launches it (and fits and caches the result):

    python -m torch.distributed.run --standalone --nproc_per_node=N -m trainforge.plan.probe_worker --out F

Every figure is taken with all N processes running at once, as a training job's ranks run:
on a machine with fewer cores than processes they share the cores, and the rate one rank
gets is the machine's aggregate over N, not what a lone process gets (that is measured too,
by rank 0 alone, and recorded beside it).

- compute: every rank multiplies square matrices for a fixed window; the FLOPs all ranks
  finished in the window over (window x N) is the per-process rate. Best of a few windows
  (a burst of someone else's load spoils some, not all), as ``train/mfu.py`` does.
- memory bandwidth: the same with a tensor copy far larger than the last-level cache
  (bytes read + written).
- collectives: for each group size k in 2..N the ranks split into N // k groups of k (the
  rest wait), every group runs the op at once, as a layout's tp or dp groups do; each size is
  timed a few times between world barriers and the slowest rank's time counts (a collective
  ends when its last rank does). The median over repeats is the sample.
- synchronisation between compute: for each group size k, the same groups alternate a
  compute chunk (matmuls of ~``--sync_chunk_ms``) with a 4-byte all-reduce, against the
  chunks alone, interleaved; the extra time per round (slowest rank, median over repeats) is
  what one blocking collective costs a rank that was computing just before, as a training
  step's dozens of collectives do. Back-to-back collectives after a barrier (above) miss it:
  there every rank arrives at once and no core has gone idle (on this 2-vCPU KVM guest a
  4-byte all-reduce costs ~0.1 ms back to back and ~0.9 ms between 3 ms chunks).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch
import torch.distributed as dist

OPS = ("all_reduce", "all_gather", "reduce_scatter", "send_recv")
DEFAULT_SIZES = (4096, 65536, 1 << 20, 4 << 20, 16 << 20)  # bytes, 4 KB .. 16 MB


def _windowed_rate(work, units_per_call: float, window_s: float, windows: int) -> float:
    """Per-process rate of ``work()`` (``units_per_call`` / s) with all ranks running it at
    once: the sum of the ranks' rates over the world size, best of ``windows`` windows."""
    world = dist.get_world_size()
    best_total = 0.0
    for _ in range(windows):
        dist.barrier()
        calls, t0 = 0, time.perf_counter()
        deadline = t0 + window_s
        while time.perf_counter() < deadline:
            work()
            calls += 1
        # The last call may overrun the window: count time to its end, not the deadline.
        done = torch.tensor([calls * units_per_call, time.perf_counter() - t0], dtype=torch.float64)
        parts = [torch.zeros_like(done) for _ in range(world)]
        dist.all_gather(parts, done)
        total = sum(float(p[0] / p[1]) for p in parts) / world
        best_total = max(best_total, total)
    return best_total


def _solo_rate(work, units_per_call: float, window_s: float, windows: int) -> float:
    """Best rate of ``work()`` on rank 0 while the others wait at a barrier (idle)."""
    best = 0.0
    if dist.get_rank() == 0:
        for _ in range(windows):
            calls, t0 = 0, time.perf_counter()
            while time.perf_counter() < t0 + window_s:
                work()
                calls += 1
            best = max(best, calls * units_per_call / (time.perf_counter() - t0))
    dist.barrier()
    return best


def compute_samples(matmul_n: int, bf16: bool, window_s: float, windows: int) -> dict:
    out = {}
    dtypes = {"fp32": torch.float32, **({"bf16": torch.bfloat16} if bf16 else {})}
    for name, dtype in dtypes.items():
        a = torch.randn(matmul_n, matmul_n).to(dtype)
        b = torch.randn(matmul_n, matmul_n).to(dtype)
        a @ b  # warm-up: oneDNN builds its kernel on first use
        work = lambda: a @ b  # noqa: E731
        flops = 2.0 * matmul_n**3
        out[f"matmul_{name}_flops_per_s"] = _windowed_rate(work, flops, window_s, windows)
        out[f"matmul_{name}_solo_flops_per_s"] = _solo_rate(work, flops, window_s, windows)
    return out


def memory_samples(copy_mb: int, window_s: float, windows: int) -> dict:
    # (copy_mb MB,) float32 source and destination: read + write = 2 x copy_mb MB per call.
    src = torch.ones(copy_mb * (1 << 20) // 4)
    dst = torch.empty_like(src)
    dst.copy_(src)  # touch the pages first: first-touch page faults are not bandwidth
    work = lambda: dst.copy_(src)  # noqa: E731
    moved = 2.0 * src.numel() * 4
    return {"memory_bytes_per_s": _windowed_rate(work, moved, window_s, windows),
            "memory_solo_bytes_per_s": _solo_rate(work, moved, window_s, windows)}


def _run_op(op: str, group, members: list[int], rank: int, bufs: dict) -> None:
    k = len(members)
    if op == "all_reduce":
        dist.all_reduce(bufs["full"], group=group)
    elif op == "all_gather":  # nbytes = the gathered tensor (each rank contributes nbytes / k)
        dist.all_gather_into_tensor(bufs["full"], bufs["shard"], group=group)
    elif op == "reduce_scatter":  # nbytes = the tensor before scattering
        dist.reduce_scatter_tensor(bufs["shard"], bufs["full"], group=group)
    elif op == "send_recv":  # a ring exchange: each rank sends nbytes to the next, as pipeline stages do
        i = members.index(rank)
        reqs = [dist.isend(bufs["full"], members[(i + 1) % k], group=group),
                dist.irecv(bufs["recv"], members[(i - 1) % k], group=group)]
        for r in reqs:
            r.wait()
    else:
        raise AssertionError(op)


def split_groups() -> dict[int, tuple[list[int], object] | None]:
    """For k = 2..world: world // k groups of k consecutive ranks (the rest wait), as a layout's
    tp or dp groups run at once; k -> (this rank's group's members, its process group), or
    None where this rank is in none. Every rank creates every group, in order."""
    rank, world = dist.get_rank(), dist.get_world_size()
    out = {}
    for k in range(2, world + 1):
        groups = [list(range(g * k, (g + 1) * k)) for g in range(world // k)]
        handles = [dist.new_group(g) for g in groups]
        out[k] = next(((g, h) for g, h in zip(groups, handles) if rank in g), None)
    return out


def collective_samples(sizes: list[int], repeats: int, groups: dict) -> dict:
    """{op: {k: [[nbytes, median seconds], ...]}} for k = 2..world on ``split_groups()``."""
    rank = dist.get_rank()
    out: dict = {op: {} for op in OPS}
    for k, mine in groups.items():
        for op in OPS:
            rows = []
            for nbytes in sizes:
                numel = max(k, nbytes // 4 // k * k)  # divisible by k for the sharded ops
                bufs = {"full": torch.ones(numel), "shard": torch.ones(numel // k), "recv": torch.empty(numel)}
                times = []
                for i in range(repeats + 2):  # two warm-ups (connection set-up, allocation)
                    dist.barrier()
                    t = 0.0
                    if mine is not None:
                        t0 = time.perf_counter()
                        _run_op(op, mine[1], mine[0], rank, bufs)
                        t = time.perf_counter() - t0
                    slowest = torch.tensor([t], dtype=torch.float64)
                    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
                    if i >= 2:
                        times.append(float(slowest))
                rows.append([numel * 4, statistics.median(times)])
            out[op][str(k)] = rows
    return out


def sync_samples(chunk_ms: float, rounds: int, repeats: int, groups: dict) -> dict:
    """{"between_compute": {k: s}, "back_to_back": {k: s}}: the median seconds a 4-byte
    all-reduce adds per round of compute + collective, and what it takes in rounds of nothing
    else, on world // k groups of k at once (ranks outside a group compute only)."""
    a, b = torch.randn(256, 256), torch.randn(256, 256)
    t0 = time.perf_counter()
    for _ in range(50):
        a @ b
    reps = max(1, round(chunk_ms / 1e3 / ((time.perf_counter() - t0) / 50)))
    flag = torch.zeros(1)
    out: dict = {"between_compute": {}, "back_to_back": {}}
    for k, member in groups.items():
        mine = member[1] if member is not None else None
        extra, alone = [], []
        for i in range(repeats + 1):  # the first round of each warms up
            per_round = {}
            for chunk, with_sync in ((reps, False), (reps, True), (0, True)):
                dist.barrier()
                t0 = time.perf_counter()
                for _ in range(rounds):
                    for _ in range(chunk):
                        a @ b
                    if with_sync and mine is not None:
                        dist.all_reduce(flag, group=mine)
                slowest = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
                dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
                per_round[chunk, with_sync] = float(slowest) / rounds
            if i:
                extra.append(per_round[reps, True] - per_round[reps, False])
                alone.append(per_round[0, True])
        out["between_compute"][str(k)] = max(0.0, statistics.median(extra))
        out["back_to_back"][str(k)] = statistics.median(alone)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, help="JSON file rank 0 writes")
    ap.add_argument("--sizes", default=",".join(map(str, DEFAULT_SIZES)), help="message sizes in bytes")
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--matmul_n", type=int, default=1024)
    ap.add_argument("--copy_mb", type=int, default=256, help="copy size per process; > last-level cache")
    ap.add_argument("--window_s", type=float, default=0.3)
    ap.add_argument("--windows", type=int, default=3)
    ap.add_argument("--bf16", action="store_true", help="also time bf16 matmuls")
    ap.add_argument("--sync_chunk_ms", type=float, default=3.0, help="compute between synchronisations")
    ap.add_argument("--sync_rounds", type=int, default=20)
    a = ap.parse_args()
    torch.set_num_threads(1)  # one "GPU" = one process with one thread
    dist.init_process_group("gloo")
    t0 = time.perf_counter()
    result = {"world_size": dist.get_world_size(), "threads": torch.get_num_threads(),
              "torch": torch.__version__, "cpu_count": os.cpu_count()}
    result.update(compute_samples(a.matmul_n, a.bf16, a.window_s, a.windows))
    result["matmul_n"] = a.matmul_n
    result.update(memory_samples(a.copy_mb, a.window_s, a.windows))
    groups = split_groups()
    result["collectives"] = collective_samples([int(s) for s in a.sizes.split(",")], a.repeats, groups)
    result["sync_s"] = sync_samples(a.sync_chunk_ms, a.sync_rounds, a.repeats, groups)
    result["probe_s"] = time.perf_counter() - t0
    if dist.get_rank() == 0:
        with open(a.out, "w") as fh:
            json.dump(result, fh)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
