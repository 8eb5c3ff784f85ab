"""Sharded checkpoints with ``torch.distributed.checkpoint`` (DCP), loadable at any layout.

A multi-process run saves model and optimizer state as DCP shards (``sharded/``, one
file per rank plus DCP's metadata); single-process runs keep the full-state format of
``checkpoint.py``. Both load into any layout: DCP reshards on load, and a full-state
checkpoint is scattered by ``set_model_state_dict(full_state_dict=True)``. State is
keyed by fully-qualified parameter names (``layers.3.attention.wq.weight``), which
stay stable under FSDP, TP, activation checkpointing and pipeline splitting.

Safety: DCP's stock reader unpickles its ``.metadata`` file and its stock planner
loads non-tensor items with ``weights_only=False``, so a crafted checkpoint could run
code. ``SafeFileSystemReader`` unpickles metadata with an allow-list of DCP's own
metadata classes, and ``SafeLoadPlanner`` loads non-tensor items with
``weights_only=True``. This part is hand-written because DCP offers no safe mode.
"""

from __future__ import annotations

import io
import pickle
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint._traverse import set_element  # DCP's own nested-dict setter
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from torch.distributed.tensor import DTensor, distribute_tensor

from trainforge.errors import CheckpointError

SHARDED_DIR = "sharded"

_ALLOWED_MODULE_PREFIXES = (
    "torch.distributed.checkpoint.",
    "torch.distributed._shard.",
)
_ALLOWED_GLOBALS = {
    ("torch", "Size"), ("collections", "OrderedDict"), ("builtins", "set"), ("builtins", "frozenset"),
    ("builtins", "slice"), ("torch._utils", "_rebuild_tensor_v2"), ("torch", "device"),
    ("torch.serialization", "_get_layout"), ("pathlib", "PosixPath"), ("pathlib", "PurePosixPath"),
}


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if module.startswith(_ALLOWED_MODULE_PREFIXES) or (module, name) in _ALLOWED_GLOBALS:
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise pickle.UnpicklingError(f"checkpoint metadata refers to {module}.{name}, which is not allowed")


class SafeFileSystemReader(FileSystemReader):
    def read_metadata(self, *args: Any, **kwargs: Any):
        rank = kwargs.get("rank")
        path = self._get_metadata_path(rank)
        with self.fs.create_stream(path, "rb") as fh:
            try:
                metadata = _MetadataUnpickler(fh).load()
            except (pickle.UnpicklingError, EOFError, AttributeError) as e:
                raise CheckpointError(f"{path}: unreadable or unsafe DCP metadata ({e})") from None
        from torch.distributed.checkpoint.metadata import StorageMeta

        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


class SafeLoadPlanner(DefaultLoadPlanner):
    def load_bytes(self, read_item, value: io.BytesIO) -> None:
        obj = torch.load(value, weights_only=True)
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], obj)
        else:
            self.state_dict[read_item.dest_index.fqn] = obj


def _as_list(x):
    return list(x) if isinstance(x, (list, tuple)) else [x]


def model_and_optim_state(parts, optimizers, full: bool = False) -> dict[str, Any]:
    """FQN-keyed state of one model or several pipeline parts (each with its optimizer).

    Optimizer state is flattened per parameter (``state.<fqn>.exp_avg``,
    ``param_groups.<fqn>.lr``), so it merges across parts and reshards across layouts.
    Sharded DTensors unless ``full`` (then full tensors, gathered on every rank)."""
    opts = StateDictOptions(full_state_dict=full, flatten_optimizer_state_dict=True)
    model: dict[str, Any] = {}
    optim: dict[str, Any] = {}
    for part, opt in zip(_as_list(parts), _as_list(optimizers)):
        model.update(get_model_state_dict(part, options=opts))
        optim.update(get_optimizer_state_dict(part, opt, options=opts))
    return {"model": model, "optim": optim}


def save_sharded(path: Path, parts, optimizers) -> None:
    """Collective: every rank writes its shards under ``path / sharded``."""
    dcp.save(model_and_optim_state(parts, optimizers), storage_writer=FileSystemWriter(str(path / SHARDED_DIR)))


def load_sharded(path: Path, parts, optimizers) -> None:
    """Collective when distributed (also works in one process): reshard ``path / sharded``
    into the current layout, in place. ``optimizers=None`` loads weights only."""
    parts = _as_list(parts)
    if optimizers is not None:
        optimizers = _as_list(optimizers)
        state = model_and_optim_state(parts, optimizers)
    else:
        state = {"model": {k: v for p in parts for k, v in get_model_state_dict(p).items()}}
    try:
        dcp.load(state, storage_reader=SafeFileSystemReader(str(path / SHARDED_DIR)), planner=SafeLoadPlanner())
    except CheckpointError:
        raise
    except Exception as e:  # DCP wraps per-rank failures in its own exception types
        raise CheckpointError(f"sharded checkpoint {path / SHARDED_DIR} does not fit this model/layout: {e}") from None
    _set_state(parts, optimizers, state["model"], state.get("optim"))


def _set_state(parts, optimizers, model_sd, optim_sd) -> None:
    """Load FQN-keyed state whose tensors already have the local layout."""
    opts = StateDictOptions(flatten_optimizer_state_dict=True, strict=False)
    for i, part in enumerate(parts):
        local = set(get_model_state_dict(part).keys())
        missing = local - set(model_sd)
        if missing:
            raise CheckpointError(f"checkpoint lacks parameters {sorted(missing)[:5]} for this model")
        set_model_state_dict(part, {k: v for k, v in model_sd.items() if k in local}, options=opts)
        if optimizers is not None and optim_sd is not None:
            set_optimizer_state_dict(part, optimizers[i], optim_sd, options=opts)


def _localize(full: dict[str, Any], local: dict[str, Any], what: str) -> dict[str, Any]:
    """Cut full tensors to this rank's layout: for each local DTensor, the matching full
    tensor is sharded with the same mesh and placements (every rank holds the full
    tensor, so no communication: ``src_data_rank=None``)."""
    out = {}
    for key, ref in local.items():
        if key not in full:
            raise CheckpointError(f"checkpoint {what} state lacks '{key}' needed by this model")
        value = full[key]
        if isinstance(ref, DTensor) and isinstance(value, torch.Tensor) and not isinstance(value, DTensor):
            value = distribute_tensor(value.to(ref.device), ref.device_mesh, ref.placements, src_data_rank=None)
        elif isinstance(ref, torch.Tensor) and isinstance(value, torch.Tensor):
            value = value.to(ref.device)
        out[key] = value
    return out


def load_full(parts, optimizers, model_sd: dict[str, torch.Tensor], optim_sd: dict[str, Any] | None) -> None:
    """Load full (unsharded) FQN-keyed state into a possibly sharded / split model.
    Keys the local parts do not hold (other pipeline stages) are ignored."""
    parts = _as_list(parts)
    optimizers = None if optimizers is None else _as_list(optimizers)
    if optimizers is not None and optim_sd is not None:
        local = model_and_optim_state(parts, optimizers)
        _set_state(parts, optimizers, _localize(model_sd, local["model"], "model"),
                   _localize(optim_sd, local["optim"], "optimizer"))
    else:
        local = {k: v for p in parts for k, v in get_model_state_dict(p).items()}
        _set_state(parts, None, _localize(model_sd, local, "model"), None)
