"""Where one training step's time goes on each rank of a layout: the collectives it issues
(count and time, by kind), the time blocked waiting on them, and the matmuls, from one step
profiled with ``torch.profiler`` (a profiled CPU step runs ~10% slower than a plain one: the
counts are exact, the times indicative). This is how the planner's terms for a measured
machine were found (``plan/comm_model.py``: gloo's collectives by op, FSDP2's per unit; the
Partial-gradient re-reductions that ``parallel/partial_grads.py`` removed).

    python bench/step_profile.py --nproc 2 -- --parallel.tp 2
    python bench/step_profile.py --nproc 4 --batch_size 2 -- --parallel.dp_shard 4
    python bench/step_profile.py --nproc 2 --json out.json -- --parallel.pp 2 --parallel.microbatches 4

Arguments after ``--`` go to ``trainforge train`` (the layout). Workload: ``tiny``, seq_len 128,
fp32, one thread per process, the given per-rank batch; the profiled step is the 6th.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

WORKER = Path(__file__).parent / "_step_profile_worker.py"
# Event name prefixes reported, in this order: what was sent (the gloo work items, by op), what
# the rank blocked on, and the matmuls.
KINDS = (("gloo:", "gloo work (collectives run)"), ("c10d::", "c10d calls (issued)"),
         ("_c10d_functional::wait_tensor", "waits on functional collectives"), ("aten::mm", "matmuls"))


def run(nproc: int, batch_size: int, train_args: list[str], steps: int = 7, step: int = 6) -> list[dict]:
    with tempfile.TemporaryDirectory(prefix="step-profile-") as tmp:
        out = Path(tmp) / "profile"
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
               str(WORKER), "train", "--run_dir", str(Path(tmp) / "run"), "--model.flavor", "tiny",
               "--training.seq_len", "128", "--training.batch_size", str(batch_size), "--training.steps",
               str(steps), "--training.log_interval", "1", "--training.val_interval", "0",
               "--training.val_batches", "1", "--training.threads", "1", "--checkpoint.interval", "0",
               "--sample.max_new_tokens", "0", "--monitor.enabled", "false", *train_args]
        env = {**os.environ, "OMP_NUM_THREADS": "1", "STEP_PROFILE_OUT": str(out), "STEP_PROFILE_STEP": str(step)}
        r = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)
        if r.returncode != 0:
            raise SystemExit(f"training failed (rc {r.returncode}):\n{r.stderr[-3000:]}")
        return [json.loads((out / f"rank{i}.json").read_text()) for i in range(nproc)]


def summary(ranks: list[dict]) -> list[str]:
    lines = []
    for i, r in enumerate(ranks):
        lines.append(f"rank {i}: step {r['step_wall_s'] * 1e3:.0f} ms (profiled)")
        for prefix, what in KINDS:
            rows = sorted(((name, n, t) for name, (n, t) in r["events"].items() if name.startswith(prefix)),
                          key=lambda x: -x[2])
            if not rows:
                continue
            total_n, total_t = sum(n for _, n, _ in rows), sum(t for _, _, t in rows)
            lines.append(f"  {what}: {total_n} events, {total_t * 1e3:.0f} ms")
            for name, n, t in rows[:6]:
                lines.append(f"    {name:<52} {n:>5} {t * 1e3:>8.1f} ms")
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--batch_size", type=int, default=4, help="sequences per data-parallel rank")
    ap.add_argument("--json", default=None, help="also write every rank's events here")
    ap.add_argument("train_args", nargs=argparse.REMAINDER, help="-- then trainforge train arguments (the layout)")
    a = ap.parse_args()
    args = a.train_args[1:] if a.train_args[:1] == ["--"] else a.train_args
    ranks = run(a.nproc, a.batch_size, args)
    print("\n".join(summary(ranks)))
    if a.json:
        Path(a.json).write_text(json.dumps(ranks, indent=1))


if __name__ == "__main__":
    main()
