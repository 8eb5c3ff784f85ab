"""The weight average (``[ema]``): what it costs a training step, and what it does to validation loss.

    python -m bench.ema cost                 # step time with and without [ema], tiny, ~3 min on 2 cores
    python -m bench.ema val --steps 3000     # a real run: val loss of the average vs the final weights

``cost``: two ``Trainer``s in one process, identical but for ``--ema.enabled``, stepped through
``train_step`` (the loop's own step: the average's hooks run there) in alternating blocks of
``--steps_per_sample`` steps, the order of the two swapped every round; each round gives the
ratio of the average's block time to the plain one's. The headline is the median of those
paired ratios with their IQR and min-max. The goal: <= 1.01 (1%). Each round runs under
``flock --lock`` (default /tmp/cpu.lock), released between rounds.

``val``: one run on the built-in corpus with ``[ema]`` on, in segments of ``--segment`` steps,
each its own process continued with the trainer's exact resume and run under the lock. A
callback evaluates the averaged weights on the run's fixed validation set every time the
trainer validates the final ones (swapping the average in and the weights back, bit for bit:
training is unchanged), so the metrics hold both curves. Prints both at every validation.

A benchmark, not a test: it prints a table (and ``--json``) and exits 0.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

GOAL = 1.01


def train_args(a: argparse.Namespace) -> list[str]:
    return ["--model.flavor", a.flavor, "--training.steps", str(a.steps), "--training.batch_size", str(a.batch),
            "--training.seq_len", str(a.seq_len), "--training.seed", str(a.seed), "--training.threads",
            str(a.threads), "--training.device", "cpu", "--sample.max_new_tokens", "0"]


def ema_args(a: argparse.Namespace) -> list[str]:
    return ["--ema.enabled", "--ema.decay", str(a.decay), "--ema.interval", str(a.interval),
            *([] if a.on_cpu else ["--no-ema.on_cpu"])]


# -- cost ------------------------------------------------------------------------------

def _locked(lock: str):
    """An exclusive ``flock`` on ``lock`` (a context manager; '' = none)."""
    import contextlib
    import fcntl

    @contextlib.contextmanager
    def held():
        if not lock:
            yield
            return
        with open(lock, "a") as fh:
            fcntl.flock(fh, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(fh, fcntl.LOCK_UN)
    return held()


def cost(a: argparse.Namespace) -> dict:
    import torch

    from trainforge.config import load_config
    from trainforge.train.trainer import Trainer

    torch.set_num_threads(a.threads)
    tmp = Path(tempfile.mkdtemp(prefix="bench_ema_"))
    common = train_args(a) + ["--training.steps", "100000", "--training.log_interval", "1000000"]
    arms = {"plain": Trainer(load_config(None, common), tmp / "plain", progress=False),
            "ema": Trainer(load_config(None, common + ema_args(a)), tmp / "ema", progress=False)}

    def block(t: Trainer) -> float:
        t0 = time.perf_counter()
        for _ in range(a.steps_per_sample):
            t.train_step()
            t.step += 1
        ema = t.components.get("ema")
        if ema is not None:  # the last update too: a block ends with the average current
            ema.wait()
        return time.perf_counter() - t0

    for t in arms.values():  # warm-up: allocator, first-step costs
        block(t)
    ratios, times = [], {k: [] for k in arms}
    try:
        for r in range(a.rounds):
            order = ["plain", "ema"] if r % 2 == 0 else ["ema", "plain"]
            with _locked(a.lock):
                got = {k: block(arms[k]) for k in order}
            for k, v in got.items():
                times[k].append(v)
            ratios.append(got["ema"] / got["plain"])
            print(f"round {r + 1}/{a.rounds}: plain {got['plain']:.3f} s, ema {got['ema']:.3f} s, "
                  f"ratio {ratios[-1]:.4f}", flush=True)
    finally:
        for t in arms.values():
            t.close()
        shutil.rmtree(tmp, ignore_errors=True)
    work = update_work(a)
    q = statistics.quantiles(ratios, n=4)
    med = statistics.median(ratios)
    step_s = statistics.median(times["plain"]) / a.steps_per_sample
    print(f"\n{a.flavor}, batch {a.batch} x seq_len {a.seq_len}, {a.threads} thread(s), decay {a.decay}, interval "
          f"{a.interval}, on_cpu {a.on_cpu}: {a.rounds} rounds x {a.steps_per_sample} steps, plain step "
          f"{step_s * 1e3:.0f} ms")
    print(f"step time with [ema] / without: median {med:.4f} (IQR {q[0]:.4f}-{q[2]:.4f}; min-max {min(ratios):.4f}-"
          f"{max(ratios):.4f}); goal <= {GOAL}: {'PASS' if med <= GOAL else 'FAIL'}")
    print(f"bound from the work alone: update / (interval x step) = "
          f"{work['update_s'] / (a.interval * step_s):.2%}; main thread's part: {work['hooks_s'] / step_s:.3%}")
    return {"ratios": ratios, "times": times, "median": med, "iqr": [q[0], q[2]], "plain_step_s": step_s, **work}


def update_work(a: argparse.Namespace) -> dict:
    """The average's own work, alone: one update of ``--flavor``'s weights (median of 30), the
    main thread's part of it (the hooks: a wait that is normally over, the hand-off) and the
    bound it puts on the cost: update / step, as if it ran in the step instead of beside it."""
    import torch

    from trainforge.config import load_config
    from trainforge.model import model_config_from_section
    from trainforge.model.llama import build_model
    from trainforge.train.ema import EMAComponent

    torch.set_num_threads(a.threads)
    cfg = load_config(None, train_args(a) + ema_args(a))
    model = build_model(model_config_from_section(cfg.model, 8192, a.seq_len), "cpu", seed=a.seed)
    ema = EMAComponent(cfg.ema, [model], torch.device("cpu"))

    class Loop:
        step = 0

    update, hooks = [], []
    with _locked(a.lock):
        for _ in range(30):
            t0 = time.perf_counter()
            ema.after_optimizer_step(Loop)
            t1 = time.perf_counter()
            ema.wait()
            t2 = time.perf_counter()
            ema.before_optimizer_step(Loop, None, None)
            t3 = time.perf_counter()
            update.append(t2 - t0)
            hooks.append((t1 - t0) + (t3 - t2))
    ema.on_fit_end(Loop, {})
    n = sum(t.numel() for t in ema.weights.values())
    out = {"params": n, "update_s": statistics.median(update), "hooks_s": statistics.median(hooks)}
    print(f"one update of {n / 1e6:.2f}M fp32 weights: {out['update_s'] * 1e3:.2f} ms (median of 30, alone; "
          f"{12 * n / out['update_s'] / 1e9:.1f} GB/s at 12 bytes per weight); the main thread's part (hooks): "
          f"{out['hooks_s'] * 1e3:.3f} ms")
    return out


# -- validation loss -------------------------------------------------------------------

class EvalAverage:
    """Callback: at every validation, the loss of the averaged weights too (``ema_val_loss``).
    Swaps the average into the model and the weights back exactly (copy_), so training is as
    without it."""

    def on_step_end(self, trainer, step):
        pass

    def on_evaluation(self, trainer, step, val_loss):
        import torch

        ema = trainer.components["ema"]
        avg = ema.state_dict()["weights"]
        model = trainer.raw_model
        kept = {k: v.detach().clone() for k, v in model.state_dict().items()}
        with torch.no_grad():
            for k, v in model.state_dict().items():
                if k in avg:
                    v.copy_(avg[k])
                elif k == "output.weight" and "tok_embeddings.weight" in avg:  # tied: stored once
                    v.copy_(avg["tok_embeddings.weight"])
            ema_loss = trainer.evaluate()
            for k, v in model.state_dict().items():
                v.copy_(kept[k])
        return {"ema_val_loss": ema_loss}


def segment(a: argparse.Namespace) -> None:
    """One locked job: continue the run in ``a.run_dir`` up to step ``a.until``."""
    from trainforge.config import load_config
    from trainforge.train.trainer import Trainer

    class StopAt:
        def on_step_end(self, trainer, step):
            if step == a.until and step < a.steps:
                trainer.request_stop("bench segment")

    run_dir = Path(a.run_dir)
    args = train_args(a) + ema_args(a) + ["--training.val_interval", str(a.val_interval), "--training.val_batches",
                                          str(a.val_batches), "--training.lr", str(a.lr), "--training.warmup_steps",
                                          str(a.warmup), "--checkpoint.interval", "0", "--checkpoint.keep_last", "1"]
    t = Trainer(load_config(None, args), run_dir, resume=(run_dir / "checkpoints").is_dir(),
                callbacks=[StopAt(), EvalAverage()], progress=False)
    try:
        t.fit()
    finally:
        t.close()


def val(a: argparse.Namespace) -> dict:
    out = Path(a.out)
    done = 0
    if a.keep:  # continue the run in --out (same arguments; --segment may differ)
        done = max((int(p.name.split("_")[1]) for p in (out / "run" / "checkpoints").glob("step_*")), default=0)
    else:
        shutil.rmtree(out, ignore_errors=True)
    passthrough = [f"--{k}={v}" for k, v in vars(a).items()
                   if k not in ("mode", "json", "until", "run_dir", "keep", "segment")]
    env = {**os.environ, "OMP_NUM_THREADS": str(a.threads)}
    ends = [min(u, a.steps) for u in range(done + a.segment, a.steps + a.segment, a.segment)]
    for until in ends:
        cmd = [sys.executable, "-m", "bench.ema", "segment", *passthrough, "--until", str(until),
               "--run_dir", str(out / "run")]
        if a.lock:
            cmd = ["flock", a.lock, *cmd]
        t0 = time.perf_counter()
        r = subprocess.run(cmd, env=env, capture_output=True, text=True)
        if r.returncode != 0:
            sys.exit(f"segment to step {until} failed:\n{r.stderr[-3000:]}")
        print(f"segment to step {until}: {time.perf_counter() - t0:.0f} s (lock wait included)", flush=True)
    records = [json.loads(line) for line in (out / "run" / "metrics.jsonl").read_text().splitlines() if line.strip()]
    vals = [(r["step"], r["val_loss"], r["ema_val_loss"]) for r in records if "ema_val_loss" in r]
    print(f"\n{a.flavor} on the built-in corpus, {a.steps} steps x {a.batch * a.seq_len} tokens (batch {a.batch} x "
          f"seq_len {a.seq_len}), lr {a.lr} cosine, seed {a.seed}; [ema] decay {a.decay}, interval {a.interval}")
    print(f"{'step':>6} {'final':>8} {'ema':>8} {'ema - final':>11}")
    for step, v, e in vals:
        print(f"{step:>6} {v:>8.4f} {e:>8.4f} {e - v:>+11.4f}")
    return {"val": vals}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("mode", choices=["cost", "val", "segment", "work"])
    p.add_argument("--flavor", default="tiny")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq_len", type=int, default=256)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--decay", type=float, default=0.999)
    p.add_argument("--interval", type=int, default=1)
    p.add_argument("--on_cpu", type=int, default=1, help="1: ema.on_cpu = true (the host thread); 0: in the step")
    p.add_argument("--lock", default="/tmp/cpu.lock", help="flock file each round / segment runs under; '' = none")
    p.add_argument("--json", default=None)
    # cost
    p.add_argument("--rounds", type=int, default=16)
    p.add_argument("--steps_per_sample", type=int, default=3)
    # val
    p.add_argument("--steps", type=int, default=3000)
    p.add_argument("--segment", type=int, default=250, help="steps per locked job")
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--warmup", type=int, default=100)
    p.add_argument("--val_interval", type=int, default=250)
    p.add_argument("--val_batches", type=int, default=16)
    p.add_argument("--out", default="/tmp/bench_ema")
    p.add_argument("--keep", action="store_true", help="val: continue the run in --out instead of starting afresh")
    p.add_argument("--until", type=int, help=argparse.SUPPRESS)
    p.add_argument("--run_dir", help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.mode == "segment":
        return segment(a)
    result = {"cost": cost, "val": val, "work": update_work}[a.mode](a)
    if a.json:
        Path(a.json).write_text(json.dumps({"args": vars(a), **result}, indent=1))


if __name__ == "__main__":
    main()
