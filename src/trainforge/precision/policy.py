"""Resolve ``[precision]`` plus the device into the dtypes a run actually uses.

``build_policy`` applies, in order: the preset, the section's overrides, then the
hardware (``hardware.resolve_compute_dtype``). When slow hardware moves compute back
to fp32, parameter storage follows (low-precision weights would force low-precision
matmuls), and, unless ``activation_dtype`` says otherwise, activations saved for
backward are still stored in the requested low dtype: that keeps the memory saving
without the slow matmuls.

Under bf16 compute, ``activation_dtype = auto`` stores what autocast leaves in fp32 and
backward keeps (the fp32 modules' inputs and normalised outputs, the fp32 residual
stream) in bf16 too: compute stays fp32 there, only the saved copy is rounded. Not under
fp16 compute (an fp32 residual stream may exceed fp16's range). Under ``dynamic`` the
storage follows the levels (``activation_follows_levels``): bf16 while every group
computes below fp32 (bf16 keeps fp32's range, so an fp16 level loses none), as computed
once any group has moved to fp32 for robustness. ``activation_dtype`` set explicitly
overrides all of this, ``fp32`` keeps them as computed.

``fsdp_mixed_precision`` maps the policy onto FSDP2's ``MixedPrecisionPolicy`` for
sharded runs; there the sharded fp32 parameters are the master weights.
"""

from __future__ import annotations

import fnmatch
import logging
from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed.fsdp import MixedPrecisionPolicy

from trainforge.log import get_logger
from trainforge.precision.hardware import (DTYPE_NAMES, DTYPES, Capability, agree_across_ranks, detect_capability,
                                           resolve_compute_dtype)
from trainforge.precision.section import LADDER, PrecisionSection, parse_groups, parse_patterns

FP32 = torch.float32
DEFAULT_GROUP = "model"  # every module not in a named dynamic group


@dataclass(frozen=True)
class PrecisionPolicy:
    """Resolved dtypes. ``compute_dtype`` is the starting compute dtype of every group;
    under ``dynamic`` the runtime may move groups along ``levels`` (cheapest first)."""

    device_type: str
    param_dtype: torch.dtype
    compute_dtype: torch.dtype
    reduce_dtype: torch.dtype
    optimizer_state_dtype: torch.dtype
    activation_dtype: torch.dtype | None  # storage of saved activations; None = as computed
    fp32_rules: tuple[str, ...]
    loss_scaling: bool
    dynamic: bool = False
    levels: tuple[torch.dtype, ...] = ()
    groups: tuple[tuple[str, tuple[str, ...]], ...] = ()
    recast_weights: bool = False  # autocast's saved weight copies recast in backward (activations.py)
    activation_follows_levels: bool = False  # dynamic: activation_dtype only while no group is at fp32
    notes: tuple[str, ...] = ()  # one line per decision that differs from the request

    @property
    def low_precision(self) -> bool:
        """Anything below fp32 anywhere (storage, compute, saved activations, a dynamic
        level). False for the default ``fp32`` policy: then nothing is installed."""
        return (self.param_dtype != FP32 or self.compute_dtype != FP32 or self.activation_dtype is not None
                or any(d != FP32 for d in self.levels))

    @property
    def master_weights(self) -> bool:
        """Low-precision weights with an fp32 optimizer: keep fp32 master copies."""
        return self.param_dtype != FP32 and self.optimizer_state_dtype == FP32

    def describe(self) -> str:
        n = DTYPE_NAMES
        parts = [f"params {n[self.param_dtype]}", f"compute {n[self.compute_dtype]}",
                 f"reduce {n[self.reduce_dtype]}", f"optimizer state {n[self.optimizer_state_dtype]}"]
        if self.activation_dtype is not None:
            parts.append(f"saved activations {n[self.activation_dtype]}"
                         + (" while no group is at fp32" if self.activation_follows_levels else ""))
        if self.recast_weights and self.param_dtype == FP32 and (self.compute_dtype != FP32 or self.dynamic):
            parts.append("weights recast in backward")
        if self.loss_scaling:
            parts.append("fp16 loss scaling")
        if self.dynamic:
            parts.append(f"dynamic over {'/'.join(n[d] for d in self.levels)}")
        return ", ".join(parts)


def build_policy(section: PrecisionSection, device: torch.device | str, capability: Capability | None = None,
                 log: logging.Logger | None = None) -> PrecisionPolicy:
    """``section`` must be validated. ``capability`` defaults to ``detect_capability``
    (probes once per machine, cached), agreed over ranks when distributed, so
    every rank must call this (one tiny all-reduce; none when the requested compute
    dtype is fp32, which needs no probe). Logs each adjustment."""
    device = torch.device(device)
    d = {k: DTYPES[v] for k, v in section.resolved_dtypes().items()}
    if capability is None and d["compute_dtype"] == FP32 and section.policy != "dynamic":
        # All-fp32 compute consults no capability: the default policy costs no probe and no collective.
        capability = Capability(device.type, f"{device.type} (not probed: fp32 compute)")
    if capability is None:
        capability = agree_across_ranks(detect_capability(device), device)
    requested = d["compute_dtype"]
    notes = []
    compute, why = resolve_compute_dtype(requested, device, section.force, capability, log=None)
    if compute != requested or not capability.is_fast(requested):
        notes.append(why)
    param = d["param_dtype"]
    if param != FP32 and param != compute:
        # Weights in the requested low dtype would make every matmul low precision again.
        notes.append(f"parameters stored in {DTYPE_NAMES[compute]} instead of {DTYPE_NAMES[param]}, "
                     f"to match the compute dtype")
        param = compute
    opt_state = d["optimizer_state_dtype"]
    if opt_state != FP32:
        opt_state = param
    dynamic = section.policy == "dynamic"
    activation: torch.dtype | None = None
    if section.activation_dtype != "auto":
        activation = DTYPES[section.activation_dtype]
    elif compute == FP32 and requested != FP32:
        activation = requested
        notes.append(f"activations saved for backward are still stored in {DTYPE_NAMES[requested]}")
    elif compute == torch.bfloat16 and not dynamic:
        activation = compute  # what autocast leaves fp32 (norm internals, residual stream) stored in bf16
    elif dynamic and compute != FP32:
        activation = torch.bfloat16  # while every group is low (PrecisionRuntime.set_compute_dtype)
    if activation == FP32:
        activation = None  # stored as computed
    levels: tuple[torch.dtype, ...] = ()
    if dynamic:
        floor = DTYPES[section.dynamic_floor] if section.dynamic_floor != "auto" else compute
        ladder = [DTYPES[n] for n in LADDER[LADDER.index(DTYPE_NAMES[floor]):]]
        # Only levels the hardware runs no slower than fp32 (or the forced start).
        levels = tuple(dt for dt in ladder if capability.is_fast(dt) or (section.force and dt == compute))
        dropped = [DTYPE_NAMES[dt] for dt in ladder if dt not in levels]
        if dropped:
            notes.append(f"dynamic precision will not use {'/'.join(dropped)}: slower than fp32 here")
        if compute not in levels:
            compute = levels[0]
    loss_scaling = compute == torch.float16 or param == torch.float16 or torch.float16 in levels
    policy = PrecisionPolicy(
        device_type=device.type, param_dtype=param, compute_dtype=compute, reduce_dtype=d["reduce_dtype"],
        optimizer_state_dtype=opt_state, activation_dtype=activation,
        fp32_rules=parse_patterns(section.fp32_modules), loss_scaling=loss_scaling, dynamic=dynamic,
        levels=levels, groups=parse_groups(section.dynamic_groups), recast_weights=section.recast_weights,
        activation_follows_levels=dynamic and section.activation_dtype == "auto" and activation is not None,
        notes=tuple(notes))
    if log:
        for note in notes:
            log.warning(f"precision: {note}")
        # The startup summary (train/run_summary.py) prints the policy; the probe's verdict is a detail.
        get_logger().debug(f"precision {section.policy} on {capability.name}: {policy.describe()}")
    return policy


def matches_rule(fqn: str, module: nn.Module, rules: tuple[str, ...]) -> bool:
    """A rule is a class name (any class in the module's MRO) or an fnmatch pattern on the FQN."""
    classes = {cls.__name__ for cls in type(module).__mro__}
    return any(r in classes or fnmatch.fnmatchcase(fqn, r) for r in rules)


def outermost_matches(model: nn.Module, rules: tuple[str, ...]) -> list[tuple[str, nn.Module]]:
    """(fqn, module) of matching modules not nested inside another match (the root excluded)."""
    found: list[tuple[str, nn.Module]] = []
    for fqn, module in model.named_modules():
        if not fqn or any(fqn.startswith(f + ".") for f, _ in found):
            continue
        if matches_rule(fqn, module, rules):
            found.append((fqn, module))
    return found


def fsdp_mixed_precision(policy: PrecisionPolicy) -> MixedPrecisionPolicy:
    """FSDP2 policy for the transformer blocks and the root.

    Parameters are all-gathered in the compute dtype (halving all-gather bytes), kept
    sharded in fp32 (the master weights), and gradients reduced in ``reduce_dtype``.
    Under ``dynamic`` they are gathered in fp32: a group switched to fp32 needs fp32
    weights, and autocast casts them for the low-precision groups."""
    low = policy.compute_dtype != FP32 and not policy.dynamic
    return MixedPrecisionPolicy(param_dtype=policy.compute_dtype if low else None,
                                reduce_dtype=policy.reduce_dtype)


def fsdp_fp32_policy(policy: PrecisionPolicy) -> MixedPrecisionPolicy:
    """FSDP2 policy for the modules of ``fsdp_fp32_modules``: gathered in fp32."""
    return MixedPrecisionPolicy(param_dtype=FP32, reduce_dtype=policy.reduce_dtype)


def fsdp_fp32_modules(model: nn.Module, policy: PrecisionPolicy) -> list[nn.Module]:
    """Modules the fp32 rules match that own parameters. Under FSDP2 with a
    low-precision ``param_dtype`` shard each with ``fsdp_fp32_policy`` *before* its
    block, or a Linear among them (a router) would see bf16 weights next to its fp32
    inputs. Costs one small all-gather per module; empty when nothing is gathered low."""
    if fsdp_mixed_precision(policy).param_dtype is None:
        return []
    return [m for _, m in outermost_matches(model, policy.fp32_rules) if any(True for _ in m.parameters())]
