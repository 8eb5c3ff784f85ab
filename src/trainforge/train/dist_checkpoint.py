"""Sharded checkpoints with ``torch.distributed.checkpoint`` (DCP), loadable at any layout.

A multi-process run saves model and optimizer state as DCP shards (``sharded/``, one
file per rank plus DCP's metadata); single-process runs keep the full-state format of
``checkpoint.py``. Both load into any layout: DCP reshards on load, and a full-state
checkpoint is scattered by ``set_model_state_dict(full_state_dict=True)``. State is
keyed by fully-qualified parameter names (``layers.3.attention.wq.weight``), which
stay stable under FSDP, TP, activation checkpointing and pipeline splitting.

Safety: DCP's stock reader unpickles its ``.metadata`` file with a bare ``pickle.load``
and its stock planner loads non-tensor items with ``weights_only=False``, so a crafted
checkpoint could run code. ``SafeFileSystemReader`` reads the metadata through
``trainforge.safe_unpickle`` (an exact allow-list of the globals DCP metadata holds) and
``SafeLoadPlanner`` loads non-tensor items with ``weights_only=True``; a refused or
unreadable file is one ``CheckpointError`` naming it, not DCP's per-rank traceback.
This part is hand-written because DCP offers no safe mode.
"""

from __future__ import annotations

import dataclasses
import io
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import CheckpointException, FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint._traverse import set_element  # DCP's own nested-dict setter
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.futures import Future

from torch.distributed.tensor import DTensor, distribute_tensor

from trainforge.errors import CheckpointError
from trainforge.safe_unpickle import error_detail, load_dcp_metadata, refused_message
from trainforge.storage.manifest import contained
from trainforge.train.state_checks import check_like

SHARDED_DIR = "sharded"


class SafeFileSystemReader(FileSystemReader):
    """DCP's file reader, reading ``.metadata`` through the allow-list (once: ``dcp.load``
    asks again) and naming the shard file any read fails in."""

    _metadata = None

    def read_metadata(self, *args: Any, **kwargs: Any):
        if kwargs.get("rank") is not None:  # per-rank metadata: trainforge never writes it
            raise CheckpointError(f"{self.path}: per-rank DCP metadata is not supported")
        if self._metadata is None:
            self._metadata = load_dcp_metadata(self._get_metadata_path())
            self._check_storage(self._metadata)
        metadata = self._metadata
        from torch.distributed.checkpoint.metadata import StorageMeta

        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata

    def _check_storage(self, metadata) -> None:
        """Every byte range ``metadata`` points at lies inside a file of this directory, read
        as written: before any is opened, a ``relative_path`` that leads out (absolute, ``..``,
        a link), a range past the end of its file or a transform (trainforge writes none: a
        decompressor would be a bomb) is one line naming ``.metadata``."""
        where = self._get_metadata_path()
        sizes: dict[str, int] = {}
        files: dict[str, Path] = {}
        storage = getattr(metadata, "storage_data", None)
        if not isinstance(storage, dict):
            raise CheckpointError(refused_message(where, "it has no storage table"))
        for info in storage.values():
            rel = getattr(info, "relative_path", None)
            if rel not in sizes:
                f = contained(Path(self.path), rel)
                if f is None or not f.is_file():
                    why = "a path outside the checkpoint" if f is None else "a file that is not there"
                    raise CheckpointError(refused_message(where, f"relative_path {rel!r:.80} is {why}"))
                sizes[rel], files[rel] = f.stat().st_size, f
            offset, length = getattr(info, "offset", None), getattr(info, "length", None)
            if not all(isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in (offset, length)):
                raise CheckpointError(refused_message(where, f"byte range {offset!r:.30} +{length!r:.30} of {rel}"))
            if offset + length > sizes[rel]:  # the shard cut short, or the metadata lying: both named
                raise CheckpointError(refused_message(files[rel], f"{where} places bytes [{offset}, +{length}) in it, "
                                                                  f"outside its {sizes[rel]} bytes"))
            if getattr(info, "transform_descriptors", None):
                raise CheckpointError(refused_message(where, f"{rel} is stored through transforms "
                                                             f"{info.transform_descriptors!r:.80}"))

    def read_data(self, plan, planner) -> Future[None]:
        per_file: dict[str, list] = {}
        for item in plan.items:
            per_file.setdefault(self.storage_data[item.storage_index].relative_path, []).append(item)
        for relative_path, items in per_file.items():
            try:
                super().read_data(dataclasses.replace(plan, items=items), planner).wait()
            except CheckpointError:
                raise
            except Exception as e:  # torch.load, a bad offset, a transform: all mean "unusable file"
                raise CheckpointError(refused_message(self.fs.concat_path(self.path, relative_path),
                                                      error_detail(e))) from None
        fut: Future[None] = Future()
        fut.set_result(None)
        return fut


class SafeLoadPlanner(DefaultLoadPlanner):
    def load_bytes(self, read_item, value: io.BytesIO) -> None:
        obj = torch.load(value, weights_only=True)
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], obj)
        else:
            self.state_dict[read_item.dest_index.fqn] = obj


def _unwrap(e: BaseException) -> CheckpointError | None:
    """The first ``CheckpointError`` of any rank inside DCP's ``CheckpointException``."""
    if isinstance(e, CheckpointException):
        for exc, _ in e.failures.values():
            if isinstance(exc, CheckpointError):
                return exc
    return None


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
    reader = SafeFileSystemReader(str(path / SHARDED_DIR))
    reader.read_metadata()  # a refused .metadata fails here, before DCP wraps errors per rank
    # DCP copies a tensor into the one it replaces (its shape checked), but an entry the metadata
    # calls bytes is unpickled and put in its place: checked below against what was there.
    before = {section: dict(values) for section, values in state.items()}
    try:
        dcp.load(state, storage_reader=reader, planner=SafeLoadPlanner())
    except CheckpointError:
        raise
    except (Exception, CheckpointException) as e:  # DCP's is a BaseException holding every rank's error
        inner = _unwrap(e)
        if inner is not None:
            raise inner from None
        if isinstance(e, CheckpointException):
            e = next(iter(e.failures.values()))[0]
        raise CheckpointError(f"sharded checkpoint {path / SHARDED_DIR} does not fit this model/layout "
                              f"({error_detail(e)})") from None
    for section, values in before.items():
        for key, ref in values.items():
            check_like(state[section][key], ref, path / SHARDED_DIR, f"{section} state {key!r}")
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


def _localize(full: dict[str, Any], local: dict[str, Any], what: str, source: Path | str) -> dict[str, Any]:
    """Cut full tensors to this rank's layout: for each local DTensor, the matching full
    tensor is sharded with the same mesh and placements (every rank holds the full
    tensor, so no communication: ``src_data_rank=None``). Each value is checked against the
    one it replaces first (``check_like``: read from ``source``, it reaches fused kernels)."""
    out = {}
    for key, ref in local.items():
        if key not in full:
            raise CheckpointError(f"checkpoint {what} state lacks '{key}' needed by this model")
        value = full[key]
        check_like(value, ref, source, f"{what} state {key!r}")
        if isinstance(ref, DTensor) and isinstance(value, torch.Tensor) and not isinstance(value, DTensor):
            value = distribute_tensor(value.to(ref.device), ref.device_mesh, ref.placements, src_data_rank=None)
        elif isinstance(ref, torch.Tensor) and isinstance(value, torch.Tensor):
            value = value.to(ref.device)
        out[key] = value
    return out


def load_full(parts, optimizers, model_sd: dict[str, torch.Tensor], optim_sd: dict[str, Any] | None,
              sources: tuple[Path | str, Path | str] = ("model state", "optimizer state")) -> None:
    """Load full (unsharded) FQN-keyed state into a possibly sharded / split model.
    Keys the local parts do not hold (other pipeline stages) are ignored. ``sources``: the
    files the model and optimizer state came from, named when a value does not fit."""
    parts = _as_list(parts)
    optimizers = None if optimizers is None else _as_list(optimizers)
    if optimizers is not None and optim_sd is not None:
        local = model_and_optim_state(parts, optimizers)
        _set_state(parts, optimizers, _localize(model_sd, local["model"], "model", sources[0]),
                   _localize(optim_sd, local["optim"], "optimizer", sources[1]))
    else:
        local = {k: v for p in parts for k, v in get_model_state_dict(p).items()}
        _set_state(parts, None, _localize(model_sd, local, "model", sources[0]), None)
