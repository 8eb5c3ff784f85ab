"""Start-up cost of one ``trainforge train`` process: a 1-step debug run, old tree vs new tree.

    TRAINFORGE_CACHE=/tmp/tfcache python bench/startup.py --a /work/main --b . --pairs 8

Every multi-process test, every torchrun rank and every user's first command pays the
process start (imports, the built-in corpus's file list, building the trainer), so it is
measured alone: ``python -m trainforge train --model.flavor debug --training.steps 1``
(validation on 2 batches, no sample), on the built-in corpus (already prepared in
``TRAINFORGE_CACHE``: the first run of each tree would prepare it; both trees must name the
same cache directory, i.e. list the same corpus files) or ``--data_path``.

Each pair runs A and B once each, A first in even pairs and B first in odd ones, so drift
and warm file caches hit both alike; the ratio is B / A of the pair. Reported: the median of
the paired ratios (IQR, min-max) and each side's median wall and CPU seconds (user + system
of the process and its children). On a shared machine read the spread, not one number.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.ab_worktree import summarise as summary  # noqa: E402  (the same paired-ratio summary)

ARGS = ["train", "--model.flavor", "debug", "--training.steps", "1", "--training.val_batches", "2",
        "--training.threads", "1", "--sample.max_new_tokens", "0", "--no_sample"]


def children_cpu_s() -> float:
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def run_once(tree: Path, data_path: str | None, timeout_s: float) -> tuple[float, float]:
    """(wall s, CPU s) of one 1-step train in ``tree`` (its src/ on PYTHONPATH)."""
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [sys.executable, "-m", "trainforge", *ARGS, "--run_dir", str(Path(tmp) / "run")]
        if data_path:
            cmd += ["--data.path", data_path]
        env = {**os.environ, "PYTHONPATH": str(tree / "src"), "OMP_NUM_THREADS": "1"}
        cpu0, t0 = children_cpu_s(), time.perf_counter()
        p = subprocess.run(cmd, cwd=tree, env=env, capture_output=True, text=True, timeout=timeout_s)
        wall, cpu = time.perf_counter() - t0, children_cpu_s() - cpu0
        if p.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)} in {tree} failed ({p.returncode}): {p.stderr[-2000:]}")
        return wall, cpu


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--a", required=True, help="baseline tree")
    p.add_argument("--b", required=True, help="candidate tree")
    p.add_argument("--pairs", type=int, default=8)
    p.add_argument("--data_path", default=None, help="prepared data instead of the built-in corpus")
    p.add_argument("--timeout_s", type=float, default=300)
    p.add_argument("--json", default=None, help="also write every sample and the summary here")
    a = p.parse_args()
    trees = {"a": Path(a.a).resolve(), "b": Path(a.b).resolve()}
    got: dict[str, dict[str, list[float]]] = {s: {"wall": [], "cpu": []} for s in trees}
    for i in range(a.pairs):
        for side in (("a", "b") if i % 2 == 0 else ("b", "a")):
            wall, cpu = run_once(trees[side], a.data_path, a.timeout_s)
            got[side]["wall"].append(wall)
            got[side]["cpu"].append(cpu)
        print(f"pair {i}: wall A {got['a']['wall'][-1]:.2f} s B {got['b']['wall'][-1]:.2f} s, "
              f"CPU A {got['a']['cpu'][-1]:.2f} s B {got['b']['cpu'][-1]:.2f} s", flush=True)
    out = {"a": str(trees["a"]), "b": str(trees["b"]), "pairs": a.pairs, "args": ARGS, "samples": got}
    print(f"\nB = {trees['b']} vs A = {trees['a']}, {a.pairs} pairs, trainforge {' '.join(ARGS)}")
    print("| measure | B/A median | IQR | min-max | A median s | B median s |\n|---|---|---|---|---|---|")
    for key in ("wall", "cpu"):
        ratios = [b / x for b, x in zip(got["b"][key], got["a"][key])]
        s = summary(ratios)
        out[key] = {"ratio": s, "a": summary(got["a"][key]), "b": summary(got["b"][key])}
        print(f"| {key} | {s['median']:.3f} | {s['q1']:.3f}-{s['q3']:.3f} | {s['min']:.3f}-{s['max']:.3f} | "
              f"{out[key]['a']['median']:.2f} | {out[key]['b']['median']:.2f} |")
    if a.json:
        Path(a.json).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    sys.exit(main())
