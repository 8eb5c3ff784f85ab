"""Activations saved for backward: store them in a lower dtype, and/or count their bytes.

Both are ``torch.autograd.graph.saved_tensors_hooks``: the pack hook sees every tensor
autograd keeps for backward. Storing an fp32 activation as bf16 halves its memory
while every op still computes in fp32 (backward reads the rounded copy back as fp32:
the gradient error is that of bf16 autocast, the speed that of fp32). The policy uses
this when slow hardware keeps compute in fp32 (``policy.activation_dtype``).

Weights and buffers are never packed: their copy would add memory, not save it.
Only one ``saved_tensors_hooks`` pair is active at a time (the innermost), so the
byte counter and the packing live in one pack hook.
"""

from __future__ import annotations

import contextlib
from collections import defaultdict

import torch
from torch import nn
from torch.distributed.tensor import DTensor
from torch.utils.weak import WeakIdKeyDictionary

from trainforge.precision.hardware import DTYPE_NAMES


def _local(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard (what this rank stores; a DTensor has no storage of its
    own), any other tensor itself. No autograd: pack hooks run outside the graph."""
    return t._local_tensor if isinstance(t, DTensor) else t


def _storage(t: torch.Tensor) -> torch.UntypedStorage | None:
    """The storage this rank holds for ``t`` (a DTensor's local shard); None for wrapper
    subclasses that have none (sequence parallelism's async-collective results)."""
    try:
        storage = _local(t).untyped_storage()
        storage.data_ptr()
        return storage
    except (RuntimeError, NotImplementedError):
        return None


def _dense(t: torch.Tensor) -> bool:
    """Contiguous, or a permutation covering its whole storage (SDPA saves transposed
    q/k/v): ``.to`` keeps such strides. Expanded or sliced views would be copied into
    more memory than they hold, so they stay as they are."""
    return t.is_contiguous() or t.untyped_storage().nbytes() == t.numel() * t.element_size()


def dtype_label(dtype: torch.dtype) -> str:
    return DTYPE_NAMES.get(dtype, str(dtype).removeprefix("torch."))


class SavedActivations:
    """``store_dtype``: pack floating activations of higher precision into this dtype
    (None = keep as computed). ``min_numel``: smaller tensors are not worth a cast.
    ``context(track=True)`` also counts the bytes held for backward, per stored dtype,
    into ``bytes_by_dtype`` (reset on each entry)."""

    def __init__(self, model: nn.Module, store_dtype: torch.dtype | None = None, min_numel: int = 1024):
        self.model, self.store_dtype, self.min_numel = model, store_dtype, min_numel
        self.bytes_by_dtype: dict[str, int] = {}
        self._track = False
        self._seen: dict[int | tuple[str, int], object] = {}
        self._packed = WeakIdKeyDictionary()
        self._skip: set[int] = set()

    def _is_weight(self, t: torch.Tensor) -> bool:
        storage = _storage(t)
        if storage is not None and storage.data_ptr() in self._skip:
            return True
        # Parameters gathered per forward (FSDP2) have fresh storage: recognise them as leaves
        # that require grad, or views of one (linear saves weight.t()).
        base = t._base if t._base is not None else t
        return base.requires_grad and base.is_leaf

    def _pack(self, t: torch.Tensor):
        out = t
        if (self.store_dtype is not None and t.is_floating_point() and t.dtype.itemsize > self.store_dtype.itemsize
                and t.numel() >= self.min_numel and _storage(t) is not None and _dense(_local(t))
                and not self._is_weight(t)):
            # One copy per tensor even when several ops save it (x feeds wq, wk and wv).
            # Keyed weakly on the tensor object: a freed tensor's address can be reused.
            packed = self._packed.get(t)
            if packed is None:
                packed = t.detach().to(self.store_dtype)
                self._packed[t] = packed
            out = (packed, t.dtype)
        if self._track:
            stored = _local(out[0] if isinstance(out, tuple) else out)
            if not self._is_weight(t):
                storage = _storage(stored)
                # Keyed by address (no storage: by object); held until the context exits,
                # so no address or id is reused while counting.
                key = storage.data_ptr() if storage is not None else ("id", id(stored))
                if key not in self._seen:
                    self._seen[key] = storage if storage is not None else stored
                    nbytes = storage.nbytes() if storage is not None else stored.numel() * stored.element_size()
                    self.bytes_by_dtype[dtype_label(stored.dtype)] = (
                        self.bytes_by_dtype.get(dtype_label(stored.dtype), 0) + nbytes)
        return out

    @staticmethod
    def _unpack(packed) -> torch.Tensor:
        if isinstance(packed, tuple):
            tensor, dtype = packed
            return tensor.to(dtype)
        return packed

    @contextlib.contextmanager
    def context(self, track: bool = False):
        """Wrap the forward pass. Backward needs no context: the unpack hook travels
        with each saved tensor."""
        if self.store_dtype is None and not track:
            yield self
            return
        self._skip = {st.data_ptr() for t in [*self.model.parameters(), *self.model.buffers()]
                      if (st := _storage(t)) is not None}
        self._track = track
        if track:
            self.bytes_by_dtype = defaultdict(int)
        try:
            with torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack):
                yield self
        finally:
            self._track = False
            self._seen.clear()
            self._packed = WeakIdKeyDictionary()
            self.bytes_by_dtype = dict(self.bytes_by_dtype)
