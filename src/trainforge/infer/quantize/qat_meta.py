"""The quantisation grid a QAT run trained against, as its checkpoint records it.

A QAT run (``[qat]``, ``train/qat.py``) writes its resolved config into every checkpoint's
``meta.json``, ``qat`` table included. Its weights were trained against one grid (int8 per
row, or int4 with one group size); serving them on another throws the training away, so
``generate`` / ``serve`` / ``quantize`` / ``export`` quantise a QAT checkpoint with the
recorded grid unless told otherwise (``resolve_quantize``). Reads meta.json only: no weights.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from trainforge.errors import CheckpointError
from trainforge.storage.checkpoint_dirs import is_hf_dir, resolve_checkpoint
from trainforge.storage.checkpoint_format import META, read_meta

DEFAULT_GROUP_SIZE = 128  # quantize's and --quantize's default


def qat_scheme_of(checkpoint_dir: str | Path) -> dict[str, Any] | None:
    """The grid a QAT checkpoint was trained against: ``{"mode": "int8" | "int4",
    "group_size": int (int4 only), "start_step": int, "qat_steps": int}``, or None for a
    checkpoint of a run without QAT, one saved before its first QAT step (its weights never
    saw the grid), a quantised checkpoint, a Hugging Face directory or a GGUF file. ``checkpoint_dir``:
    a checkpoint, ``checkpoints/`` or run directory (the newest checkpoint, as ``load_model``)."""
    path = Path(checkpoint_dir)
    if is_hf_dir(path) or path.suffix == ".gguf":  # neither records a QAT run
        return None
    ck = resolve_checkpoint(path)
    meta = read_meta(ck, verify=False)  # loading verifies the files; only the config is read here
    if meta.get("quantization"):
        return None  # already quantised: its info is the grid
    qat = (meta.get("config") or {}).get("qat")
    if not isinstance(qat, dict) or qat.get("scheme", "none") == "none":
        return None
    try:
        mode, start, step = str(qat["scheme"]), int(qat.get("start_step", 0)), int(meta["step"])
        out: dict[str, Any] = {"mode": mode, "start_step": start, "qat_steps": step - start}
        if qat.get("activations", "none") != "none":
            out["activations"] = str(qat["activations"])
        if mode == "int4":
            out["group_size"] = int(qat["group_size"])
    except (KeyError, TypeError, ValueError) as e:
        raise CheckpointError(f"{ck / META}: its qat table is not a QAT scheme ({e!r})") from None
    if mode not in ("int8", "int4"):
        raise CheckpointError(f"{ck / META}: qat.scheme {mode!r} is not int8 or int4")
    return out if step > start else None


def resolve_quantize(requested: str, group_size: int | None, recorded: dict[str, Any] | None,
                     what: str = "--quantize") -> tuple[str, int, str | None]:
    """(mode, group_size, note) for a load-time quantisation request. ``requested``: "auto"
    (the recorded QAT grid, else none), "none", "int8" or "int4"; ``group_size``: None =
    the recorded one (else 128). The recorded grid wins silently when the request matches
    it; ``none`` on a QAT checkpoint serves float weights with a note (a float baseline is
    a fair thing to want); any other grid is refused (ValueError naming the fix): the
    weights were trained for the recorded one."""
    if recorded is None:
        return ("none" if requested == "auto" else requested), group_size or DEFAULT_GROUP_SIZE, None
    rec_mode, rec_group = recorded["mode"], recorded.get("group_size")
    trained = f"{rec_mode}" + (f" group_size {rec_group}" if rec_group else "")
    if requested == "none":
        return "none", group_size or DEFAULT_GROUP_SIZE, (
            f"{what} none: serving the float weights of a QAT run trained for {trained} (their quantised form is "
            f"what the run optimised; {what} auto uses it)")
    mode = rec_mode if requested == "auto" else requested
    gs = group_size or rec_group or DEFAULT_GROUP_SIZE
    if mode != rec_mode or (mode == "int4" and gs != rec_group):
        asked = f"{mode}" + (f" group_size {gs}" if mode == "int4" else "")
        fix = f"{what} {rec_mode}" + (f" --group_size {rec_group}" if rec_group else "")
        raise ValueError(f"{what} {asked}: this checkpoint was trained with QAT for {trained}; another grid "
                         f"discards that training. Use {fix}" + (f" (or {what} auto), or {what} none for the "
                                                                 "float weights" if what == "--quantize" else ""))
    return mode, gs, None
