"""Build a C++ source list with torch.utils.cpp_extension, once per source + torch, into a cache a
killed build cannot wedge, and load it; shared by the decode kernels (``infer/cpu_kernels/``) and
the CPU AdamW (``optim/``), each with its own sources, library name and fallback message.

The cache root is ``$TRAINFORGE_KERNEL_CACHE``, else ``$TRAINFORGE_CACHE/cpu_kernels``, else
``~/.cache/trainforge/cpu_kernels`` (``$XDG_CACHE_HOME`` honoured); locking, the private build
directory and the failure record are ``build_cache.py``'s. ``isa.h`` (beside this file) is on
every build's include path.

When there is no compiler or the build fails, ``build`` returns the reason and the caller runs
its fallback. One line says so, once per cache: the failure is recorded with the toolchain it
happened with, so later runs neither rebuild nor repeat it until the toolchain changes.
"""

from __future__ import annotations

import contextlib
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
from trainforge.log import get_logger
from trainforge.native.build_cache import BuildCache

INCLUDE_DIR = Path(__file__).parent  # isa.h
# -fopenmp: without it ATen's parallel_for compiles to a serial loop (its OpenMP body is under
# #ifdef _OPENMP); the .so then shares the libgomp torch already loaded.
_CFLAGS, _LDFLAGS = ["-O3", "-fopenmp"], ["-fopenmp"]
# How long a process waits for another one's build: the decode kernels' 5 files take ~1 min on 2
# idle cores and several times that on a loaded machine; past this the holder is hung, not building.
WAIT_LIMIT_S = 900.0

# The interpreter's own bin directory: the `ninja` package (a dependency) installs its binary
# there, which is not on PATH when the venv's commands run without activating it.
_BIN = os.path.dirname(sys.executable)


def cache_root() -> Path:
    if os.environ.get("TRAINFORGE_KERNEL_CACHE"):
        return Path(os.environ["TRAINFORGE_KERNEL_CACHE"])
    if os.environ.get("TRAINFORGE_CACHE"):
        return Path(os.environ["TRAINFORGE_CACHE"]) / "cpu_kernels"
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "trainforge" / "cpu_kernels"


def cache_entry(files: list[Path]) -> Path:
    """The cache directory of a build of ``files`` (sources, headers, the Python file holding its
    flags): a change to any of them, to the shared header, this file or torch rebuilds."""
    shared = sorted(INCLUDE_DIR.glob("*.h")) + [Path(__file__)]
    digest = hashlib.sha256(b"".join(p.read_bytes() for p in [*files, *shared])
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


def build(sources: list[Path], name: str, entry: Path, announce=lambda msg: None,
          wait_limit_s: float = WAIT_LIMIT_S, what: str = "CPU kernels", fallback_cost: str = "",
          duration: str = "~1 min", cflags: tuple[str, ...] = ()) -> str | None:
    """Load the library ``<entry>/<name>.so``, building it from ``sources`` first if none is:
    None on success, else the reason. ``announce`` gets the progress lines (building, built); a
    wait for another builder says so on stderr. A failure is reported once per cache, through
    the trainforge logger (``what`` names the library, ``fallback_cost`` says what running
    without it costs), and recorded. ``cflags``: compiler flags beyond the shared ones (they belong
    in a file ``cache_entry`` hashes)."""
    cache = BuildCache(entry, what)
    lib = cache.entry / f"{name}.so"
    if load_built(lib):
        return None
    tools = toolchain()
    if (reason := cache.failure(tools)) is not None:
        return reason  # reported when it was recorded
    try:
        with cache.locked(wait_limit_s):
            if load_built(lib):  # built while this process waited
                return None
            if (reason := cache.failure(tools)) is not None:
                return reason
            reason = _compile(cache, tools, announce, sources, name, what, duration, list(cflags))
            if reason is not None:
                cache.record_failure(tools, reason)
                _report(reason, tools, cache, what, fallback_cost)
                return reason
    except TrainforgeError as exc:  # another builder held the lock past the limit: run without
        get_logger().warning(f"trainforge: {what} not loaded ({exc})")
        return str(exc)
    except OSError as exc:  # an unwritable cache: no build, no record; say so (every run, it is not cached)
        reason = f"cannot use the kernel cache {cache.entry.parent} ({exc.strerror or exc})"
        _report(reason, tools, None, what, fallback_cost)
        return reason
    return None  # cpp_extension.load loaded what it built


def _compile(cache: BuildCache, tools: dict, announce, sources: list[Path], name: str, what: str,
             duration: str, cflags: list[str]) -> str | None:
    if tools["cxx"] is None:
        return f"no C++ compiler: {os.environ.get('CXX') or 'c++'} is not on PATH"
    if tools["ninja"] is None:
        return "ninja is not on PATH (pip install ninja)"
    tmp = cache.fresh_build_dir()
    announce(f"building {what} (first use of this trainforge and torch, {duration}), cached in {cache.entry}")
    t0 = time.monotonic()
    log = tmp / "build.log"
    path = os.environ.get("PATH", "")
    try:
        if shutil.which("ninja") is None:  # cpp_extension runs `ninja` from PATH
            os.environ["PATH"] = os.pathsep.join([_BIN, path]) if path else _BIN
        with _captured(log):
            from torch.utils import cpp_extension

            cpp_extension.load(name=name, sources=[str(p) for p in sources], build_directory=str(tmp),
                               extra_cflags=_CFLAGS + cflags, extra_ldflags=_LDFLAGS, extra_include_paths=[str(INCLUDE_DIR)],
                               is_python_module=False, verbose=False)
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
    announce(f"built {what} in {time.monotonic() - t0:.0f} s")
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


def _report(reason: str, tools: dict, cache: BuildCache | None, what: str, fallback_cost: str) -> None:
    fix = ("install a C++ compiler (Debian/Ubuntu: apt install g++; Fedora: dnf install gcc-c++) and run again"
           if tools["cxx"] is None else
           f"see the log; a changed compiler retries, or delete {cache.failure_path} to retry now"
           if cache is not None else "set TRAINFORGE_KERNEL_CACHE to a writable directory")
    cost = f": {fallback_cost}" if fallback_cost else ""
    get_logger().warning(f"trainforge: {what} not built ({reason}){cost}. Fix: {fix}.")


def load_built(lib: Path) -> bool:
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


def usable_ops(built: str | None, namespace: str, warn) -> object | None:
    """``torch.ops.<namespace>`` of a library whose build ``built`` reported (None: loaded, else
    the reason it is not), or None where it is unusable: a failed build (reported by ``build``)
    or an instruction path forced by TRAINFORGE_CPU_ISA that this CPU lacks (``warn(reason)``)."""
    if built is not None:
        return None
    ops = getattr(torch.ops, namespace)
    try:
        ops.isa()  # raises if TRAINFORGE_CPU_ISA is unsupported here
    except RuntimeError as exc:
        warn(str(exc).splitlines()[0])
        return None
    return ops
