"""Training checkpoints: atomic, verified, and loadable without unpickling arbitrary objects.

A checkpoint is a directory ``RUN_DIR/checkpoints/step_NNNNNNN/``::

    model.safetensors   model weights (safetensors: no code execution on load)
    train_state.pt      optimizer, LR scheduler, data position, RNG states, step
                        (plain tensors/containers only; loaded with weights_only=True)
    tokenizer.json      so a checkpoint alone is enough to generate text
    meta.json           format version, step, resolved config, model shape, sha256 of every file

The directory format (meta.json, its version fields and hashes) and the atomic write,
listing and deletion of ``step_*`` directories live in ``trainforge.storage``, shared with
``trainforge quantize`` and the data writers; this module adds what only training saves
and restores (train state, RNG states, the choice of checkpoint to resume from). The
storage names are re-exported here, so ``ckpt.read_meta``, ``ckpt.list_checkpoints``...
keep working.
"""

from __future__ import annotations

import dataclasses
import os
import random
import shutil
import time
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch
from safetensors.torch import load_file, load_model, save_model

from trainforge.errors import CheckpointError
from trainforge.storage.atomic import fsync_dir
from trainforge.storage.checkpoint_dirs import (  # noqa: F401  (re-exported: the checkpoint API callers use)
    begin_step_dir,
    checkpoint_step,
    commit_step_dir,
    list_checkpoints,
    remove_checkpoint,
    remove_leftovers,
    resolve_checkpoint,
    scan_checkpoints,
    step_dir_name,
    steps_text,
    warn_incomplete,
)
from trainforge.storage.checkpoint_format import (  # noqa: F401  (re-exported)
    FORMAT,
    FORMAT_VERSION,
    META,
    MODEL_FILE,
    TOKENIZER_FILE,
    CorruptCheckpointError,
    read_meta,
    write_meta,
)
from trainforge.storage.manifest import sha256_file  # noqa: F401  (re-exported)
# load_tensor_file: also how the trainer reads rng/ and compression/ files (ckpt.load_tensor_file)
from trainforge.safe_unpickle import error_detail, load_tensor_file, refused_message, refused_problem  # noqa: F401

STATE_FILE = "train_state.pt"
# The hidden directory a checkpoint is written into (every rank writes its shards there).
begin_checkpoint = begin_step_dir


def capture_rng_state() -> dict[str, Any]:
    """Python, NumPy and torch (CPU + all CUDA devices) RNG states as weights_only-safe values."""
    np_state = np.random.get_state(legacy=False)
    state = {
        "python": random.getstate(),
        "numpy": {"bit_generator": np_state["bit_generator"],
                  "key": torch.from_numpy(np_state["state"]["key"].astype(np.int64)),
                  "pos": int(np_state["state"]["pos"]),
                  "has_gauss": int(np_state["has_gauss"]), "gauss": float(np_state["gauss"])},
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng_state(state: dict[str, Any], source: Path | str = STATE_FILE) -> None:
    """Restore what ``capture_rng_state`` captured; ``source`` (the file it came from) names
    the file when the state does not have that shape."""
    # .cpu(): train_state.pt is loaded with map_location = the training device, which puts
    # these byte tensors on the GPU in a CUDA run; the generators take CPU tensors only.
    try:
        random.setstate(state["python"])
        n = state["numpy"]
        np.random.set_state({"bit_generator": n["bit_generator"],
                             "state": {"key": n["key"].cpu().numpy().astype(np.uint32), "pos": n["pos"]},
                             "has_gauss": n["has_gauss"], "gauss": n["gauss"]})
        torch.set_rng_state(state["torch"].cpu())
        if "cuda" in state and torch.cuda.is_available():
            torch.cuda.set_rng_state_all([t.cpu() for t in state["cuda"]])
    except (KeyError, TypeError, ValueError, AttributeError, IndexError, RuntimeError) as e:
        raise CheckpointError(refused_message(source, f"no RNG state: {error_detail(e)}")) from None


def finalize_checkpoint(ckpt_root: Path, tmp: Path, step: int, train_state: dict[str, Any],
                        config: dict[str, Any], model_config: dict[str, Any], tokenizer_path: Path | None,
                        keep_last: int) -> Path:
    """Add train state, tokenizer and meta.json (sha256 of every file) to ``tmp``, fsync,
    rename it to ``step_NNNNNNN`` and delete all but the newest ``keep_last`` (rank 0 only)."""
    try:
        torch.save(train_state, tmp / STATE_FILE)
        if tokenizer_path is not None:
            shutil.copyfile(tokenizer_path, tmp / TOKENIZER_FILE)
        write_meta(tmp, step, config, model_config)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return commit_step_dir(ckpt_root, tmp, step, keep_last)


def _tensor_bytes(obj: Any) -> int:
    if isinstance(obj, torch.Tensor):
        return obj.nbytes
    if isinstance(obj, dict):
        return sum(_tensor_bytes(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(_tensor_bytes(v) for v in obj)
    return 0


def _check_free_space(ckpt_root: Path, step: int, states: list[Any]) -> None:
    """CheckpointError before writing when the disk cannot hold the checkpoint: torch.save on
    a full disk fails with an opaque RuntimeError. Earlier checkpoints are left as they are."""
    need = _tensor_bytes(states) + (1 << 20)  # + tokenizer, meta.json, zip headers
    probe = ckpt_root
    while not probe.exists() and probe != probe.parent:  # the directory is created below, parents too
        probe = probe.parent
    free = shutil.disk_usage(probe).free
    if free < need:
        raise CheckpointError(f"checkpoint step {step} needs ~{need / 2**20:.1f} MiB but {probe} has "
                              f"{free / 2**20:.1f} MiB free: free space (or lower checkpoint.keep_last) and resume "
                              "from the last checkpoint")


def save_checkpoint(ckpt_root: Path, step: int, model: torch.nn.Module, train_state: dict[str, Any],
                    config: dict[str, Any], model_config: dict[str, Any], tokenizer_path: Path | None,
                    keep_last: int) -> Path:
    """Single-process checkpoint: full weights as safetensors, written atomically."""
    _check_free_space(ckpt_root, step, [model.state_dict(), train_state])
    tmp = begin_checkpoint(ckpt_root, step)
    try:
        save_model(model, str(tmp / MODEL_FILE))
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return finalize_checkpoint(ckpt_root, tmp, step, train_state, config, model_config, tokenizer_path, keep_last)


def resume_candidates(run_dir: Path, from_step: int | None = None,
                      warn: Callable[[str], None] = lambda msg: None) -> list[Path]:
    """The checkpoints a resume of ``run_dir`` may load, in order of preference: the one
    at ``from_step``; else every complete one, newest first (the rest are fallbacks for
    ``load_first_valid``). Incomplete ``step_*`` directories are skipped, each named in a
    warning. Reads only meta.json files, so every rank of a job gets the same answer."""
    root = run_dir / "checkpoints"
    complete, incomplete = scan_checkpoints(root)
    if from_step is not None:
        chosen = [d for d in complete if checkpoint_step(d) == from_step]
        if not chosen:
            why = next((f"{d.name} is incomplete ({w})" for d, w in incomplete if checkpoint_step(d) == from_step),
                       f"no checkpoint at step {from_step}")
            raise CheckpointError(f"--from_step {from_step}: {why} in {root}; available steps: "
                                  f"{steps_text(complete)}")
        warn_incomplete(incomplete, None, warn)
        return chosen
    if not complete:
        if not run_dir.exists():
            raise CheckpointError(f"run directory {run_dir} does not exist")
        detail = "".join(f"; {d.name} is incomplete ({w})" for d, w in incomplete)
        raise CheckpointError(f"{run_dir}: no complete checkpoint (a step_NNNNNNN directory with {META}) found"
                              + detail)
    warn_incomplete(incomplete, complete[-1], warn)
    return complete[::-1]


def load_first_valid(candidates: list[Path], load: Callable[[Path], None], fallback: bool, explicit: bool,
                     warn: Callable[[str], None]) -> Path:
    """``load`` the first of ``candidates`` (from ``resume_candidates``) whose files are
    intact; return it. A corrupt one (``CorruptCheckpointError``: raised before anything is
    modified) is refused with the fix named, or with ``fallback`` skipped with a warning.
    ``explicit`` (``--from_step``): that checkpoint or nothing."""
    for i, path in enumerate(candidates):
        try:
            load(path)
            return path
        except CorruptCheckpointError as e:
            earlier = candidates[i + 1:]
            if explicit:
                raise CorruptCheckpointError(e.problem, "choose another --from_step") from None
            if not earlier:
                raise CorruptCheckpointError(e.problem, f"no earlier checkpoint in {path.parent} "
                                                        "to resume from") from None
            if not fallback:
                raise CorruptCheckpointError(e.problem, f"resume from an earlier checkpoint with --from_step N "
                                                        f"(available: {steps_text(earlier[::-1])}) or set "
                                                        "checkpoint.fallback = true") from None
            warn(f"checkpoint {path.name} is corrupt ({e.problem}); falling back to {earlier[0].name} "
                 "(checkpoint.fallback = true)")
    raise AssertionError("unreachable: the last candidate returns or raises")


def set_aside_newer(ckpt_root: Path, step: int, metrics_file: Path | None = None) -> Path | None:
    """After resuming from ``step`` (``--from_step``, or a fallback past a corrupt one),
    move every ``step_*`` directory after it to ``ckpt_root/superseded/<time>/`` (with a
    copy of ``metrics_file``), so the run continues one timeline: ``keep_last`` and the
    next resume see only its checkpoints, and nothing of the abandoned one is deleted.
    Returns that directory, or None when there was nothing newer (rank 0 only)."""
    complete, incomplete = scan_checkpoints(ckpt_root)
    newer = sorted((d for d in [*complete, *(d for d, _ in incomplete)] if checkpoint_step(d) > step),
                   key=checkpoint_step)
    if not newer:
        return None
    dest = ckpt_root / "superseded" / time.strftime("%Y%m%d-%H%M%S", time.gmtime())
    while dest.exists():  # two resumes within one second
        dest = dest.with_name(dest.name + "+")
    dest.mkdir(parents=True)
    if metrics_file is not None and metrics_file.is_file():
        shutil.copyfile(metrics_file, dest / metrics_file.name)
    for d in newer:
        os.replace(d, dest / d.name)
    fsync_dir(ckpt_root)
    return dest


def load_full_weights(ckpt: Path, tie_embeddings: bool) -> dict[str, torch.Tensor]:
    """The full FQN-keyed weights of a single-process checkpoint (tied output restored)."""
    f = ckpt / MODEL_FILE
    try:
        sd = load_file(str(f))
    except Exception as e:  # SafetensorError, OSError, and others on a crafted header
        raise CorruptCheckpointError(refused_problem(f, error_detail(e))) from None
    if tie_embeddings:  # save_model stores a tied matrix once, under one of its names
        shared = sd.get("tok_embeddings.weight", sd.get("output.weight"))
        if shared is not None:
            sd.setdefault("tok_embeddings.weight", shared)
            sd.setdefault("output.weight", shared)
    return sd


def load_model_weights(ckpt: Path, model: torch.nn.Module) -> None:
    f = ckpt / MODEL_FILE
    try:
        missing, unexpected = load_model(model, str(f), strict=False)
    except Exception as e:  # SafetensorError, OSError, RuntimeError (shapes), ...
        raise CheckpointError(f"checkpoint file {f} could not be loaded into the model ({error_detail(e)})") from None
    if missing or unexpected:
        raise CheckpointError(f"checkpoint file {f} does not match the model: missing {sorted(missing)}, "
                              f"unexpected {sorted(unexpected)}")


def load_train_state(ckpt: Path, map_location: str | torch.device = "cpu") -> dict[str, Any]:
    f = ckpt / STATE_FILE
    try:
        state = torch.load(f, map_location=map_location, weights_only=True)
    except Exception as e:  # unpickling errors come in many types; all mean "unusable file"
        raise CorruptCheckpointError(refused_problem(f, error_detail(e))) from None
    if not isinstance(state, dict):
        raise CorruptCheckpointError(refused_problem(f, f"it holds a {type(state).__name__}, not a dict"))
    # What every resume reads outside the model/optimizer load: a file that unpickles safely
    # but lacks these (or holds the wrong kinds) is refused here, not as a KeyError later.
    wrong = [k for k, kind in (("step", int), ("scheduler", dict), ("data", dict)) if not isinstance(state.get(k), kind)]
    if wrong:
        raise CorruptCheckpointError(refused_problem(f, f"missing or malformed: {', '.join(wrong)}"))
    return state


# ModelConfig fields that steer training, not what the weights mean.
BALANCING_FIELDS = ("bias_update_rate", "aux_loss_alpha", "seq_aux_loss_alpha")


def check_model_compatible(meta: dict[str, Any], model_config: Any, ckpt: Path) -> None:
    """Refuse to load weights of another shape, naming each differing field. A field the
    checkpoint does not record (written before the field existed) holds its default; the
    MoE balancing coefficients are training settings, free to change on resume."""
    want = dataclasses.asdict(model_config)
    defaults = {f.name: f.default for f in dataclasses.fields(model_config)
                if f.default is not dataclasses.MISSING}
    have = {**defaults, **meta["model_config"]}
    for k in BALANCING_FIELDS:
        want.pop(k, None)
    diff = {k: (have.get(k), v) for k, v in want.items() if have.get(k) != v}
    if diff:
        detail = ", ".join(f"{k}: checkpoint {a!r} vs run {b!r}" for k, (a, b) in diff.items())
        raise CheckpointError(f"checkpoint {ckpt} has another model shape ({detail}); "
                              "resume with the checkpoint's [model] settings")
