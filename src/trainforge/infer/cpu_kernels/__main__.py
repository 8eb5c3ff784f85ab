"""``python -m trainforge.infer.cpu_kernels``: build the CPU kernels now (``make install`` runs
it), so no later command pays for the build. Exits 0 without a compiler too: every format
has a fallback, and ``build`` has said what it costs."""

from __future__ import annotations

import time

from trainforge.infer.cpu_kernels.build import build, cache_dir, toolchain
from trainforge.native.build_cache import BuildCache


def main() -> int:
    t0 = time.monotonic()
    recorded = BuildCache(cache_dir()).failure(toolchain())  # a failure build() will not report again
    built = []
    reason = build(announce=lambda msg: (built.append(msg), print(msg, flush=True)))
    if reason is None and not built:
        print(f"CPU kernels up to date in {cache_dir()} ({time.monotonic() - t0:.1f} s to load)")
    elif reason is not None and reason == recorded:
        print(f"CPU kernels not built ({reason}, recorded in {BuildCache(cache_dir()).failure_path}); "
              "trainforge runs on the fallback kernels")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
