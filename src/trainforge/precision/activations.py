"""Activations saved for backward: store them in a lower dtype, and/or count their bytes.

Both are ``torch.autograd.graph.saved_tensors_hooks``: the pack hook sees every tensor
autograd keeps for backward. Storing an fp32 activation as bf16 halves its memory
while every op still computes in fp32 (backward reads the rounded copy back as fp32:
the gradient error is that of bf16 autocast, the speed that of fp32). The policy uses
this when slow hardware keeps compute in fp32, and under bf16/fp16 compute for what
autocast leaves in fp32: the fp32 modules' internals (norm inputs and normalised
outputs) and the fp32 residual stream they save. Packing applies only inside the
model's forward: the loss's saved log-probabilities stay fp32.

``recast_weights`` (fp32 weights under autocast, unsharded): autocast's bf16 copy of a
weight is saved by its matmul for backward, so fp32 weights *and* a bf16 copy of every
weight stay alive from the forward to the backward (2 extra bytes per parameter at the
peak). The pack hook keeps a reference to the fp32 parameter instead and backward
recasts it (bit-identical: the same rounding of the same, unchanged weight). Autocast's
weight-cast cache must be off for this (``cache_enabled=False``), or the cache itself
holds the copies until the forward ends.

Autocast casts an activation again for every matmul that reads it (wq, wk and wv each
cast the normalised input to bf16, and each saves its own copy). The pack hook keeps
the first copy and hands it to the others: the casts are identical, the rest are freed.

Weights and buffers are never packed: their copy would add memory, not save it.
Only one ``saved_tensors_hooks`` pair is active at a time (the innermost), so the
byte counter and the packing live in one pack hook.
"""

from __future__ import annotations

import contextlib
import weakref
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


class _Recast:
    """A saved low-precision copy of a parameter, kept as the parameter itself: backward
    casts it again. ``version``: the parameter's version counter at pack time (an in-place
    update before backward would make the recast differ from what the forward used)."""

    __slots__ = ("param", "dtype", "size", "stride", "offset", "version")

    def __init__(self, param: torch.Tensor, dtype: torch.dtype, view: torch.Tensor):
        self.param, self.dtype, self.version = param, dtype, param._version
        self.size, self.stride, self.offset = view.size(), view.stride(), view.storage_offset()

    def unpack(self) -> torch.Tensor:
        if self.param._version != self.version:
            raise RuntimeError("a parameter was modified in place between forward and backward; its "
                               "low-precision copy cannot be recast (precision recast_weights)")
        # ``.to`` keeps the parameter's (dense) strides, so the view's geometry applies unchanged.
        return self.param.detach().to(self.dtype).as_strided(self.size, self.stride, self.offset)


def _view_in(t: torch.Tensor, base: torch.Tensor) -> tuple[torch.Size, tuple[int, ...], int]:
    """(size, stride, storage offset relative to ``base``) of ``t``, a view of ``base``: what
    ``as_strided`` needs to take the same view of a copy laid out like ``base``."""
    return t.size(), t.stride(), t.storage_offset() - base.storage_offset()


def _cast_of(t: torch.Tensor) -> tuple[torch.Tensor, object, int] | None:
    """(base, source autograd node, its output nr) when ``t``, or the tensor it is a view
    of, is a dtype cast (``ToCopyBackward0``: autocast's copies), else None."""
    base = t._base if t._base is not None else t
    fn = base.grad_fn
    if fn is None or type(fn).__name__ != "ToCopyBackward0" or not fn.next_functions:
        return None
    source, nr = fn.next_functions[0]
    return base, source, nr


def _cast_parameter(t: torch.Tensor) -> torch.Tensor | None:
    """The plain (non-DTensor) parameter ``t`` is a dtype cast of (autocast's copy, or a
    view of it such as linear's ``weight.t()``), else None."""
    cast = _cast_of(t)
    if cast is None:
        return None
    base, source, _ = cast
    param = getattr(source, "variable", None)  # AccumulateGrad of a leaf
    if (isinstance(param, nn.Parameter) and not isinstance(param, DTensor) and param.dtype != base.dtype
            and param.shape == base.shape):
        return param
    return None


class SavedActivations:
    """``store_dtype``: pack floating activations of higher precision into this dtype
    (None = keep as computed), inside ``model``'s forward only. ``min_numel``: smaller
    tensors are not worth a cast. ``recast_weights``: keep autocast's saved weight
    copies as references to the parameters (see the module docstring).
    ``context(track=True)`` also counts the bytes held for backward, per stored dtype,
    into ``bytes_by_dtype`` (reset on each entry)."""

    def __init__(self, model: nn.Module, store_dtype: torch.dtype | None = None, min_numel: int = 1024,
                 recast_weights: bool = False):
        self.model, self.store_dtype, self.min_numel = model, store_dtype, min_numel
        self.recast_weights = recast_weights
        self._casts: dict[tuple, weakref.ref] = {}  # (source autograd node, output nr, dtype) -> first cast
        self._in_model = 0  # depth of model forwards running (re-entrant under checkpoint recompute)
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
        if self.recast_weights and (param := _cast_parameter(t)) is not None:
            return _Recast(param, t.dtype, t)  # nothing stored: not counted
        t = self._first_cast(t)
        out = t
        if (self.store_dtype is not None and self._in_model and t.is_floating_point() and t.dtype.itemsize > self.store_dtype.itemsize
                and t.numel() >= self.min_numel and _storage(t) is not None and _dense(_local(t))
                and not self._is_weight(t)):
            # One copy per tensor even when several ops save it: x feeds wq, wk and wv, and
            # each linear saves its own 2-D view of x, so the copy is keyed on the view's
            # base (a dense view covers the whole base) and handed out with the view's
            # geometry. Keyed weakly on the tensor object: a freed tensor's address can be reused.
            base = t._base if t._base is not None and _dense(_local(t._base)) else t
            packed = self._packed.get(base)
            if packed is None:
                packed = base.detach().to(self.store_dtype)
                self._packed[base] = packed
            if base is t:
                out = (packed, t.dtype)
            elif packed.stride() == base.stride():  # ``.to`` keeps a dense tensor's strides
                out = (packed, t.dtype, *_view_in(t, base))
            else:
                out = (t.detach().to(self.store_dtype), t.dtype)
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

    def _first_cast(self, t: torch.Tensor) -> torch.Tensor:
        """The first saved copy of the same cast of the same tensor (as ``t``'s view of it:
        linear saves a 3-D input as a 2-D view), else ``t`` itself."""
        cast = _cast_of(t)
        if cast is None:
            return t
        base, source, nr = cast
        if source is None:  # cast of a tensor that needs no gradient: no node to key on
            return t
        # The node objects stay referenced here until the context exits (their ids cannot be
        # reused); the casts only weakly: a pipeline schedule runs backward inside the context.
        key = (source, nr, base.dtype)
        ref = self._casts.get(key)
        first = ref() if ref is not None else None
        if first is None:
            self._casts[key] = weakref.ref(base)
            return t
        if first is base or first.shape != base.shape or first.stride() != base.stride():
            return t
        if t is base:
            return first
        size, stride, offset = _view_in(t, base)
        return first.as_strided(size, stride, first.storage_offset() + offset)

    @staticmethod
    def _unpack(packed) -> torch.Tensor:
        if isinstance(packed, _Recast):
            return packed.unpack()
        if isinstance(packed, tuple):
            tensor, dtype, *view = packed
            return tensor.to(dtype).as_strided(*view) if view else tensor.to(dtype)
        return packed

    def _enter_model(self, module: nn.Module, args) -> None:
        self._in_model += 1

    def _exit_model(self, module: nn.Module, args, output) -> None:
        self._in_model = max(0, self._in_model - 1)

    @contextlib.contextmanager
    def context(self, track: bool = False):
        """Wrap the forward pass. Backward needs no context: the unpack hook travels
        with each saved tensor."""
        if self.store_dtype is None and not track and not self.recast_weights:
            yield self
            return
        handles = []
        if self.store_dtype is not None:
            handles = [self.model.register_forward_pre_hook(self._enter_model),
                       self.model.register_forward_hook(self._exit_model, always_call=True)]
        self._skip = {st.data_ptr() for t in [*self.model.parameters(), *self.model.buffers()]
                      if (st := _storage(t)) is not None}
        self._track = track
        if track:
            self.bytes_by_dtype = defaultdict(int)
        try:
            with torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack):
                yield self
        finally:
            for h in handles:
                h.remove()
            self._in_model = 0
            self._casts.clear()
            self._track = False
            self._seen.clear()
            self._packed = WeakIdKeyDictionary()
            self.bytes_by_dtype = dict(self.bytes_by_dtype)
