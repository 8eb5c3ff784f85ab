"""Fixtures for the inference tests: one briefly trained model for quality checks
(perplexity, text), and the C++ CPU kernels. Random-weight models are in helpers.py."""

from __future__ import annotations

from pathlib import Path

import pytest

from conftest import debug_config, train_to


@pytest.fixture(scope="session")
def trained_run(small_data, tmp_path_factory) -> Path:
    """The debug flavor (ffn 192, so every linear is int4-groupable at 32) trained 150 steps
    on the small prepared set: a run directory with one checkpoint and a tokenizer."""
    run_dir = tmp_path_factory.mktemp("trained") / "run"
    cfg = debug_config(small_data, "--training.steps", "150", "--training.lr", "3e-3", "--model.ffn_hidden_dim",
                       "192", "--training.val_interval", "0", "--training.log_interval", "50")
    return train_to(cfg, run_dir)


@pytest.fixture(scope="session")
def ops():
    """``torch.ops.trainforge_cpu``; the test is skipped where the kernels do not build (the warning says why)."""
    from trainforge.infer.cpu_kernels import build

    loaded = build.load_kernels()
    if loaded is None:
        pytest.skip("kernels did not build (warning says why)")
    return loaded
