"""Memory accounting: bytes per dtype of parameters, gradients, optimizer state and
saved activations, plus the process peak.

Counts storage, not tensor views: a tensor that is a view of a larger buffer counts the
buffer once (that is what is held). Sharded (DTensor) tensors count their local shard,
so the numbers are per rank. Peak: the CUDA caching allocator's
``max_memory_allocated`` on GPU; on CPU the peak resident set size of the process
(``getrusage``), which also holds the interpreter and libraries, next to which the
tracked tensor total says how much of it is the model's.

Call it at the logging interval: it walks every tensor (no device sync, but not free).
"""

from __future__ import annotations

import resource
import sys
from dataclasses import dataclass, field
from typing import Iterable

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from trainforge.precision.activations import SavedActivations, dtype_label


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def bytes_by_dtype(tensors: Iterable[torch.Tensor]) -> dict[str, int]:
    """Sum of distinct storages' bytes, keyed by dtype name ("fp32", "bf16", "int64"...)."""
    seen: set[tuple[str, int]] = set()
    out: dict[str, int] = {}
    for t in tensors:
        if t is None:
            continue
        t = _local(t)
        storage = t.untyped_storage()
        key = (str(t.device), storage.data_ptr())
        if key in seen or storage.nbytes() == 0:
            continue
        seen.add(key)
        out[dtype_label(t.dtype)] = out.get(dtype_label(t.dtype), 0) + storage.nbytes()
    return out


def parameter_bytes(modules: Iterable[nn.Module]) -> dict[str, int]:
    return bytes_by_dtype(p for m in modules for p in m.parameters())


def gradient_bytes(modules: Iterable[nn.Module]) -> dict[str, int]:
    return bytes_by_dtype(p.grad for m in modules for p in m.parameters() if p.grad is not None)


def optimizer_state_bytes(optimizers: Iterable[torch.optim.Optimizer]) -> dict[str, int]:
    """Every tensor in ``optimizer.state`` (AdamW: exp_avg, exp_avg_sq, step)."""
    return bytes_by_dtype(v for opt in optimizers for st in opt.state.values() for v in st.values()
                          if isinstance(v, torch.Tensor))


def measure_activation_bytes(model: nn.Module, forward, activations: SavedActivations | None = None
                             ) -> dict[str, int]:
    """Bytes saved for backward by one ``forward()`` call (its result is discarded, so
    the graph is freed). ``activations``: the runtime's ``SavedActivations``, to count
    what its low-precision storage actually keeps."""
    tracker = activations or SavedActivations(model)
    with tracker.context(track=True):
        out = forward()
    del out
    return dict(tracker.bytes_by_dtype)


def peak_memory(device: torch.device) -> tuple[int, str]:
    """(peak bytes, what was measured)."""
    device = torch.device(device)
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device)), "cuda max_memory_allocated"
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    # Linux reports KiB, macOS bytes.
    return int(rss if sys.platform == "darwin" else rss * 1024), "peak RSS of the process"


@dataclass
class MemoryReport:
    params: dict[str, int] = field(default_factory=dict)
    grads: dict[str, int] = field(default_factory=dict)
    optimizer_state: dict[str, int] = field(default_factory=dict)  # includes fp32 master weights
    activations: dict[str, int] = field(default_factory=dict)
    peak_bytes: int = 0
    peak_source: str = ""

    CATEGORIES = ("params", "grads", "optimizer_state", "activations")

    def tracked_bytes(self) -> int:
        return sum(sum(getattr(self, c).values()) for c in self.CATEGORIES)

    def as_metrics(self) -> dict[str, int]:
        """Flat keys for the metrics sink: ``mem_params_bf16_bytes``, ..., ``mem_peak_bytes``."""
        out = {f"mem_{c}_{d}_bytes": n for c in self.CATEGORIES for d, n in sorted(getattr(self, c).items())}
        out["mem_tracked_bytes"] = self.tracked_bytes()
        out["mem_peak_bytes"] = self.peak_bytes
        return out

    def format(self) -> str:
        rows = [f"{c:>16}: " + (", ".join(f"{d} {n / 2**20:.2f} MiB" for d, n in sorted(getattr(self, c).items()))
                                or "-") for c in self.CATEGORIES]
        rows.append(f"{'tracked total':>16}: {self.tracked_bytes() / 2**20:.2f} MiB; "
                    f"peak {self.peak_bytes / 2**20:.2f} MiB ({self.peak_source})")
        return "\n".join(rows)


def memory_report(modules: Iterable[nn.Module], optimizers: Iterable[torch.optim.Optimizer],
                  device: torch.device, activations: dict[str, int] | None = None,
                  master_modules: Iterable[nn.Module] = ()) -> MemoryReport:
    """``modules``: the model parts; ``master_modules``: ``runtime.master.module`` when
    there are master weights (counted as optimizer state: they exist for the optimizer);
    ``activations``: from ``measure_activation_bytes``."""
    modules, masters, optimizers = list(modules), list(master_modules), list(optimizers)
    opt = optimizer_state_bytes(optimizers)
    for d, n in parameter_bytes(masters).items():
        opt[d] = opt.get(d, 0) + n
    grads = gradient_bytes(modules + masters)
    peak, source = peak_memory(device)
    return MemoryReport(params=parameter_bytes(modules), grads=grads, optimizer_state=opt,
                        activations=dict(activations or {}), peak_bytes=peak, peak_source=source)
