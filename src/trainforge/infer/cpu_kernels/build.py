"""Build the kernel sources (blocks.cpp, small_gemm.cpp, attention.cpp, norm_act.cpp, program.cpp) with torch.utils.cpp_extension on first use, cached per source + torch.

When there is no compiler, the build fails or TRAINFORGE_CPU_ISA names a path this CPU
lacks, `load_kernels()` returns None and warns once: the engine then keeps today's kernels.
"""

import functools
import hashlib
import os
import warnings
from pathlib import Path

import torch

_DIR = Path(__file__).parent
_SOURCES = [_DIR / "blocks.cpp", _DIR / "small_gemm.cpp", _DIR / "attention.cpp", _DIR / "norm_act.cpp",
            _DIR / "program.cpp"]
_HEADERS = [_DIR / "isa.h", _DIR / "vec_math.h"]
_NAME = "trainforge_cpu_kernels"  # the library cpp_extension.load builds: <cache_dir>/<_NAME>.so


def cache_dir() -> Path:
    # The build flags live in this file: a change to either rebuilds.
    digest = hashlib.sha256(b"".join(p.read_bytes() for p in [*_SOURCES, *_HEADERS, Path(__file__)])
                            + torch.__version__.encode()).hexdigest()[:16]
    root = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache"))
    return root / "trainforge" / "cpu_kernels" / digest


@functools.cache
def _build() -> str | None:
    """Returns None on success, else the reason (cached: one build attempt per process)."""
    out = cache_dir()
    if not _load_built(out / f"{_NAME}.so"):
        try:
            from torch.utils import cpp_extension

            out.mkdir(parents=True, exist_ok=True)
            cpp_extension.load(
                name=_NAME,
                sources=[str(p) for p in _SOURCES],
                build_directory=str(out),
                # -fopenmp: without it ATen's parallel_for compiles to a serial loop (its OpenMP
                # body is under #ifdef _OPENMP); the .so then shares the libgomp torch already loaded.
                extra_cflags=["-O3", "-fopenmp"],
                extra_ldflags=["-fopenmp"],
                is_python_module=False,
                verbose=False,
            )
        except Exception as exc:  # no compiler, compile error, unwritable cache: all fall back
            return f"{type(exc).__name__}: {exc}"
    _register_fakes()
    return None


def _load_built(lib: Path) -> bool:
    """Load an earlier build of these exact sources directly. ``cpp_extension.load`` would also
    find it up to date, but imports setuptools (+4.4 MiB of a decode process's 80 over a bare
    ``import torch``) and runs ``ninja --version`` and ``c++ -dumpversion`` first. A file that
    does not load goes to ``cpp_extension.load`` as before, which rebuilds what ninja finds
    out of date and reports the failure otherwise."""
    if not lib.is_file():
        return False
    try:
        torch.ops.load_library(str(lib))
    except OSError:
        return False
    return True


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
    """The `torch.ops.trainforge_cpu` namespace, or None (with one warning) if unusable."""
    reason = _build()
    if reason is None:
        try:
            torch.ops.trainforge_cpu.isa()  # raises if TRAINFORGE_CPU_ISA is unsupported here
        except RuntimeError as exc:
            reason = str(exc).splitlines()[0]
    if reason is not None:
        _warn_once(reason)
        return None
    return torch.ops.trainforge_cpu
