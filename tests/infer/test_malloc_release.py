"""The load's malloc policy (infer/malloc_release.py): tensors a load frees leave the process."""

import subprocess
import sys

import pytest

from trainforge.infer import malloc_release

# 48 blocks of 1 MiB, every other one freed: the freed ones are holes between live blocks, which
# a heap cannot hand back by trimming its top. Prints the RSS drop in MiB when they are freed.
_HOLES = """
import re, sys
import numpy as np
from trainforge.infer import malloc_release
def rss():
    return int(re.search(r"VmRSS:\\s+(\\d+)", open("/proc/self/status").read()).group(1)) / 1024
if sys.argv[1] == "load":
    malloc_release.map_large_blocks_for_load()
warm = np.ones(1 << 18, dtype=np.float32); del warm  # one freed map: glibc's dynamic threshold rises
blocks = [np.ones(1 << 18, dtype=np.float32) for _ in range(48)]
before = rss()
del blocks[::2]
print(before - rss())
"""


@pytest.mark.skipif(malloc_release._glibc() is None, reason="the policy is glibc's mallopt; this C library is not glibc")
def test_load_policy_returns_freed_tensors_at_once():
    drop = {mode: float(subprocess.run([sys.executable, "-c", _HOLES, mode], capture_output=True, text=True,
                                       check=True).stdout) for mode in ("default", "load")}
    assert drop["default"] < 8  # the problem: 24 MiB freed, still resident
    assert drop["load"] > 20  # each block was its own map: freed is gone


@pytest.mark.skipif(malloc_release._glibc() is None, reason="glibc only")
def test_release_runs_and_reports_it():
    assert subprocess.run([sys.executable, "-c", "from trainforge.infer import malloc_release as m; "
                           "assert m.map_large_blocks_for_load() and m.release_freed_memory()"]).returncode == 0
