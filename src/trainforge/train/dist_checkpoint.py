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
import torch.distributed as dist
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


def model_and_optim_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                          full: bool = False) -> dict[str, Any]:
    """FQN-keyed state (sharded DTensors unless ``full``; full states are gathered on every rank)."""
    opts = StateDictOptions(full_state_dict=full)
    return {"model": get_model_state_dict(model, options=opts),
            "optim": get_optimizer_state_dict(model, optimizer, options=opts)}


def save_sharded(path: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """Collective: every rank writes its shards under ``path / sharded``."""
    dcp.save(model_and_optim_state(model, optimizer), storage_writer=FileSystemWriter(str(path / SHARDED_DIR)))


def load_sharded(path: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None) -> None:
    """Collective when distributed (also works in one process): reshard ``path / sharded``
    into the current layout, in place."""
    if optimizer is not None:
        state = model_and_optim_state(model, optimizer)
    else:
        state = {"model": get_model_state_dict(model)}
    try:
        dcp.load(state, storage_reader=SafeFileSystemReader(str(path / SHARDED_DIR)), planner=SafeLoadPlanner())
    except CheckpointError:
        raise
    except Exception as e:  # DCP wraps per-rank failures in its own exception types
        raise CheckpointError(f"sharded checkpoint {path / SHARDED_DIR} does not fit this model/layout: {e}") from None
    set_model_state_dict(model, state["model"])
    if optimizer is not None:
        set_optimizer_state_dict(model, optimizer, state["optim"])


def load_full(model: torch.nn.Module, optimizer: torch.optim.Optimizer | None, model_sd: dict[str, torch.Tensor],
              optim_sd: dict[str, Any] | None) -> None:
    """Scatter full (unsharded) FQN-keyed state into a possibly sharded/split model.
    Keys the local module does not hold (other pipeline stages) are dropped first."""
    local_keys = set(get_model_state_dict(model).keys())
    missing = local_keys - set(model_sd)
    if missing:
        raise CheckpointError(f"checkpoint lacks parameters {sorted(missing)[:5]}... for this model")
    model_sd = {k: v for k, v in model_sd.items() if k in local_keys}
    opts = StateDictOptions(full_state_dict=True, strict=True)
    set_model_state_dict(model, model_sd, options=opts)
    if optimizer is not None and optim_sd is not None:
        optim_sd = {"state": {k: v for k, v in optim_sd["state"].items() if k in local_keys},
                    "param_groups": [{**g, "params": [p for p in g["params"] if p in local_keys]}
                                     for g in optim_sd["param_groups"]]}
        set_optimizer_state_dict(model, optimizer, optim_sd, options=opts)


def barrier() -> None:
    if dist.is_initialized():
        dist.barrier()
