"""Build the kernel sources (blocks.cpp, small_gemm.cpp, attention.cpp, norm_act.cpp, program.cpp)
with torch.utils.cpp_extension, once per source + torch, into a cache a killed build cannot wedge.

``make install`` builds them (``python -m trainforge.infer.cpu_kernels``); a process that finds
none built builds them at first use and says so first (~1 min on 2 cores). The cache is
``$TRAINFORGE_KERNEL_CACHE``, else ``$TRAINFORGE_CACHE/cpu_kernels``, else
``~/.cache/trainforge/cpu_kernels`` (``$XDG_CACHE_HOME`` honoured); locking, the private build
directory and the failure record are ``build_cache.py``'s.

When there is no compiler or the build fails, ``load_kernels()`` returns None and the formats
run on their fallbacks (fp32 and int4 on ATen, q8_0 / q4_0 dequantised to fp32 at load). One
line says so, once per cache: the failure is recorded with the toolchain it happened with, so
later runs neither rebuild nor repeat it until the toolchain changes. When TRAINFORGE_CPU_ISA
names a path this CPU lacks, the same fallback with one warning per process.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import logging
import os
import shutil
import sys
import time
import warnings
from pathlib import Path

import torch

from trainforge.errors import TrainforgeError
from trainforge.infer.cpu_kernels.build_cache import BuildCache
from trainforge.log import get_logger

_DIR = Path(__file__).parent
_SOURCES = [_DIR / "blocks.cpp", _DIR / "small_gemm.cpp", _DIR / "attention.cpp", _DIR / "norm_act.cpp",
            _DIR / "program.cpp"]
_HEADERS = [_DIR / "isa.h", _DIR / "vec_math.h"]
_NAME = "trainforge_cpu_kernels"  # the library cpp_extension.load builds: <cache_dir>/<_NAME>.so
# -fopenmp: without it ATen's parallel_for compiles to a serial loop (its OpenMP body is under
# #ifdef _OPENMP); the .so then shares the libgomp torch already loaded.
_CFLAGS, _LDFLAGS = ["-O3", "-fopenmp"], ["-fopenmp"]
# How long a process waits for another one's build: 5 files take ~1 min on 2 idle cores and
# several times that on a loaded machine; past this the holder is hung, not building.
WAIT_LIMIT_S = 900.0
# What the fallback costs, for the one line that reports it (measured: docs/benchmarks-archive.md, "Without
# a C++ compiler").
_FALLBACK_COST = ("CPU inference falls back to ATen: decode ~1.5x slower in fp32, ~3x in int4 and ~5-9x in "
                  "q8_0 / q4_0 / GGUF, whose weights are dequantised to fp32 at load (4-7x their memory)")


# The interpreter's own bin directory: the `ninja` package (a dependency) installs its binary
# there, which is not on PATH when the venv's commands run without activating it.
_BIN = os.path.dirname(sys.executable)


def cache_root() -> Path:
    if os.environ.get("TRAINFORGE_KERNEL_CACHE"):
        return Path(os.environ["TRAINFORGE_KERNEL_CACHE"])
    if os.environ.get("TRAINFORGE_CACHE"):
        return Path(os.environ["TRAINFORGE_CACHE"]) / "cpu_kernels"
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "trainforge" / "cpu_kernels"


def cache_dir() -> Path:
    # The build flags live in this file: a change to either rebuilds.
    digest = hashlib.sha256(b"".join(p.read_bytes() for p in [*_SOURCES, *_HEADERS, Path(__file__)])
                            + torch.__version__.encode()).hexdigest()[:16]
    return cache_root() / digest


def toolchain() -> dict:
    """What a build would run with: the C++ compiler and ninja as found on PATH (and the
    compiler's file identity, so an upgrade counts as a new toolchain)."""
    cxx = shutil.which(os.environ.get("CXX") or "c++")
    ident = None
    if cxx:
        st = os.stat(os.path.realpath(cxx))
        ident = [os.path.realpath(cxx), st.st_size, st.st_mtime_ns]
    return {"cxx": cxx, "cxx_file": ident, "ninja": shutil.which("ninja") or shutil.which("ninja", path=_BIN)}



@functools.cache
def _build() -> str | None:
    """Returns None when the kernels are loaded, else the reason (one attempt per process)."""
    return build(announce=get_logger().info)


def build(announce=lambda msg: None, wait_limit_s: float = WAIT_LIMIT_S, sources: list[Path] | None = None,
          name: str = _NAME, entry: Path | None = None) -> str | None:
    """Load the built library, building it first if none is: None on success, else the reason.
    ``announce`` gets the progress lines (building, built); a wait for another builder says so
    on stderr. A failure is reported once
    per cache, through the trainforge logger, and recorded. ``sources`` / ``name`` / ``entry``
    default to the kernels'; other values build another library the same way (tests)."""
    cache = BuildCache(entry or cache_dir())
    lib = cache.entry / f"{name}.so"
    if _load_built(lib):
        return _loaded(name)
    tools = toolchain()
    if (reason := cache.failure(tools)) is not None:
        return reason  # reported when it was recorded
    try:
        with cache.locked(wait_limit_s):
            if _load_built(lib):  # built while this process waited
                return _loaded(name)
            if (reason := cache.failure(tools)) is not None:
                return reason
            reason = _compile(cache, tools, announce, sources or _SOURCES, name)
            if reason is not None:
                cache.record_failure(tools, reason)
                _report(reason, tools, cache)
                return reason
    except TrainforgeError as exc:  # another builder held the lock past the limit: run without
        get_logger().warning(f"trainforge: CPU kernels not loaded ({exc})")
        return str(exc)
    except OSError as exc:  # an unwritable cache: no build, no record; say so (every run, it is not cached)
        reason = f"cannot use the kernel cache {cache.entry.parent} ({exc.strerror or exc})"
        _report(reason, tools, None)
        return reason
    return _loaded(name)  # cpp_extension.load loaded what it built


def _compile(cache: BuildCache, tools: dict, announce, sources: list[Path], name: str) -> str | None:
    if tools["cxx"] is None:
        return f"no C++ compiler: {os.environ.get('CXX') or 'c++'} is not on PATH"
    if tools["ninja"] is None:
        return "ninja is not on PATH (pip install ninja)"
    tmp = cache.fresh_build_dir()
    announce(f"building CPU kernels (first use of this trainforge and torch, ~1 min), cached in {cache.entry}")
    t0 = time.monotonic()
    log = tmp / "build.log"
    path = os.environ.get("PATH", "")
    try:
        if shutil.which("ninja") is None:  # cpp_extension runs `ninja` from PATH
            os.environ["PATH"] = os.pathsep.join([_BIN, path]) if path else _BIN
        with _captured(log):
            from torch.utils import cpp_extension

            cpp_extension.load(name=name, sources=[str(p) for p in sources], build_directory=str(tmp),
                               extra_cflags=_CFLAGS, extra_ldflags=_LDFLAGS, is_python_module=False,
                               verbose=False)
    except Exception as exc:  # compile error, a broken toolchain: fall back, keep the log
        kept = cache.failure_path.with_suffix(".log")
        with contextlib.suppress(OSError):
            with log.open("a") as f:
                f.write(f"\n{type(exc).__name__}: {exc}\n")
            shutil.copyfile(log, kept)
        shutil.rmtree(tmp, ignore_errors=True)
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        return f"the build failed ({first[:200]}; log: {kept})"
    finally:
        os.environ["PATH"] = path
    cache.publish(tmp)
    announce(f"built CPU kernels in {time.monotonic() - t0:.0f} s")
    return None


@contextlib.contextmanager
def _captured(log: Path):
    """Send what the build prints through Python (cpp_extension's compiler warnings, its
    logger) to ``log`` instead of the user's terminal; the compiler's own output is in the
    exception cpp_extension raises."""
    logger = logging.getLogger("torch.utils.cpp_extension")
    with log.open("w") as f, warnings.catch_warnings(record=True) as caught:
        handler = logging.StreamHandler(f)
        old_propagate = logger.propagate
        logger.addHandler(handler)
        logger.propagate = False
        try:
            yield
        finally:
            logger.removeHandler(handler)
            logger.propagate = old_propagate
            for w in caught:
                f.write(f"{w.category.__name__}: {w.message}\n")


def _report(reason: str, tools: dict, cache: BuildCache | None) -> None:
    fix = ("install a C++ compiler (Debian/Ubuntu: apt install g++; Fedora: dnf install gcc-c++) and run again"
           if tools["cxx"] is None else
           f"see the log; a changed compiler retries, or delete {cache.failure_path} to retry now"
           if cache is not None else "set TRAINFORGE_KERNEL_CACHE to a writable directory")
    get_logger().warning(f"trainforge: CPU kernels not built ({reason}): {_FALLBACK_COST}. Fix: {fix}.")


def _loaded(name: str) -> None:
    if name == _NAME:
        _register_fakes()
    return None


def _load_built(lib: Path) -> bool:
    """Load an earlier build of these exact sources directly. ``cpp_extension.load`` would also
    find it up to date, but imports setuptools (+4.4 MiB of a decode process's 80 over a bare
    ``import torch``) and runs ``ninja --version`` and ``c++ -dumpversion`` first. A file that
    does not load (cut short) is built again."""
    if not lib.is_file():
        return False
    try:
        torch.ops.load_library(str(lib))
    except OSError:
        return False
    return True


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
    if _build() is not None:
        return None
    try:
        torch.ops.trainforge_cpu.isa()  # raises if TRAINFORGE_CPU_ISA is unsupported here
    except RuntimeError as exc:
        _warn_once(str(exc).splitlines()[0])
        return None
    return torch.ops.trainforge_cpu
