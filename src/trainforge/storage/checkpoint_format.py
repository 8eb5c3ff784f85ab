"""The checkpoint directory format, shared by training checkpoints and ``trainforge
quantize`` output: which files it holds and what ``meta.json`` records.

``meta.json`` holds ``format`` and ``format_version`` (what this code writes), ``step``,
the resolved ``config``, ``model_config``, the sha256 of every other file (``files``),
the writer's trainforge and torch versions, plus whatever the writer adds (``quantization``).
Directories written before the version fields existed have neither; they are read as
version 1, which is what they are. A higher ``format_version`` is refused with the fix
(upgrade), never half-understood.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import torch

from trainforge import __version__
from trainforge.errors import CheckpointError
from trainforge.storage.manifest import digest_files, find_damage

META = "meta.json"
MODEL_FILE = "model.safetensors"
TOKENIZER_FILE = "tokenizer.json"
FORMAT = "trainforge-checkpoint"
FORMAT_VERSION = 1
REQUIRED_KEYS = ("step", "files", "config", "model_config")


class CorruptCheckpointError(CheckpointError):
    """A complete checkpoint whose files are damaged (sha256 mismatch, missing or unreadable
    file). ``problem`` says what, without a fix: callers that can offer an earlier
    checkpoint (``checkpoint.fallback``, ``--from_step``) add their own."""

    def __init__(self, problem: str, fix: str = "use an earlier checkpoint"):
        super().__init__(f"{problem}; {fix}")
        self.problem = problem


def write_meta(tmp: Path, step: int, config: dict[str, Any], model_config: dict[str, Any],
               extra: dict[str, Any] | None = None) -> dict[str, Any]:
    """Write ``tmp/meta.json`` describing every file already in ``tmp`` (write it last;
    ``atomic.commit_directory`` then fsyncs and renames the directory). Returns the meta."""
    files = digest_files(tmp)
    meta = {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "step": step,
        "config": config,
        "model_config": model_config,
        **(extra or {}),
        "files": files,
        "trainforge_version": __version__,
        "torch_version": torch.__version__,
        "created_unix_s": time.time(),
    }
    (Path(tmp) / META).write_text(json.dumps(meta, indent=2))
    return meta


def meta_problem(ckpt: Path, step: int) -> str | None:
    """Why ``ckpt/meta.json`` does not mark a complete checkpoint of ``step``, or None. Reads
    only meta.json (small), so listing stays cheap; file hashes are checked on load."""
    mpath = ckpt / META  # named in full: the warning or refusal points at the file to look at
    try:
        meta = json.loads(mpath.read_text())
    except FileNotFoundError:
        return f"{mpath} is missing"
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, RecursionError) as e:  # nested past the stack
        return f"{mpath} is unreadable ({type(e).__name__})"
    missing = [k for k in REQUIRED_KEYS if not isinstance(meta, dict) or k not in meta]
    if missing:
        return f"{mpath} lacks {', '.join(missing)}"
    if not isinstance(meta["files"], dict) or meta["step"] != step:
        return f"{mpath} does not describe step {step}"
    return None


def check_format(meta: dict[str, Any], mpath: Path) -> None:
    """Refuse a meta.json of another format or a newer version; absent fields = version 1."""
    fmt = meta.get("format", FORMAT)
    version = meta.get("format_version", 1)
    if fmt != FORMAT:
        raise CheckpointError(f"{mpath}: format {fmt!r} is not a trainforge checkpoint ({FORMAT!r}); "
                              "point at a directory written by `trainforge train` or `trainforge quantize`")
    if isinstance(version, bool) or not isinstance(version, int) or version < 1:
        raise CorruptCheckpointError(f"{mpath} is corrupt (format_version {version!r} is not an integer >= 1)")
    if version > FORMAT_VERSION:
        raise CheckpointError(f"{mpath}: format_version {version} was written by a newer trainforge (this one "
                              f"reads up to {FORMAT_VERSION}); upgrade trainforge to load it")


def read_meta(ckpt: Path, verify: bool = True) -> dict[str, Any]:
    """Read ``meta.json``; with ``verify`` check every listed file's sha256. Damage raises
    ``CorruptCheckpointError`` naming the file; a newer or foreign format ``CheckpointError``."""
    mpath = Path(ckpt) / META
    try:
        meta = json.loads(mpath.read_text())
        files = meta["files"]
        int(meta["step"])
        meta["config"], meta["model_config"]
        if not isinstance(files, dict):
            raise TypeError(f"'files' is a {type(files).__name__}, not a table of sha256 digests")
    except FileNotFoundError:
        raise CorruptCheckpointError(f"{mpath} is missing: {ckpt} is not a complete checkpoint") from None
    except (json.JSONDecodeError, KeyError, TypeError, ValueError, RecursionError) as e:
        raise CorruptCheckpointError(f"{mpath} is corrupt ({type(e).__name__}: {' '.join(str(e).split())[:120]})") \
            from None
    except OSError as e:
        raise CorruptCheckpointError(f"{mpath} is unreadable ({e.strerror})") from None
    check_format(meta, mpath)
    if verify:
        damage = find_damage(ckpt, files)
        if damage is not None:
            f, what = damage
            if what == "missing":
                raise CorruptCheckpointError(f"checkpoint file {f} is missing (listed in {mpath})")
            if what == "outside":
                raise CorruptCheckpointError(f"{mpath} lists {str(f)!r:.120}, a path outside the "
                                             "checkpoint (absolute, '..' or a link out of it): refused, not opened")
            raise CorruptCheckpointError(f"checkpoint file {f} is corrupt: its sha256 does not match {mpath}")
    return meta
