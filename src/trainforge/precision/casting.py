"""Apply a ``PrecisionPolicy`` to a single-device model from outside: parameter storage
casts plus per-module autocast rules. The model code is not touched.

- The trainer runs the forward under ``runtime.autocast()``: ``torch.autocast`` in the
  compute dtype (matmuls low, reductions and softmax-class ops fp32 by autocast's own
  op lists), plus the saved-activation storage hooks where the policy asks for them.
- Modules matched by the fp32 rules get their ``forward`` wrapped (an instance
  attribute; no wrapper module, so parameter names are unchanged): autocast off and
  floating inputs cast to fp32, inside one ``with`` block, which dynamo can trace
  (``parallel.compile``) and which restores the outer state when forward raises. Their
  outputs stay fp32: autocast casts them at the next matmul, and casting back would
  throw away what the rule bought (a loss, router logits fed to top-k).
- Module groups of the dynamic policy get the same wrapper with a switchable dtype,
  read at call time from ``runtime.compute_dtypes`` (a dict: no host sync; a compiled
  block recompiles on a switch); their outputs are cast back to their inputs' dtype, so
  groups in different precisions compose.
- Rotary embeddings need no rule: their cos/sin tables are buffers, which are never
  cast, and ``x * cos`` promotes to fp32. Softmax inside SDPA accumulates in fp32 in
  torch's kernels for bf16/fp16 inputs.

Call ``apply_precision`` first, before tensor parallel, activation checkpointing,
compile and FSDP (``parallel/apply.py``): checkpointing, compile and FSDP keep the
wrapped ``forward`` (compile traces through it), and the master-weight copy must be
taken from the unwrapped fp32 model.
"""

from __future__ import annotations

import contextlib
import types
from typing import Any, Callable

import torch
from torch import nn

from trainforge.precision.activations import SavedActivations
from trainforge.precision.hardware import DTYPES
from trainforge.precision.master_weights import MasterWeights
from trainforge.precision.policy import DEFAULT_GROUP, FP32, PrecisionPolicy, outermost_matches


def autocast_context(dtype: torch.dtype, device_type: str, cache_enabled: bool = True):
    """``torch.autocast`` in ``dtype``; a no-op context for fp32. ``cache_enabled=False``:
    no weight-cast cache (each use casts; what backward needs is kept by the saved-tensor
    hooks, see ``activations.py``). Nested autocast contexts inherit the setting."""
    if dtype == FP32:
        return contextlib.nullcontext()
    return torch.autocast(device_type, dtype=dtype, cache_enabled=cache_enabled)


def _cast_floats(obj: Any, dtype: torch.dtype) -> Any:
    if isinstance(obj, torch.Tensor):
        return obj.to(dtype) if obj.is_floating_point() and obj.dtype != dtype else obj
    if isinstance(obj, (list, tuple)):
        return type(obj)(_cast_floats(o, dtype) for o in obj)
    if isinstance(obj, dict):
        return {k: _cast_floats(v, dtype) for k, v in obj.items()}
    return obj


def _first_float_dtype(obj: Any) -> torch.dtype | None:
    if isinstance(obj, torch.Tensor):
        return obj.dtype if obj.is_floating_point() else None
    items = obj.values() if isinstance(obj, dict) else obj if isinstance(obj, (list, tuple)) else ()
    for o in items:
        found = _first_float_dtype(o)
        if found is not None:
            return found
    return None


def _autocast_forward(forward: Callable, device_type: str, get_dtype: Callable[[], torch.dtype],
                      restore_output_dtype: bool) -> Callable:
    """``forward`` (a module class's unbound ``forward``) run in ``get_dtype()``, as a
    function to bind over the module's own ``forward``.

    Enter and exit live in one ``with`` block of one call: dynamo traces that inside a
    compiled block, while an autocast entered in a pre-hook and exited in a forward hook
    is not traceable (the hook pair failed with "'autocast' object has no attribute
    'prev'"), and the ``with`` restores the outer state when forward raises.

    ``restore_output_dtype`` (switchable groups): outputs are cast back to the dtype the
    inputs had, so a bf16 group inside an fp32 model hands fp32 to modules that run with
    autocast off (else: a float/bf16 mismatch in their Linear)."""

    def autocast_forward(module: nn.Module, *args, **kwargs):
        dtype = get_dtype()
        in_dtype = _first_float_dtype((args, kwargs)) if restore_output_dtype else None
        if dtype == FP32:
            # With autocast off, fp32 weights next to bf16 inputs would be a dtype error.
            args, kwargs = _cast_floats(args, FP32), _cast_floats(kwargs, FP32)
            ctx = torch.autocast(device_type, enabled=False)
        else:
            ctx = torch.autocast(device_type, dtype=dtype)
        with ctx:
            output = forward(module, *args, **kwargs)
        return _cast_floats(output, in_dtype) if in_dtype is not None else output

    return autocast_forward


class PrecisionRuntime:
    """What ``apply_precision`` installed. ``compute_dtypes`` maps each group ("model"
    = everything not in a named group) to its current compute dtype."""

    def __init__(self, model: nn.Module, policy: PrecisionPolicy, master: MasterWeights | None,
                 activations: SavedActivations):
        self.model, self.policy, self.master, self.activations = model, policy, master, activations
        self.compute_dtypes: dict[str, torch.dtype] = {DEFAULT_GROUP: policy.compute_dtype}
        self.compute_dtypes.update({name: policy.compute_dtype for name, _ in policy.groups})
        self.fp32_modules: list[str] = []
        self.group_modules: dict[str, list[str]] = {name: [] for name, _ in policy.groups}
        self._wrapped: list[nn.Module] = []  # modules whose ``forward`` is bound here

    @contextlib.contextmanager
    def autocast(self, track_activations: bool = False):
        """Context for the training forward (and the loss, which ``cross_entropy_loss``
        computes in fp32 whatever the logits' dtype). ``track_activations`` counts the
        bytes saved for backward into ``self.activations.bytes_by_dtype``."""
        # With recast weights autocast's cache would hold every weight's bf16 copy until the
        # forward ends (the memory peak); without it a copy lives from its matmul's cast to
        # the end of that matmul, and backward casts again.
        with autocast_context(self.compute_dtypes[DEFAULT_GROUP], self.policy.device_type,
                              cache_enabled=not self.activations.recast_weights):
            with self.activations.context(track=track_activations):
                yield

    def set_compute_dtype(self, group: str, dtype: torch.dtype | str) -> None:
        """Switch a group between steps (the dynamic controller's decisions)."""
        dtype = DTYPES[dtype] if isinstance(dtype, str) else dtype
        if group not in self.compute_dtypes:
            raise KeyError(f"unknown precision group {group!r}; groups are {sorted(self.compute_dtypes)}")
        self.compute_dtypes[group] = dtype
        if self.policy.activation_follows_levels:
            # A group moved to fp32 for robustness gets fp32 saved activations too (policy.py).
            low = all(d != FP32 for d in self.compute_dtypes.values())
            self.activations.store_dtype = self.policy.activation_dtype if low else None

    def group_parameters(self) -> dict[str, list[nn.Parameter]]:
        """Parameters per group, for per-group gradient norms (``StepSignals.group_grad_norms``);
        "model" holds every parameter not in a named group."""
        owner: dict[int, str] = {}
        for name, fqns in self.group_modules.items():
            for fqn in fqns:
                for p in self.model.get_submodule(fqn).parameters():
                    owner.setdefault(id(p), name)
        out: dict[str, list[nn.Parameter]] = {g: [] for g in self.compute_dtypes}
        for p in self.model.parameters():
            out[owner.get(id(p), DEFAULT_GROUP)].append(p)
        return out

    def rebind(self, model: nn.Module) -> None:
        """Point at the module that now holds the parameters: pipeline stages are deep
        copies of the model this runtime was applied to (they carry the wrappers, which still
        read ``compute_dtypes`` here). ``group_parameters`` needs the original FQNs."""
        self.model = self.activations.model = model

    def remove(self) -> None:
        """Restore the modules' own ``forward`` (parameter casts stay)."""
        for module in self._wrapped:
            module.__dict__.pop("forward", None)
        self._wrapped.clear()

    def _wrap(self, module: nn.Module, get_dtype: Callable[[], torch.dtype], restore_output_dtype: bool) -> None:
        # An instance attribute ``forward`` shadows the class's, and ``nn.Module.__call__``
        # calls it between the module's hooks (FSDP2's, the monitor's) as usual. No wrapper
        # module: parameter names and state-dict keys stay as they are. A bound method
        # survives ``copy.deepcopy`` (pipeline stages): it is rebound to the copy, and the
        # class function it wraps holds no module.
        if "forward" in module.__dict__:
            raise ValueError(f"{type(module).__name__} already has an instance-level forward; precision "
                             "rules (precision.fp32_modules, dynamic_groups) must be applied before any "
                             "other forward patch")
        wrapped = _autocast_forward(type(module).forward, self.policy.device_type, get_dtype, restore_output_dtype)
        module.forward = types.MethodType(wrapped, module)
        self._wrapped.append(module)


def apply_precision(model: nn.Module, policy: PrecisionPolicy, sharded: bool = False) -> PrecisionRuntime:
    """Mutates ``model``: parameters outside the fp32 rules are cast to
    ``policy.param_dtype`` (buffers never), and ``forward`` is wrapped on the rule modules. With master
    weights, ``runtime.master`` holds the fp32 mirror taken before the cast.

    ``sharded=True`` (FSDP2 follows): no cast and no mirror, FSDP2's
    ``MixedPrecisionPolicy`` does both; the wrappers are still installed. Then shard each
    module of ``fsdp_fp32_modules`` with ``fsdp_fp32_policy`` before its block, or an
    fp32 module holding a Linear fails with a float/bf16 dtype mismatch."""
    fp32_mods = outermost_matches(model, policy.fp32_rules)
    fp32_names = [f for f, _ in fp32_mods]

    def inside_fp32(fqn: str) -> bool:
        return any(fqn == f or fqn.startswith(f + ".") for f in fp32_names)

    master = None
    if not sharded and policy.param_dtype != FP32:
        if policy.master_weights:
            master = MasterWeights(model)
        with torch.no_grad():
            keep = {id(p) for _, m in fp32_mods for p in m.parameters()}
            for p in model.parameters():  # tied weights are one Parameter: cast once
                if id(p) not in keep:
                    p.data = p.data.to(policy.param_dtype)
    # fp32 weights under low-precision autocast: backward recasts the weights instead of
    # keeping autocast's copies (exact). Not under FSDP2: its gathered weights are freed
    # after the forward, and it gathers them in the compute dtype anyway.
    low_compute = policy.compute_dtype != FP32 or any(d != FP32 for d in policy.levels)
    recast = low_compute and not sharded and policy.recast_weights
    runtime = PrecisionRuntime(model, policy, master,
                               SavedActivations(model, policy.activation_dtype, recast_weights=recast))
    for name, patterns in policy.groups:
        for fqn, module in outermost_matches(model, patterns):
            # fp32 rules win: a group module inside an fp32 module would re-enable autocast.
            if not inside_fp32(fqn):
                runtime._wrap(module, lambda name=name: runtime.compute_dtypes[name], restore_output_dtype=True)
                runtime.group_modules[name].append(fqn)
    # The fp32 rules only turn autocast off; when no group can ever compute below fp32
    # (the default policy), autocast is never on and the wrappers would be pure overhead.
    if policy.compute_dtype != FP32 or any(d != FP32 for d in policy.levels):
        for fqn, module in fp32_mods:
            runtime._wrap(module, lambda: FP32, restore_output_dtype=False)
            runtime.fp32_modules.append(fqn)
    return runtime

