"""The loop's checkpoint: save, load (resume) and roll back everything a run needs to
continue bit for bit: the model parts and optimizers (``dist_checkpoint.py``), the LR
schedulers, the data position, the RNG states, the step, and every registered
component (``component.Components``: by name into ``train_state.pt``, per-rank states
into ``<name>/rank_NNNNN.pt``). ``loop`` is the ``Trainer``. The writing itself is
``checkpoint.py``'s (atomic directories, meta.json, keep_last).

``train_state.pt`` keys: step, scheduler, data, rng (single process; per rank under
``rng/`` otherwise), optimizer (single process), and the components' names
(precision, adaptive_lr, bad_steps, callbacks/<key>): the layout of every earlier
version, so older checkpoints load as they are.
"""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from trainforge.config_base import config_to_dict
from trainforge.errors import CheckpointError
from trainforge.train import checkpoint as ckpt
from trainforge.train import dist_checkpoint as dckpt
from trainforge.train.component import Stop, StopKind
from trainforge.train.lr_schedule import describe_change, follow_schedule, warmup_decay
from trainforge.train.state_checks import check_resume_fields


def _train_state(loop: Any, include_per_rank: bool) -> dict[str, Any]:
    return {"step": loop.step, "scheduler": loop.schedulers[0].state_dict(),
            "data": loop.train_batches.state_dict(), "rng": ckpt.capture_rng_state(),
            **loop.components.state(include_per_rank)}


def save(loop: Any) -> Path:
    """Write a checkpoint (collective when distributed). Single process: full weights
    as safetensors; several: DCP shards that any other layout can load."""
    t0 = time.perf_counter()
    root = loop.run_dir / "checkpoints"
    args = (config_to_dict(loop.cfg), dataclasses.asdict(loop.model_config), loop.data.tokenizer_path,
            loop.cfg.checkpoint.keep_last)
    loop.components.on_checkpoint(loop)  # collectives: every rank, before rank 0 writes
    if loop.dims.world_size == 1:
        state = _train_state(loop, include_per_rank=True)
        state["optimizer"] = dckpt.model_and_optim_state(loop.opt_parts, loop.optimizers)["optim"]
        path = ckpt.save_checkpoint(root, loop.step, loop.opt_parts[0], state, *args)
    else:
        tmp = ckpt.begin_checkpoint(root, loop.step) if loop.is_main else root / f".{ckpt.step_dir_name(loop.step)}.tmp"
        dist.barrier()
        dckpt.save_sharded(tmp, loop.opt_parts, loop.optimizers)
        (tmp / "rng").mkdir(exist_ok=True)
        torch.save(ckpt.capture_rng_state(), tmp / "rng" / f"rank_{loop.dist.rank:05d}.pt")
        loop.components.save_rank_files(tmp, loop.dist.rank)  # state that differs per rank
        dist.barrier()
        path = root / ckpt.step_dir_name(loop.step)
        if loop.is_main:
            state = _train_state(loop, include_per_rank=False)
            del state["rng"]  # per rank, under rng/
            path = ckpt.finalize_checkpoint(root, tmp, loop.step, state, *args)
        dist.barrier()
    seconds = time.perf_counter() - t0
    loop.metrics.write({"step": loop.step, "checkpoint": str(path), "checkpoint_save_s": round(seconds, 4)})
    if loop.is_main:  # written only once the directory is committed (renamed into place): it is there to resume
        loop.log.info(f"checkpoint step {loop.step} saved: {path} ({_size_text(path)}, {seconds:.2f} s)")
    return path


def _size_text(path: Path) -> str:
    """``12.3 MB``: every file under ``path`` (a few dozen stat calls, even for DCP shards)."""
    total = sum(f.stat().st_size for f in path.rglob("*") if f.is_file())
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if total >= scale:
            return f"{total / scale:.1f} {unit}"
    return f"{total} B"


def load(loop: Any, path: Path, rollback: bool = False) -> None:
    """Restore the checkpoint at ``path``. ``rollback``: keep the live data position
    (so the batches since the checkpoint are not replayed) and the components that
    keep their state on a rollback (the bad-step guard)."""
    meta = ckpt.read_meta(path)
    ckpt.check_model_compatible(meta, loop.model_config, path)
    tok_digest = meta["files"].get(ckpt.TOKENIZER_FILE)
    if tok_digest is not None and tok_digest != loop.data.manifest["tokenizer"]["sha256"]:
        raise CheckpointError(f"checkpoint {path} was trained with another tokenizer than {loop.data.path}; "
                              "resume with the same data.path")
    state = ckpt.load_train_state(path, loop.device)
    sharded = (path / dckpt.SHARDED_DIR).is_dir()
    plan = loop.train_batches.plan
    check_resume_fields(state, path / ckpt.STATE_FILE, int(meta["step"]), plan.batch_size * plan.world_size,
                        loop.train_batches.batches_per_epoch, needs_optimizer=not sharded)
    try:
        if sharded:
            dckpt.load_sharded(path, loop.opt_parts, loop.optimizers)
        else:
            weights = ckpt.load_full_weights(path, loop.model_config.tie_embeddings)
            dckpt.load_full(loop.opt_parts, loop.optimizers, weights, state["optimizer"],
                            sources=(path / ckpt.MODEL_FILE, path / ckpt.STATE_FILE))
        if loop.mp.master is not None:
            loop.mp.master.master_to_model()
        for sched in loop.schedulers:
            sched.load_state_dict(_fit_groups(state["scheduler"], len(sched.optimizer.param_groups)))
    except (KeyError, ValueError, RuntimeError) as e:
        raise CheckpointError(f"{path}: model/optimizer/scheduler state does not fit this run ({e})") from None
    load_components(loop, path, state, rollback)
    _keep_configured_schedule(loop)
    if not rollback:
        loop.train_batches.load_state_dict(state["data"])
    rng_file = path / "rng" / f"rank_{loop.dist.rank:05d}.pt"
    if "rng" in state:
        ckpt.restore_rng_state(state["rng"])
    elif rng_file.is_file():  # same rank existed when saved; other layouts keep the seeded state
        ckpt.restore_rng_state(ckpt.load_tensor_file(rng_file), rng_file)
    loop.step = int(state["step"])
    loop.components.on_load(loop)
    loop.log.info(f"{'rolled back to' if rollback else 'resumed from'} {path} at step {loop.step}")


def _fit_groups(sched_state: dict[str, Any], n_groups: int) -> dict[str, Any]:
    """The scheduler's per-param-group lists resized to ``n_groups``: every group follows
    one schedule, but the number of groups depends on the layout (expert parallelism adds
    groups for the experts' mesh), and a checkpoint loads at any layout."""
    out = dict(sched_state)
    for key in ("base_lrs", "_last_lr", "lr_lambdas"):
        values = out.get(key)
        if isinstance(values, list) and values and len(values) != n_groups:
            out[key] = (values + [values[0]] * n_groups)[:n_groups]
    return out


def _keep_configured_schedule(loop: Any) -> None:
    """A resumed scheduler carries the schedule it was saved with. When the user
    changed it on resume (e.g. ``--training.steps`` to extend a run, or a new
    ``--training.lr``, or another global batch under ``optimizer.lr_scaling``), follow the
    config from the current step on, and say so."""
    lr = loop.peak_lr
    want = warmup_decay(*loop.schedule_args())
    have = loop.schedulers[0].lr_lambdas[0]
    if vars(have) == vars(want) and loop.schedulers[0].base_lrs[0] == lr:
        return
    step = loop.schedulers[0].last_epoch  # optimizer steps taken: the step the run continues from
    loop.log.info("LR schedule changed on resume: "
                  + describe_change(have, loop.schedulers[0].base_lrs[0], want, lr, step))
    loop.schedulers = [follow_schedule(s, o, want, lr) for s, o in zip(loop.schedulers, loop.optimizers)]


def rollback(loop: Any, bad_steps: int) -> None:
    """Reload the newest checkpoint from before the last ``bad_steps`` steps, keeping the
    data position (the batches in between are not replayed) and the bad-step policy.
    Stops the run when there is no such checkpoint. Collective when distributed."""
    first_bad = loop.step - bad_steps + 1
    found = [p for p in ckpt.list_checkpoints(loop.run_dir / "checkpoints")
             if ckpt.checkpoint_step(p) < first_bad]
    if not found:
        loop.request(Stop(f"{bad_steps} bad steps in a row and no checkpoint from before step {first_bad} "
                          "to roll back to", StopKind.BAD_STEPS))
        return
    from_step = loop.step
    load(loop, found[-1], rollback=True)
    if loop.is_main:  # the abandoned timeline's checkpoints: --resume continues the rolled-back run
        for newer in ckpt.list_checkpoints(loop.run_dir / "checkpoints"):
            if ckpt.checkpoint_step(newer) > loop.step:
                ckpt.remove_checkpoint(newer)  # renamed first: a kill never leaves half of one
    loop.metrics.write({"step": loop.step, "rolled_back_from_step": from_step, "rolled_back_to": str(found[-1]),
                        "data": loop.train_batches.state_dict()})


def load_components(loop: Any, path: Path, state: dict[str, Any], rollback: bool = False) -> None:
    """Every registered component's state from checkpoint ``path``: its entry in
    ``train_state.pt`` (``state``) or, for per-rank state, this rank's
    ``<name>/rank_NNNNN.pt``, read with the safe loader (a hostile or corrupt file is a
    ``CheckpointError`` naming it; nothing reaches the component)."""
    loop.components.load(loop, path, state, loop.dist.rank, lambda f: ckpt.load_tensor_file(f, loop.device),
                         rollback=rollback)
