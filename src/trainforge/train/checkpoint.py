"""Checkpoints: atomic, verified, and loadable without unpickling arbitrary objects.

A checkpoint is a directory ``RUN_DIR/checkpoints/step_NNNNNNN/``::

    model.safetensors   model weights (safetensors: no code execution on load)
    train_state.pt      optimizer, LR scheduler, data position, RNG states, step
                        (plain tensors/containers only; loaded with weights_only=True)
    tokenizer.json      so a checkpoint alone is enough to generate text
    meta.json           step, resolved config, model shape, sha256 of every file

It is written into a hidden temporary directory and renamed into place only when
complete, so a crash mid-save never leaves a directory that looks like a checkpoint;
``meta.json``'s hashes catch later corruption and name the damaged file.
"""

from __future__ import annotations

import dataclasses
import json
import os
import random
import re
import shutil
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import load_file, load_model, save_model

from trainforge import __version__
from trainforge.data.prepare import sha256_file
from trainforge.errors import CheckpointError
# load_tensor_file: also how the trainer reads rng/ and compression/ files (ckpt.load_tensor_file)
from trainforge.safe_unpickle import error_detail, load_tensor_file, refused_message

_STEP_DIR = re.compile(r"^step_(\d{7,})$")
META = "meta.json"
MODEL_FILE = "model.safetensors"
STATE_FILE = "train_state.pt"
TOKENIZER_FILE = "tokenizer.json"


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
    try:
        random.setstate(state["python"])
        n = state["numpy"]
        np.random.set_state({"bit_generator": n["bit_generator"],
                             "state": {"key": n["key"].numpy().astype(np.uint32), "pos": n["pos"]},
                             "has_gauss": n["has_gauss"], "gauss": n["gauss"]})
        torch.set_rng_state(state["torch"])
        if "cuda" in state and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(state["cuda"])
    except (KeyError, TypeError, ValueError, AttributeError, IndexError, RuntimeError) as e:
        raise CheckpointError(refused_message(source, f"no RNG state: {error_detail(e)}")) from None


def step_dir_name(step: int) -> str:
    return f"step_{step:07d}"


def list_checkpoints(ckpt_root: Path) -> list[Path]:
    """Complete checkpoints (those with meta.json) under ``ckpt_root``, oldest first."""
    if not ckpt_root.is_dir():
        return []
    found = []
    for d in ckpt_root.iterdir():
        m = _STEP_DIR.match(d.name)
        if m and d.is_dir() and (d / META).is_file():
            found.append((int(m.group(1)), d))
    return [d for _, d in sorted(found)]


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def begin_checkpoint(ckpt_root: Path, step: int) -> Path:
    """Create the hidden temporary directory a checkpoint is written into (rank 0 only;
    its name is deterministic so every rank of a job writes its shards into the same one)."""
    ckpt_root.mkdir(parents=True, exist_ok=True)
    tmp = ckpt_root / f".{step_dir_name(step)}.tmp"
    if tmp.exists():
        shutil.rmtree(tmp)  # left by a crash mid-save: never a valid checkpoint
    tmp.mkdir()
    return tmp


def finalize_checkpoint(ckpt_root: Path, tmp: Path, step: int, train_state: dict[str, Any],
                        config: dict[str, Any], model_config: dict[str, Any], tokenizer_path: Path | None,
                        keep_last: int) -> Path:
    """Add train state, tokenizer and meta.json (sha256 of every file) to ``tmp``, fsync,
    rename it to ``step_NNNNNNN`` and delete all but the newest ``keep_last`` (rank 0 only)."""
    final = ckpt_root / step_dir_name(step)
    try:
        torch.save(train_state, tmp / STATE_FILE)
        if tokenizer_path is not None:
            shutil.copyfile(tokenizer_path, tmp / TOKENIZER_FILE)
        files = sorted(str(p.relative_to(tmp)) for p in tmp.rglob("*") if p.is_file())
        for name in files:
            with open(tmp / name, "rb") as fh:
                os.fsync(fh.fileno())
        meta = {
            "step": step,
            "config": config,
            "model_config": model_config,
            "files": {name: sha256_file(tmp / name) for name in files},
            "trainforge_version": __version__,
            "torch_version": torch.__version__,
            "created_unix_s": time.time(),
        }
        with open(tmp / META, "w") as fh:
            json.dump(meta, fh, indent=2)
            fh.flush()
            os.fsync(fh.fileno())
        for d in [tmp, *(p for p in tmp.rglob("*") if p.is_dir())]:
            d.chmod(0o755)
        if final.exists():  # re-saving a step (e.g. after resume): swap, then drop the old one
            trash = ckpt_root / f".{final.name}.old-{os.getpid()}"
            os.replace(final, trash)
            os.replace(tmp, final)
            shutil.rmtree(trash, ignore_errors=True)
        else:
            os.replace(tmp, final)
        _fsync_dir(ckpt_root)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    for old in list_checkpoints(ckpt_root)[:-keep_last]:
        shutil.rmtree(old, ignore_errors=True)
    return final


def save_checkpoint(ckpt_root: Path, step: int, model: torch.nn.Module, train_state: dict[str, Any],
                    config: dict[str, Any], model_config: dict[str, Any], tokenizer_path: Path | None,
                    keep_last: int) -> Path:
    """Single-process checkpoint: full weights as safetensors, written atomically."""
    tmp = begin_checkpoint(ckpt_root, step)
    try:
        save_model(model, str(tmp / MODEL_FILE))
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return finalize_checkpoint(ckpt_root, tmp, step, train_state, config, model_config, tokenizer_path, keep_last)


def resolve_checkpoint(path: str | Path) -> Path:
    """Accept a checkpoint directory, a ``checkpoints/`` directory or a run directory;
    return the newest complete checkpoint directory."""
    path = Path(path)
    if (path / META).is_file():
        return path
    for root in (path / "checkpoints", path):
        found = list_checkpoints(root)
        if found:
            return found[-1]
    if not path.exists():
        raise CheckpointError(f"checkpoint path {path} does not exist")
    raise CheckpointError(f"{path}: no complete checkpoint (a step_NNNNNNN directory with {META}) found")


def read_meta(ckpt: Path, verify: bool = True) -> dict[str, Any]:
    """Read ``meta.json``; with ``verify`` check every listed file's sha256."""
    mpath = ckpt / META
    try:
        meta = json.loads(mpath.read_text())
        files = meta["files"]
        int(meta["step"])
        meta["config"], meta["model_config"]
    except FileNotFoundError:
        raise CheckpointError(f"{mpath} is missing: {ckpt} is not a complete checkpoint") from None
    except (json.JSONDecodeError, KeyError, TypeError, ValueError) as e:
        raise CheckpointError(f"{mpath} is corrupt ({e!r}); use an earlier checkpoint") from None
    if verify:
        for name, digest in files.items():
            f = ckpt / name
            if not f.is_file():
                raise CheckpointError(f"checkpoint file {f} is missing (listed in {mpath})")
            if sha256_file(f) != digest:
                raise CheckpointError(f"checkpoint file {f} is corrupt: its sha256 does not match {mpath}; "
                                      "use an earlier checkpoint")
    return meta


def load_full_weights(ckpt: Path, tie_embeddings: bool) -> dict[str, torch.Tensor]:
    """The full FQN-keyed weights of a single-process checkpoint (tied output restored)."""
    f = ckpt / MODEL_FILE
    try:
        sd = load_file(str(f))
    except Exception as e:  # SafetensorError, OSError, and others on a crafted header
        raise CheckpointError(refused_message(f, error_detail(e))) from None
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
    state = load_tensor_file(ckpt / STATE_FILE, map_location)
    if not isinstance(state, dict):
        raise CheckpointError(refused_message(ckpt / STATE_FILE, f"it holds a {type(state).__name__}, not a dict"))
    return state


def check_model_compatible(meta: dict[str, Any], model_config: Any, ckpt: Path) -> None:
    """Refuse to load weights of another shape, naming each differing field."""
    want = dataclasses.asdict(model_config)
    have = meta["model_config"]
    diff = {k: (have.get(k), v) for k, v in want.items() if have.get(k) != v}
    if diff:
        detail = ", ".join(f"{k}: checkpoint {a!r} vs run {b!r}" for k, (a, b) in diff.items())
        raise CheckpointError(f"checkpoint {ckpt} has another model shape ({detail}); "
                              "resume with the checkpoint's [model] settings")
