"""Whether the weights a decode step reads stay in the CPU's last-level cache from one step to
the next, and the block kernels' prefetch hint that follows (``blocks.cpp``, ``prefetch_ahead``).

A step reads every weight once. Where the weights outlast the last-level cache, the kernels
prefetch them non-temporally, so the stream does not evict the KV cache (the default). Where
they fit, they are prefetched into every level and the next step finds them there: on a Xeon
with a 300 MiB L3 that made the 90m q4_0 decode 2.8-2.9x faster (docs/benchmarks-archive.md), as non-temporal
lines never enter its L3. The hint is one per process (the cache is), so the decision covers
every prepared model that is alive: a speculative decoder's draft model and target together.

``TRAINFORGE_CPU_WEIGHT_CACHE=keep|stream`` overrides the decision (to measure both on a machine).
"""

from __future__ import annotations

import os
import weakref
from pathlib import Path

import torch
from torch import nn

# Weights may take up to this share of the last-level cache. The whole of it: on the Xeon
# (300 MiB L3, shared with the host's other guests) a 287M model's q8_0 weights, 291 MiB, still
# decoded 1.31x (T=1) and 1.34x (T=2) faster kept than streamed, and its q4_0 ones (154 MiB)
# 1.28x / 1.54x, the KV cache and activations notwithstanding. Beyond the cache the NTA stream
# stays: on Zen 3 it beat no prefetch on the block kernels and T0 on the fp32 GEMV of then.
LLC_SHARE = 1.0
ENV = "TRAINFORGE_CPU_WEIGHT_CACHE"
_SYS_CACHE = Path("/sys/devices/system/cpu/cpu0/cache")
_models: weakref.WeakKeyDictionary[nn.Module, int] = weakref.WeakKeyDictionary()  # model -> step bytes


def last_level_cache_bytes(root: Path = _SYS_CACHE) -> int | None:
    """Size of the highest data or unified cache level of CPU 0 (Linux sysfs), or None if unknown."""
    best: tuple[int, int] | None = None
    for d in root.glob("index*"):
        try:
            kind, level, size = ((d / f).read_text().strip() for f in ("type", "level", "size"))
            scale = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(size[-1:].upper(), 1)
            entry = (int(level), int(size.rstrip("KMGkmg")) * scale)
        except (OSError, ValueError):
            continue
        if kind in ("Data", "Unified") and (best is None or entry[0] > best[0]):
            best = entry
    return best[1] if best is not None else None


def step_bytes(model: nn.Module) -> int:
    """Bytes of weights a decode step of ``model`` reads (an upper bound: the token embedding,
    of which a step reads a few rows, counts whole): its parameters and buffers, and each packed
    quantised layer's codes and scales (held by its kernel, not by a buffer, once packed). A
    packed layer is one with a ``kernel_name`` other than "reference" (which keeps its buffers)
    and its ``weight_bytes``, as ``quantize.common.QuantLinear.pack`` leaves it: read by name, as
    ``quantize`` imports this package's kernels."""
    total, seen = 0, set()
    for m in model.modules():
        if getattr(m, "kernel_name", None) not in (None, "reference") and hasattr(m, "weight_bytes"):
            total += m.weight_bytes
    for t in (*model.parameters(), *model.buffers()):
        ptr = t.untyped_storage().data_ptr()
        if t.numel() and ptr not in seen:
            seen.add(ptr)
            total += t.untyped_storage().nbytes()
    return total


def keep_weights_cached(total: int, llc: int | None) -> bool:
    """The policy: keep the weights cached when they take at most ``LLC_SHARE`` of the cache."""
    override = os.environ.get(ENV, "")
    if override:
        if override not in ("keep", "stream"):
            raise ValueError(f"{ENV}={override!r}: use keep (weights stay in the CPU cache) or stream")
        return override == "keep"
    return llc is not None and total <= LLC_SHARE * llc


def apply(model: nn.Module) -> bool | None:
    """Count ``model``'s weights with the other live prepared models' and set the block kernels'
    prefetch hint for the total; returns it. None where the model is not on CPU, or neither it
    nor an earlier model loaded the kernels (nothing reads the hint; a block layer's packing
    loads them, and this never builds them for a model without one)."""
    p = next(iter(model.parameters()), None)
    if p is None or p.device.type != "cpu":
        return None
    _models[model] = step_bytes(model)
    ops = torch.ops.trainforge_cpu
    if not hasattr(ops, "set_keep_weights_cached"):
        return None
    keep = keep_weights_cached(sum(_models.values()), last_level_cache_bytes())
    ops.set_keep_weights_cached(keep)
    return keep
