"""Build the decode kernels (blocks.cpp, small_gemm.cpp, attention.cpp, norm_act.cpp, program.cpp)
through the shared C++ build (``native/build.py``: once per source + torch, into a cache a killed
build cannot wedge).

``make install`` builds them (``python -m trainforge.infer.cpu_kernels``); a process that finds
none built builds them at first use and says so first (~1 min on 2 cores).

When there is no compiler or the build fails, ``load_kernels()`` returns None and the formats
run on their fallbacks (fp32 and int4 on ATen, q8_0 / q4_0 dequantised to fp32 at load). One
line says so, once per cache (``native/build.py``). When TRAINFORGE_CPU_ISA names a path this
CPU lacks, the same fallback with one warning per process.
"""

from __future__ import annotations

import functools
import warnings
from pathlib import Path

import torch

from trainforge.log import get_logger
from trainforge.native import build as native
from trainforge.native.build import WAIT_LIMIT_S, cache_root, toolchain
from trainforge.native.build import load_built as _load_built

__all__ = ["WAIT_LIMIT_S", "build", "cache_dir", "cache_root", "load_kernels", "toolchain", "_load_built"]

_DIR = Path(__file__).parent
_SOURCES = [_DIR / "blocks.cpp", _DIR / "small_gemm.cpp", _DIR / "attention.cpp", _DIR / "norm_act.cpp",
            _DIR / "program.cpp"]
_HEADERS = [_DIR / "vec_math.h"]  # and native/isa.h, which every build shares
_NAME = "trainforge_cpu_kernels"  # the library: <cache_dir>/<_NAME>.so
# What the fallback costs, for the one line that reports it (measured: docs/benchmarks-archive.md, "Without
# a C++ compiler").
_FALLBACK_COST = ("CPU inference falls back to ATen: decode ~1.5x slower in fp32, ~3x in int4 and ~5-9x in "
                  "q8_0 / q4_0 / GGUF, whose weights are dequantised to fp32 at load (4-7x their memory)")


def cache_dir() -> Path:
    return native.cache_entry([*_SOURCES, *_HEADERS, Path(__file__)])


@functools.cache
def _build() -> str | None:
    """Returns None when the kernels are loaded, else the reason (one attempt per process)."""
    return build(announce=get_logger().info)


def build(announce=lambda msg: None, wait_limit_s: float = WAIT_LIMIT_S, sources: list[Path] | None = None,
          name: str = _NAME, entry: Path | None = None) -> str | None:
    """Load the built kernels, building them first if none are: None on success, else the reason
    (``native.build.build``). ``sources`` / ``name`` / ``entry`` default to the kernels'; other
    values build another library the same way (tests)."""
    reason = native.build(sources or _SOURCES, name, entry or cache_dir(), announce=announce,
                          wait_limit_s=wait_limit_s, fallback_cost=_FALLBACK_COST)
    if reason is None and name == _NAME:
        _register_fakes()
    return reason


@functools.cache
def _register_fakes() -> None:
    """Shape functions of the ops, so ``torch.compile`` (and meta / fake tensors) can trace a
    model through them instead of breaking the graph: y (M, N) fp32 from x (M, K) and the weight
    (N rows; the block ops take N, their packed weight holding it padded to groups of 8)."""
    def block_fake(x: torch.Tensor, w: torch.Tensor, s: torch.Tensor, n: int) -> torch.Tensor:
        return x.new_empty((x.shape[0], n))

    def into_fake(x: torch.Tensor, *rest: torch.Tensor) -> None:
        return None

    for name in ("q8_0_linear", "q4_0_linear"):
        torch.library.register_fake(f"trainforge_cpu::{name}")(block_fake)
    torch.library.register_fake("trainforge_cpu::int4_linear")(
        lambda x, w, s, z, group_size, n: x.new_empty((x.shape[0], n)))
    torch.library.register_fake("trainforge_cpu::f32_linear")(lambda x, w: x.new_empty((x.shape[0], w.shape[0])))
    for name in ("q8_0_linear_into", "q4_0_linear_into", "int4_linear_into", "f32_linear_into", "f32_gemm_into", "rope_into",
                 "paged_attention_into", "rms_norm_into", "silu_mul_into", "block_gather_into"):
        torch.library.register_fake(f"trainforge_cpu::{name}")(into_fake)


@functools.cache
def _warn_once(reason: str) -> None:
    warnings.warn(
        f"trainforge CPU block kernels unavailable ({reason}); "
        "the engine falls back to today's kernels",
        RuntimeWarning,
        stacklevel=3,
    )


def load_kernels():
    """The `torch.ops.trainforge_cpu` namespace, or None if unusable (a failed build was
    reported by ``build``; a forced instruction path this CPU lacks warns once here)."""
    return native.usable_ops(_build(), "trainforge_cpu", _warn_once)
