"""Shared fixtures. The built-in corpus is prepared once per test session into a
private cache (TRAINFORGE_CACHE), so tests never touch the user's ~/.cache."""

from __future__ import annotations

import os
import sysconfig
from pathlib import Path

import pytest
import torch

from trainforge.config import load_config
from trainforge.data.prepare import PrepareOptions, default_data_dir, prepare
from trainforge.infer.cpu_kernels.build import cache_root
from trainforge.precision.hardware import cpu_compile_unavailable

# torch.compile on the CPU (inductor) compiles C++: tests of compiled paths need a compiler. Without
# one, --compile and parallel.compile are refused in one line (tests/faults/test_kernel_build.py).
needs_cpu_compile = pytest.mark.skipif(cpu_compile_unavailable() is not None,
                                       reason=str(cpu_compile_unavailable()))

# The C++ kernels `make install` built (a cache keyed by their sources and torch) serve every test
# process; the TRAINFORGE_CACHE each session sets below would otherwise make each build its own.
os.environ.setdefault("TRAINFORGE_KERNEL_CACHE", str(cache_root()))

# Under pytest-xdist (`make test` runs the single-process tests on one worker per core) each
# worker and the processes it starts use one thread: two 2-thread workers on 2 cores collapse.
if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)

DEBUG_TRAIN = ["--model.flavor", "debug", "--training.batch_size", "8", "--training.seq_len", "64",
               "--training.log_interval", "5", "--training.warmup_steps", "5", "--training.val_batches", "4",
               "--sample.max_new_tokens", "0"]


@pytest.fixture(scope="session", autouse=True)
def tf_cache(tmp_path_factory) -> Path:
    cache = tmp_path_factory.mktemp("tfcache")
    os.environ["TRAINFORGE_CACHE"] = str(cache)
    return cache


@pytest.fixture(scope="session")
def builtin_data(tf_cache) -> Path:
    """The built-in corpus (Python stdlib sources), vocab 8192, prepared as `trainforge train` does."""
    return default_data_dir(8192)


@pytest.fixture(scope="session")
def small_data(tmp_path_factory) -> Path:
    """A small prepared set (a dozen stdlib modules, vocab 512): fast to prepare and train on."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    files = [str(stdlib / n) for n in ("argparse.py", "ast.py", "dataclasses.py", "enum.py", "functools.py",
                                       "inspect.py", "json/encoder.py", "json/decoder.py", "pathlib.py",
                                       "random.py", "shutil.py", "textwrap.py", "typing.py")]
    out = tmp_path_factory.mktemp("small") / "data"
    prepare(files, out, PrepareOptions(vocab_size=512, val_fraction=0.1), log=lambda *_: None)
    return out


def debug_config(data: Path, *extra: str):
    return load_config(None, [*DEBUG_TRAIN, "--data.path", str(data), *extra])


def fit_run(cfg, run_dir: Path, resume=False, callbacks=None):
    """Train ``cfg`` into ``run_dir`` in this process (a Trainer, fit, close); returns
    (what ``fit`` returned, the closed trainer)."""
    from trainforge.train.trainer import Trainer

    t = Trainer(cfg, run_dir, resume=resume, callbacks=callbacks, progress=False)
    try:
        return t.fit(), t
    finally:
        t.close()


def train_to(cfg, run_dir: Path) -> Path:
    """Train ``cfg`` into ``run_dir`` in this process; returns ``run_dir``."""
    fit_run(cfg, run_dir)
    return run_dir


class StopAt:
    """Callback: stop the run (checkpointing) at ``step``, as an interruption would."""

    def __init__(self, step):
        self.step = step

    def on_step_end(self, trainer, step):
        if step == self.step:
            trainer.request_stop("test interruption")
