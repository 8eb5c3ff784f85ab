"""Is a low-precision compute dtype actually faster here? CPU flags plus a measured probe.

On CPUs without native bf16/fp16 matmul (x86 ``avx512_bf16`` / ``amx_bf16`` /
``avx512_fp16``, Arm ``bf16`` / ``fphp``) torch falls back to conversion or reference
kernels that can be an order of magnitude slower than fp32. Flags alone are not enough:
whether this torch build's kernels use them is only known by timing. So each dtype gets
a short probe (one square matmul against fp32, single-threaded, timed with the
thread's CPU clock, best of a few runs: robust on a shared machine). The measured
slowdown decides; the flags decide only when no measurement exists. Raw measurements
are cached as JSON, keyed by CPU model and torch version, so the probe runs once per
machine, not once per run.

On CUDA: bf16 where ``torch.cuda.is_bf16_supported`` says the GPU has it natively,
fp16 everywhere (then with loss scaling).
"""

from __future__ import annotations

import logging
import os
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from trainforge.json_cache import read_json_cache, write_json_cache

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
DTYPE_NAMES = {v: k for k, v in DTYPES.items()}

# x86 flags first, then the Arm /proc/cpuinfo "Features" names.
NATIVE_CPU_FLAGS = {
    "bf16": ("avx512_bf16", "amx_bf16", "bf16"),
    "fp16": ("avx512_fp16", "amx_fp16", "fphp"),
}
CACHE_FILE = "precision_probe.json"


@dataclass(frozen=True)
class DtypeSupport:
    fast: bool  # no slower than fp32 for matmuls
    native: bool | None  # CPU flags say native support; None = flags unknown
    slowdown: float | None  # measured time(dtype) / time(fp32); None = not measured
    reason: str


@dataclass(frozen=True)
class Capability:
    device_type: str
    name: str
    support: dict[str, DtypeSupport] = field(default_factory=dict)  # "bf16" / "fp16"

    def is_fast(self, dtype: torch.dtype) -> bool:
        return dtype == torch.float32 or self.support[DTYPE_NAMES[dtype]].fast


def read_cpuinfo(path: str | Path = "/proc/cpuinfo") -> tuple[str, frozenset[str] | None]:
    """(CPU model name, flag set) from /proc/cpuinfo; flags None where unreadable."""
    try:
        text = Path(path).read_text()
    except OSError:
        return "unknown-cpu", None
    model, flags = "unknown-cpu", None
    for line in text.splitlines():
        key, _, value = line.partition(":")
        key = key.strip().lower()
        if key in ("model name", "cpu model") and model == "unknown-cpu":
            model = value.strip()
        elif key in ("flags", "features") and flags is None:
            flags = frozenset(value.split())
    return model, flags


def native_support(dtype_name: str, flags: frozenset[str] | None) -> bool | None:
    if flags is None:
        return None
    return any(f in flags for f in NATIVE_CPU_FLAGS[dtype_name])


def decide(dtype_name: str, native: bool | None, slowdown: float | None,
           max_slowdown: float = 1.0) -> DtypeSupport:
    """The decision rule: the measurement when there is one, else the flags, else slow."""
    flag_text = {True: "native flags present", False: f"no {'/'.join(NATIVE_CPU_FLAGS[dtype_name][:2])} flag",
                 None: "CPU flags unknown"}[native]
    if slowdown is not None:
        fast = slowdown <= max_slowdown
        reason = f"{dtype_name} matmul measured {slowdown:.2f}x the fp32 time ({flag_text})"
    elif native is not None:
        fast = native
        reason = f"{dtype_name}: not measured, {flag_text}"
    else:
        fast = False
        reason = f"{dtype_name}: not measured and {flag_text}; assumed slow"
    return DtypeSupport(fast=fast, native=native, slowdown=slowdown, reason=reason)


def measure_matmul_slowdown(dtype: torch.dtype, size: int = 256, rounds: int = 5,
                            budget_s: float = 2.0) -> float:
    """CPU time of a size x size matmul in ``dtype`` over the same in fp32, best of ``rounds``.

    Single-threaded and timed with the thread's CPU clock, so other processes on a
    shared machine (which only deschedule us) do not enter the ratio; the ratio of
    kernel costs is what decides, not the thread count. 256 is large enough to be
    compute-bound (smaller sizes time the dispatcher) and small enough that a 30x
    slow fallback still takes milliseconds. Stops after ``budget_s`` of CPU time."""
    gen = torch.Generator().manual_seed(0)
    a = torch.randn(size, size, generator=gen)
    b = torch.randn(size, size, generator=gen)
    a_low, b_low = a.to(dtype), b.to(dtype)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        a @ b, a_low @ b_low  # warm-up: oneDNN creates its kernels on first use
        best32 = best_low = float("inf")
        start = time.thread_time()
        for _ in range(rounds):
            t0 = time.thread_time()
            a @ b
            t1 = time.thread_time()
            a_low @ b_low
            t2 = time.thread_time()
            best32, best_low = min(best32, t1 - t0), min(best_low, t2 - t1)
            if t2 - start > budget_s:
                break
    finally:
        torch.set_num_threads(threads)
    return best_low / max(best32, 1e-9)


def _cache_path(cache_dir: str | Path | None) -> Path:
    root = cache_dir or os.environ.get("TRAINFORGE_CACHE") or Path.home() / ".cache" / "trainforge"
    return Path(root) / CACHE_FILE


def cpu_capability(cache_dir: str | Path | None = None, refresh: bool = False,
                   measure=measure_matmul_slowdown, cpuinfo: str | Path = "/proc/cpuinfo") -> Capability:
    """Capability of this CPU (flags + cached probe). ``measure(dtype) -> slowdown`` is
    injectable for tests; ``refresh`` re-measures and overwrites the cache entry."""
    model, flags = read_cpuinfo(cpuinfo)
    key = f"{model}|torch {torch.__version__}"
    path = _cache_path(cache_dir)
    cache = read_json_cache(path)
    measured = cache.get(key) if not refresh else None
    if not isinstance(measured, dict) or set(measured) != set(NATIVE_CPU_FLAGS):
        measured = {name: measure(DTYPES[name]) for name in NATIVE_CPU_FLAGS}
        cache[key] = measured
        write_json_cache(path, cache)
    # The rule runs on the cached raw numbers, so a changed rule applies without re-probing.
    support = {name: decide(name, native_support(name, flags), measured[name]) for name in NATIVE_CPU_FLAGS}
    return Capability("cpu", model, support)


def cuda_capability(device: torch.device) -> Capability:
    name = torch.cuda.get_device_name(device)
    with torch.cuda.device(device):
        bf16 = torch.cuda.is_bf16_supported(including_emulation=False)
    return Capability("cuda", name, {
        "bf16": DtypeSupport(bf16, bf16, None, f"bf16 {'native' if bf16 else 'not native'} on {name}"),
        "fp16": DtypeSupport(True, True, None, f"fp16 native on {name}"),
    })


def detect_capability(device: torch.device, cache_dir: str | Path | None = None) -> Capability:
    device = torch.device(device)
    if device.type == "cuda":
        return cuda_capability(device)
    if device.type == "cpu":
        return cpu_capability(cache_dir)
    # Other accelerators: trust the request (no probe written for them yet).
    return Capability(device.type, device.type, {n: DtypeSupport(True, None, None, f"{n}: not probed on "
                                                                 f"{device.type}; assumed fast")
                                                 for n in NATIVE_CPU_FLAGS})


def agree_across_ranks(capability: Capability, device: torch.device) -> Capability:
    """Every rank must use the same dtypes: a dtype counts as fast only if it is fast on
    all ranks (one all-reduce; a no-op unless torch.distributed is initialised)."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return capability
    names = sorted(capability.support)
    flags = torch.tensor([int(capability.support[n].fast) for n in names], device=device)
    dist.all_reduce(flags, op=dist.ReduceOp.MIN)
    support = dict(capability.support)
    for n, f in zip(names, flags.tolist()):
        if support[n].fast and not f:
            s = support[n]
            support[n] = DtypeSupport(False, s.native, s.slowdown, s.reason + "; slow on another rank")
    return Capability(capability.device_type, capability.name, support)


def resolve_compute_dtype(requested: torch.dtype, device: torch.device, force: bool = False,
                          capability: Capability | None = None,
                          log: logging.Logger | None = None) -> tuple[torch.dtype, str]:
    """The compute dtype to use for ``requested`` on ``device``, and why.

    fp32 and fast dtypes are kept. A slow one is kept only with ``force`` (warned);
    otherwise CUDA without bf16 falls back to fp16 (the caller enables loss scaling)
    and everything else to fp32."""
    if requested == torch.float32:
        return requested, "fp32 requested"
    device = torch.device(device)
    cap = capability or detect_capability(device)
    name = DTYPE_NAMES[requested]
    why = cap.support[name].reason
    if cap.is_fast(requested):
        return requested, f"{name} is fast here: {why}"
    if force:
        msg = f"{name} compute is slower than fp32 here ({why}); using it anyway (precision.force)"
        if log:
            log.warning(msg)
        return requested, msg
    fallback = torch.float32
    if cap.device_type == "cuda" and requested == torch.bfloat16 and cap.is_fast(torch.float16):
        fallback = torch.float16
    msg = (f"{name} compute would be slower than fp32 here ({why}); computing in {DTYPE_NAMES[fallback]} "
           "instead (set precision.force = true to insist)")
    if log:
        log.warning(msg)
    return fallback, msg


def cpu_compile_unavailable() -> str | None:
    """Why ``torch.compile`` cannot run on this machine's CPU, or None. Inductor's CPU backend
    compiles its kernels as C++ with ``$CXX``, else ``g++`` (``torch._inductor.config.cpp.cxx``);
    without one every compiled call raises ``InvalidCxxCompiler`` at its first run, so a
    command that asks for compile is refused up front instead."""
    cxx = os.environ.get("CXX", "g++")
    if shutil.which(cxx) is None:
        return f"torch.compile on the CPU needs a C++ compiler ({cxx} is not on PATH)"
    return None
