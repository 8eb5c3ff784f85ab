"""A/B speed of two source trees on one benchmark command, interleaved.

    python -m bench.ab_worktree --a /work/wt/old --b . --rounds 8 \\
        --keys fp32_tok_s int8_tok_s -- python bench/engine_speed.py --json {json}

Each round runs the command once in each tree (cwd = the tree, ``PYTHONPATH`` = its
``src`` and root, so ``trainforge`` and ``bench`` come from that tree), A then B on even
rounds and B then A on odd ones, so drift and warm caches hit both alike. ``{json}`` in the
command becomes a fresh file the command writes its numbers to; ``--keys`` are dotted paths
into that JSON (``tiny.variants.fp32.decode_tok_s.median``). A relative script path in the
command resolves against ``--script_root`` when given (run one script, e.g. one only the
new tree has, against both trees' code), else against each tree.

Reported per key: the median and IQR of the paired ratios B / A (one per round, both runs
of a round side by side), their min / max, and each side's median. On a shared machine use
many short rounds and read the spread, not one number. Exit status 0; with ``--json`` the
summary is also written there.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np


def dig(obj, path: str):
    for part in path.split("."):
        obj = obj[part]
    return float(obj)


def run_once(tree: Path, command: list[str], script_root: Path | None, timeout_s: float) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "result.json"
        cmd = [c.replace("{json}", str(out)) for c in command]
        if script_root is not None:
            cmd = [str(script_root / c) if c.endswith(".py") and not os.path.isabs(c) else c for c in cmd]
        env = {**os.environ, "PYTHONPATH": f"{tree / 'src'}{os.pathsep}{tree}"}
        t0 = time.perf_counter()
        proc = subprocess.run(cmd, cwd=tree, env=env, capture_output=True, text=True, timeout=timeout_s)
        if proc.returncode != 0 or not out.exists():
            raise RuntimeError(f"{' '.join(cmd)} in {tree} failed ({proc.returncode}): {proc.stderr[-2000:]}")
        result = json.loads(out.read_text())
        result["_wall_s"] = time.perf_counter() - t0
        return result


def summarise(xs: list[float]) -> dict[str, float]:
    q1, med, q3 = np.percentile(xs, [25, 50, 75])
    return {"median": float(med), "q1": float(q1), "q3": float(q3), "min": float(min(xs)), "max": float(max(xs)),
            "n": len(xs)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--a", required=True, help="baseline tree (e.g. /work/wt/old)")
    p.add_argument("--b", required=True, help="candidate tree")
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--keys", nargs="+", required=True, help="dotted JSON paths to compare")
    p.add_argument("--script_root", default=None, help="resolve relative *.py in the command here for both trees")
    p.add_argument("--timeout_s", type=float, default=1800)
    p.add_argument("--json", default=None, help="also write the summary here")
    p.add_argument("command", nargs=argparse.REMAINDER, help="-- then the benchmark command, with {json}")
    a = p.parse_args()
    command = a.command[1:] if a.command[:1] == ["--"] else a.command
    if not command or not any("{json}" in c for c in command):
        p.error("give the benchmark command after --, with {json} where it writes its numbers")
    trees = {"a": Path(a.a).resolve(), "b": Path(a.b).resolve()}
    root = Path(a.script_root).resolve() if a.script_root else None
    values: dict[str, dict[str, list[float]]] = {k: {"a": [], "b": []} for k in a.keys}
    for r in range(a.rounds):
        order = ("a", "b") if r % 2 == 0 else ("b", "a")
        for side in order:
            res = run_once(trees[side], command, root, a.timeout_s)
            for k in a.keys:
                values[k][side].append(dig(res, k))
        print(f"round {r}: " + ", ".join(f"{k} B/A {values[k]['b'][-1] / values[k]['a'][-1]:.3f}" for k in a.keys),
              flush=True)
    summary = {"a": str(trees["a"]), "b": str(trees["b"]), "command": command, "rounds": a.rounds, "keys": {}}
    print(f"\nB = {trees['b']}  vs  A = {trees['a']}, {a.rounds} rounds, command: {' '.join(command)}")
    print("| key | B/A median | IQR | min-max | A median | B median |\n|---|---|---|---|---|---|")
    for k in a.keys:
        ratios = [b / x for b, x in zip(values[k]["b"], values[k]["a"])]
        s = summarise(ratios)
        summary["keys"][k] = {"ratio": s, "a": summarise(values[k]["a"]), "b": summarise(values[k]["b"]),
                              "a_values": values[k]["a"], "b_values": values[k]["b"]}
        print(f"| {k} | {s['median']:.3f} | {s['q1']:.3f}-{s['q3']:.3f} | {s['min']:.3f}-{s['max']:.3f} | "
              f"{np.median(values[k]['a']):.4g} | {np.median(values[k]['b']):.4g} |")
    if a.json:
        Path(a.json).write_text(json.dumps(summary, indent=1))


if __name__ == "__main__":
    sys.exit(main())
