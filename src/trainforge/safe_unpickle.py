"""Reading checkpoint pickles without ever running code: an exact (module, name) allow-list.

A pickle names each callable it needs as a (module, name) pair and the unpickler
imports it; ``pickle.Unpickler.find_class`` walks a *dotted* name attribute by
attribute (protocol 4+), so a check on the module alone (``torch.distributed.checkpoint.*``)
lets (``torch.distributed.checkpoint.filesystem``, ``os.system``) through, since that
module imports ``os``. Here each pair is looked up in a fixed mapping to the object
itself: nothing is imported and no attribute is walked, so any pair outside the
mapping, dotted or not, is refused, and so are persistent ids (the pickles read here
have none).

Two readers, one per kind of pickle a trainforge checkpoint holds:

* ``load_tensor_file``: ``torch.save`` files (``train_state.pt``, ``rng/rank_*.pt``,
  ``compression/rank_*.pt``) through ``torch.load(weights_only=True)``, torch's own
  allow-list unpickler for tensors and plain containers.
* ``load_dcp_metadata``: DCP's ``.metadata``, which DCP's stock reader loads with a bare
  ``pickle.load``. ``DCP_METADATA_GLOBALS`` lists exactly the globals it holds.

Any failure (a refused global, a truncated or garbage file: unpickling errors come in
many types) becomes one ``CheckpointError`` line naming the file. Hand-written because
neither ``pickle`` nor DCP offers an allow-list unpickler. Neutral module (imports only
torch and ``trainforge.errors``), so ``train/`` and ``infer/`` can both use it.
"""

from __future__ import annotations

import io
import pickle
import re
from pathlib import Path
from typing import IO, Any, Mapping

import torch

from trainforge.errors import CheckpointError

Allowed = Mapping[tuple[str, str], Any]

_DCP_MD = "torch.distributed.checkpoint.metadata"
# What ``pickletools.genops`` finds in the ``.metadata`` of real checkpoints saved by torch
# 2.13 (DDP, FSDP2 with fp16-mixed, TP: the same 13 globals each), plus the alternatives
# marked. Resolved by ``dcp_metadata_allowed`` (DCP's import costs seconds: only when needed).
DCP_METADATA_GLOBALS: frozenset[tuple[str, str]] = frozenset({
    (_DCP_MD, "Metadata"), (_DCP_MD, "StorageMeta"), (_DCP_MD, "MetadataIndex"),
    (_DCP_MD, "TensorStorageMetadata"), (_DCP_MD, "BytesStorageMetadata"), (_DCP_MD, "ChunkStorageMetadata"),
    (_DCP_MD, "TensorProperties"), (_DCP_MD, "_MEM_FORMAT_ENCODING"),
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),  # a layout by name: a dict lookup
    ("pathlib", "PosixPath"),  # StorageMeta.checkpoint_id
    ("pathlib._local", "PosixPath"),  # alternative: the same class as Python 3.13 pickles it (CPython gh-133789)
    # Tensor dtypes, pickled by name: float32 is what those runs store; alternatives: bf16 and
    # fp16, the other dtypes [precision] can give a parameter or optimizer state (DTYPE_NAMES).
    ("torch", "float32"), ("torch", "bfloat16"), ("torch", "float16"),
})


def dcp_metadata_allowed() -> dict[tuple[str, str], Any]:
    """``DCP_METADATA_GLOBALS`` mapped to the objects themselves (imported here, by us)."""
    import pathlib

    from torch.distributed.checkpoint import filesystem, metadata
    from torch.serialization import _get_layout

    allowed: dict[tuple[str, str], Any] = {(_DCP_MD, name): getattr(metadata, name) for m, name in
                                           DCP_METADATA_GLOBALS if m == _DCP_MD}
    allowed.update({
        ("torch.distributed.checkpoint.filesystem", "_StorageInfo"): filesystem._StorageInfo,
        ("torch", "Size"): torch.Size,
        ("torch.serialization", "_get_layout"): _get_layout,
        ("pathlib", "PosixPath"): pathlib.PosixPath,
        ("pathlib._local", "PosixPath"): pathlib.PosixPath,
        ("torch", "float32"): torch.float32, ("torch", "bfloat16"): torch.bfloat16,
        ("torch", "float16"): torch.float16,
    })
    assert allowed.keys() == DCP_METADATA_GLOBALS  # one list, resolved once each
    return allowed


def refused_problem(path: str | Path, detail: str) -> str:
    """What is wrong with a refused or unreadable checkpoint file, without the fix."""
    return (f"checkpoint file {path} is refused: it is not a trainforge/DCP checkpoint file, or it was "
            f"tampered with or damaged ({detail})")


def refused_message(path: str | Path, detail: str) -> str:
    """The one line every refused or unreadable checkpoint file gets."""
    return f"{refused_problem(path, detail)}; use an earlier checkpoint"


def error_detail(e: BaseException) -> str:
    """One short line from an unpickling error (torch's weights-only errors span many lines)."""
    text = str(e)
    m = re.search(r"WeightsUnpickler error: (.*)", text)
    line = " ".join((m.group(1) if m else text).split())  # one line: torch's messages span many
    if len(line) > 240:
        line = line[:237] + "..."
    return f"{type(e).__name__}: {line}" if line else type(e).__name__


class _RestrictedUnpickler(pickle.Unpickler):
    def __init__(self, file: IO[bytes], allowed: Allowed, path: str | Path):
        super().__init__(file)
        self._allowed, self._path = allowed, path

    def find_class(self, module: str, name: str) -> Any:
        # Called for GLOBAL, STACK_GLOBAL and INST alike (and the EXT* opcodes).
        try:
            return self._allowed[(module, name)]
        except (KeyError, TypeError):
            why = "a dotted name" if "." in str(name) else "not on the allow-list"
            raise CheckpointError(refused_message(self._path, f"it names the global ({module!r:.80}, {name!r:.80}), "
                                                              f"{why}")) from None

    def persistent_load(self, pid: Any) -> Any:
        raise CheckpointError(refused_message(self._path, "it holds a persistent id"))


def load_pickle(file: IO[bytes] | bytes, path: str | Path, allowed: Allowed) -> Any:
    """Unpickle ``file`` resolving globals only through ``allowed``; ``path`` names it in errors."""
    if isinstance(file, (bytes, bytearray)):
        file = io.BytesIO(file)
    try:
        return _RestrictedUnpickler(file, allowed, path).load()
    except CheckpointError:
        raise
    except Exception as e:  # UnpicklingError, EOFError, ValueError, TypeError, MemoryError, ...
        raise CheckpointError(refused_message(path, error_detail(e))) from None


def load_dcp_metadata(path: str | Path) -> Any:
    """DCP's ``.metadata`` at ``path``, checked to be a ``Metadata``."""
    try:
        with open(path, "rb") as fh:
            md = load_pickle(fh, path, dcp_metadata_allowed())
    except OSError as e:
        raise CheckpointError(f"checkpoint file {path} could not be read: {error_detail(e)}") from None
    from torch.distributed.checkpoint.metadata import Metadata

    if not isinstance(md, Metadata):
        raise CheckpointError(refused_message(path, f"it holds a {type(md).__name__}, not DCP Metadata"))
    return md


def load_tensor_file(path: str | Path, map_location: str | torch.device = "cpu") -> Any:
    """A ``torch.save`` file of tensors and plain containers (``torch.load(weights_only=True)``)."""
    try:
        return torch.load(path, map_location=map_location, weights_only=True)
    except Exception as e:  # unpickling errors come in many types; all mean "unusable file"
        raise CheckpointError(refused_message(path, error_detail(e))) from None
