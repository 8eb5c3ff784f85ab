"""Checks on what a checkpoint hands a resumed run, before any of it is used.

``train_state.pt`` passes ``torch.load(weights_only=True)`` and its sha256 in meta.json, but an
attacker who rewrites it rewrites that hash too (meta.json is no authentication), and a damaged
run can write odd values. What it holds then reaches kernels and indexes that trust it: an
optimizer moment of the wrong shape made the fused AdamW write out of bounds (``malloc_consolidate():
invalid chunk size``, exit 134, no message); a step of -5 or 2^70 was accepted; a string
``data.epoch`` was a ``ValueError`` traceback. So:

* ``check_like``: every tensor loaded into the model or the optimizer must have the shape of the
  one it replaces and a dtype of the same kind (floating-point widths may differ: the run's
  precision may have changed since, and the load casts them); every other value the kind of the
  one it replaces (a number for a number, finite).
* ``check_resume_fields``: the step, the data position and the scheduler's counters are integers
  in range (``MAX_STEP``; a position within the epoch; ``last_epoch`` at most the step).

Each refusal is a ``CorruptCheckpointError`` naming the file and the key, raised before anything
is loaded (so ``checkpoint.fallback`` can try an earlier checkpoint).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import torch

from trainforge.errors import CheckpointError
from trainforge.storage.checkpoint_format import CorruptCheckpointError

# Steps, epochs and positions are written to metrics.jsonl as JSON numbers: 2^53 is the largest
# integer every JSON reader keeps exact, and ~10^6 years of steps at 1 ms each.
MAX_STEP = 2**53


def _describe(v: Any) -> str:
    if isinstance(v, torch.Tensor):
        dtype = str(v.dtype).removeprefix("torch.")
        return f"{'an' if dtype[0] in 'aeiou' else 'a'} {dtype} tensor of shape {tuple(v.shape)}"
    return f"{type(v).__name__} {v!r:.60}"


def _refuse(f: Path | str, key: str, what: str) -> CorruptCheckpointError:
    return CorruptCheckpointError(f"checkpoint file {f} is refused: {key} {what}; it was damaged or tampered with")


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _same_kind(value: Any, ref: Any) -> bool:
    """Whether ``value`` (from a file) may stand where ``ref`` (this run's) stands; tensors aside."""
    if ref is None or isinstance(ref, bool):  # optimizer flags: None means "the default"
        return value is None or isinstance(value, bool)
    if isinstance(ref, (int, float)):
        return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    if isinstance(ref, str):
        return isinstance(value, str)
    if isinstance(ref, (list, tuple)):
        return isinstance(value, (list, tuple)) and len(value) == len(ref) and all(
            not isinstance(v, torch.Tensor) and _same_kind(v, r) for v, r in zip(value, ref))
    return True  # nothing else is in a model or optimizer state


def check_like(value: Any, ref: Any, f: Path | str, key: str) -> None:
    """Refuse ``value`` (``key`` of file ``f``) unless it may replace ``ref``: a tensor of the
    same (global, for a DTensor) shape and dtype kind, or a value of the same kind."""
    if isinstance(ref, torch.Tensor):
        ok = isinstance(value, torch.Tensor) and tuple(value.shape) == tuple(ref.shape) and (
            value.dtype == ref.dtype or (value.is_floating_point() and ref.is_floating_point()))
    else:
        ok = not isinstance(value, torch.Tensor) and _same_kind(value, ref)
    if not ok:
        raise _refuse(f, key, f"is {_describe(value)}, where this run has {_describe(ref)}")


def _int_in(container: dict[str, Any], name: str, low: int, high: int, f: Path, key: str) -> int:
    v = container.get(name)
    if not _is_int(v) or not low <= v <= high:
        raise _refuse(f, key, f"is {_describe(v)}, not an integer from {low} to {high}")
    return v


def check_resume_fields(state: dict[str, Any], f: Path, step: int, global_batch: int, batches_per_epoch: int,
                        needs_optimizer: bool) -> None:
    """The fields of ``train_state.pt`` (``state``, file ``f``) a resume reads outside the
    model and optimizer tensors: ``step`` (that of the checkpoint's meta.json, ``step``), the
    data position (``batches_per_epoch`` global batches of ``global_batch`` sequences to an
    epoch of this run's data), the scheduler's counters
    and learning rates, and the optimizer state's container (single-process checkpoints)."""
    got = _int_in(state, "step", 0, MAX_STEP, f, "step")
    if got != step:
        raise _refuse(f, "step", f"is {got}, but meta.json says {step}")
    data = state["data"]
    for name in ("epoch", "position", "seed", "world_size", "batch_size", "seq_len"):
        low, high = {"world_size": (1, MAX_STEP), "batch_size": (1, MAX_STEP), "seq_len": (1, MAX_STEP),
                     "seed": (0, 2**64 - 1)}.get(name, (0, MAX_STEP))
        _int_in(data, name, low, high, f, f"data.{name}")
    # At another global batch the sampler refuses the position, naming the batch sizes.
    if data["batch_size"] * data["world_size"] == global_batch and data["position"] > batches_per_epoch:
        raise CheckpointError(f"checkpoint file {f}: data.position {data['position']} is beyond an epoch of this "
                              f"run's data ({batches_per_epoch} global batches); resume with the data.path it was "
                              "saved with")
    sched = state["scheduler"]
    _int_in(sched, "last_epoch", 0, step, f, "scheduler.last_epoch")
    if "_step_count" in sched:  # torch's own bookkeeping: checked where present
        _int_in(sched, "_step_count", 0, MAX_STEP, f, "scheduler._step_count")
    for name in ("base_lrs", "_last_lr"):
        if name not in sched and name == "_last_lr":
            continue
        lrs = sched.get(name)
        if not isinstance(lrs, list) or not lrs or not all(_same_kind(x, 0.0) and x >= 0 for x in lrs):
            raise _refuse(f, f"scheduler.{name}", f"is {_describe(lrs)}, not a list of learning rates")
    lambdas = sched.get("lr_lambdas")
    if not isinstance(lambdas, list) or not all(x is None or isinstance(x, dict) for x in lambdas):
        raise _refuse(f, "scheduler.lr_lambdas", f"is {_describe(lambdas)}, not a list of schedule states")
    if needs_optimizer and not isinstance(state.get("optimizer"), dict):
        raise _refuse(f, "optimizer", f"is {_describe(state.get('optimizer'))}, not a table of optimizer state")
