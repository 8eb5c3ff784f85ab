"""Bad steps and early stopping under DDP on 2 ranks. Faults are injected on rank 1 only;
each rank writes what it saw to OUT/<scenario>_rank<r>.json for the test to compare.

    torchrun --nproc_per_node 2 bad_steps_worker.py DATA OUT

Scenarios (one Trainer each, in one process group):
- skip: rank 1's loss is NaN at step 4 (its gradients stay finite, so only the
  all-reduced loss reveals it); both ranks must skip step 4.
- stop: the same at step 3 with on_nonfinite = stop.
- rollback: NaN at the 4th and 5th train steps, max_consecutive_bad 2, checkpoints every
  2 steps: the 5th step rolls back to step 2 and training goes on to the end.
- early: scripted validation losses differ per rank; rank 1's alone would never stop.
"""

import hashlib
import json
import sys
from pathlib import Path

import torch

from trainforge.config import load_config
from trainforge.parallel.distributed import destroy_distributed, init_distributed
from trainforge.monitor.jsonl import read_jsonl
from trainforge.train.trainer import Trainer

DATA, OUT = Path(sys.argv[1]), Path(sys.argv[2])
info = init_distributed("cpu", timeout_s=120)
COMMON = ["--data.path", str(DATA), "--model.flavor", "debug", "--training.seq_len", "32", "--training.batch_size",
          "4", "--training.warmup_steps", "2", "--training.log_interval", "1", "--training.val_interval", "0",
          "--training.val_batches", "2", "--sample.max_new_tokens", "0", "--training.threads", "1",
          "--parallel.dp_replicate", "2", "--parallel.dp_shard", "1"]


def digest(trainer) -> str:
    h = hashlib.sha256()
    for name, p in sorted(trainer.raw_model.state_dict().items()):
        h.update(name.encode())
        h.update(p.detach().cpu().numpy().tobytes())
    return h.hexdigest()


class Snapshots:
    """Weights digest after every step, and the scheduler's step count."""

    def __init__(self):
        self.weights, self.sched = {}, {}

    def on_step_end(self, trainer, step):
        self.weights[step] = digest(trainer)
        self.sched[step] = trainer.scheduler.last_epoch


def scenario(name, bad_calls, *extra, evaluate=None):
    """Run one Trainer with rank 1's loss NaN at the given train_step calls (1-based)."""
    calls = {"n": 0}
    original_loss, original_step = Trainer._loss, Trainer.train_step

    def train_step(self):
        calls["n"] += 1
        return original_step(self)

    def loss(self, inputs, targets):
        value = original_loss(self, inputs, targets)
        if info.rank == 1 and self.model.training and calls["n"] in bad_calls:
            return value + float("nan")  # the loss only: gradients stay finite
        return value

    Trainer.train_step, Trainer._loss = train_step, loss
    if evaluate is not None:
        Trainer.evaluate = evaluate
    snaps = Snapshots()
    run_dir = OUT / name
    trainer = Trainer(load_config(None, [*COMMON, *extra]), run_dir, callbacks=[snaps], progress=False)
    after_rollback = {}
    original_rollback = trainer._rollback

    def rollback(bad):
        original_rollback(bad)
        after_rollback.update(step=trainer.step, weights=digest(trainer), data=trainer.train_batches.state_dict())

    trainer._rollback = rollback
    summary = trainer.fit()
    trainer.close()
    Trainer.train_step, Trainer._loss = original_step, original_loss
    result = {"summary": {k: v for k, v in summary.items() if isinstance(v, (int, float, str, bool, dict, type(None)))},
              "weights": snaps.weights, "sched": snaps.sched, "final": digest(trainer),
              "after_rollback": after_rollback, "sched_final": trainer.scheduler.last_epoch}
    if info.rank == 0:
        result["metrics"] = read_jsonl(run_dir / "metrics.jsonl")
    (OUT / f"{name}_rank{info.rank}.json").write_text(json.dumps(result))


scenario("skip", {4}, "--training.steps", "6", "--bad_steps.enabled", "true")
scenario("stop", {3}, "--training.steps", "6", "--bad_steps.enabled", "true", "--bad_steps.on_nonfinite", "stop")
scenario("rollback", {4, 5}, "--training.steps", "8", "--checkpoint.interval", "2", "--bad_steps.enabled", "true",
         "--bad_steps.max_consecutive_bad", "2")
# Rank 0's validation losses flatten (patience 2 stops at step 8); rank 1's keep falling.
falling = lambda step: 6.0 - 0.1 * step  # noqa: E731
flat = lambda step: 6.0 - 0.1 * min(step, 4)  # noqa: E731
scenario("early", set(), "--training.steps", "12", "--training.val_interval", "2", "--early_stop.mode", "patience",
         "--early_stop.patience", "2", "--early_stop.min_delta", "0.01", "--early_stop.n_bootstrap", "0",
         evaluate=lambda self: torch.tensor(flat(self.step) if info.rank == 0 else falling(self.step)).item())
destroy_distributed()
