"""The training log as a user reads it: a startup summary in words, a line per checkpoint,
MFU against a peak it never exceeds, an ETA that survives an 80-column terminal, and no
profiler chatter."""

import io
import os
import re
import subprocess
import sys
import time

import pytest
from rich.console import Console

from tests.conftest import debug_config, train_to
from trainforge.model.config import FLAVORS
from trainforge.monitor.jsonl import read_jsonl
from trainforge.parallel.dims import ParallelDims
from trainforge.train import mfu as mfu_mod
from trainforge.train.metrics import ConsoleReporter
from trainforge.train.run_summary import layout_text, startup_summary

REPR = re.compile(r"\b[A-Z]\w*\(\w+=")  # a dataclass / object repr: ParallelDims(pp=1, ...)


def test_a_short_run_logs_its_summary_checkpoints_and_an_mfu_of_at_most_1(tmp_path, small_data, capsys,
                                                                           monkeypatch):
    monkeypatch.setenv("TRAINFORGE_CACHE", str(tmp_path / "cache"))  # no peak cached from other tests
    # Every probe as on a machine busy with something else: a peak far below what the run achieves.
    monkeypatch.setattr(mfu_mod, "measure_matmul_peak", lambda *a, **kw: 1e3)
    run = train_to(debug_config(small_data, "--training.steps", "6", "--training.log_interval", "3",
                                "--checkpoint.interval", "3"), tmp_path / "run")
    err = capsys.readouterr().err

    for expected in ("model: debug, 0.16M parameters, vocab 512", "layout: single process, no parallelism (cpu)",
                     "precision: fp32 (params fp32, compute fp32", f"data: {small_data} (",
                     "train tokens); seq_len 64, batch 8 = 512 tokens/step", "steps: 6 (3,072 tokens, ",
                     "mfu peak: ", "measured: best of 5 fp32 matmul probes"):
        assert expected in err, expected
    assert "ParallelDims(" not in err and not REPR.search(err), err
    for step in (3, 6):
        path = run / "checkpoints" / f"step_{step:07d}"
        assert re.search(rf"checkpoint step {step} saved: {re.escape(str(path))} \([0-9.]+ [kMG]?B, [0-9.]+ s\)", err)
    assert re.search(r"step 3/6 eta \d+:\d\d:\d\d loss \d", err)  # the plain (non-TTY) progress line

    train = [r for r in read_jsonl(run / "metrics.jsonl") if "loss" in r]
    assert len(train) == 6
    assert all(0 < r["mfu"] <= 1 for r in train)
    assert all(r["mfu_peak_flops"] > 1e3 for r in train)  # raised: at least what the run achieved
    assert all(r["mfu_peak_source"].startswith("achieved: step ") for r in train)
    assert "mfu peak raised from" in err


def test_layouts_read_as_words():
    assert layout_text(ParallelDims(1, 1, 4, 2, 8), "cuda") == \
        "FSDP2 over 4 ranks, TP 2: 8 ranks (pp 1 x dp_replicate 1 x dp_shard 4 x tp 2, cuda)"
    assert layout_text(ParallelDims(1, 2, 1, 1, 2), "cpu") == \
        "DDP over 2 ranks (pp 1 x dp_replicate 2 x dp_shard 1 x tp 1, cpu)"
    assert layout_text(ParallelDims(1, 1, 1, 2, 2), "cpu") == "TP 2: 2 ranks (pp 1 x dp_replicate 1 x dp_shard 1 x tp 2, cpu)"
    assert layout_text(ParallelDims(2, 2, 2, 1, 8, ep=2), "cuda").startswith(
        "HSDP over 2 x 2 ranks (FSDP2, replicate x shard), PP 2, EP 2: 8 ranks")
    assert layout_text(ParallelDims(1, 1, 1, 1, 1), "cpu") == "single process, no parallelism (cpu)"


def test_the_summary_of_a_moe_run_gives_active_parameters_and_the_whole_batch():
    from trainforge.train.section import TrainingSection

    tcfg = TrainingSection(steps=100, batch_size=4, grad_accum_steps=2, seq_len=128)
    dims = ParallelDims(1, 1, 4, 1, 4)
    moe = FLAVORS["dsv3-debug"]
    lines = startup_summary(model_name="dsv3-debug", params_text=moe.describe_params(), vocab_size=512, dims=dims,
                            device_type="cuda", precision_preset="bf16", precision_text="params fp32, compute bf16",
                            data_label="/data/x", train_tokens=1_000_000, tcfg=tcfg, tokens_per_step=4 * 2 * 128 * 4,
                            start_step=40,
                            peak_text="3.96 PFLOP/s (4 x 989 TFLOP/s), published: NVIDIA H200 bf16 dense")
    text = "\n".join(lines)
    assert "active per token" in lines[0]
    assert "batch 4 x 2 accum x 4 dp = 4,096 tokens/step" in text
    assert "steps: 100 (409,600 tokens, 0.41 epochs), from step 40" in text
    assert "published: NVIDIA H200 bf16 dense" in text and not REPR.search(text)


RECORD = {"loss": 6.21184, "lr": 1e-3, "grad_norm": 0.846, "tokens_per_s": 123456.7, "mfu": 0.123}


def rendered_progress(console: Console) -> list[str]:
    """The live progress line(s) as a terminal of the console's width shows them."""
    reporter = ConsoleReporter(10000, 0, console=console)
    reporter.step(100, RECORD)
    time.sleep(0.05)  # rich estimates the speed (and so the ETA) from two updates some time apart
    reporter.step(200, RECORD)
    reporter.progress.stop()
    frame = Console(width=console.width, record=True, file=io.StringIO())
    frame.print(reporter.progress.get_renderable())
    return frame.export_text().splitlines()


@pytest.mark.parametrize("how", ["Console(width=80)", "COLUMNS=80"])
def test_at_80_columns_the_progress_line_keeps_step_loss_and_eta(how, monkeypatch):
    if how == "COLUMNS=80":
        monkeypatch.setenv("COLUMNS", "80")
        console = Console(file=io.StringIO(), force_terminal=True)
    else:
        console = Console(width=80, file=io.StringIO(), force_terminal=True)
    assert console.width == 80
    lines = rendered_progress(console)
    assert len(lines) == 1 and len(lines[0]) <= 80, lines
    line = lines[0]
    assert "step 200/10000" in line and "loss 6.2118" in line
    assert re.search(r"\b\d+:\d\d:\d\d\b", line), line  # the ETA, not rich's "-:--:--" placeholder
    assert "grad_norm" not in line  # the least important field made room


def test_a_wide_terminal_shows_every_field():
    line = rendered_progress(Console(width=160, file=io.StringIO(), force_terminal=True))[0]
    for field in ("loss 6.2118", "lr 1.00e-03", "grad_norm 0.846", "123,457 tok/s", "mfu 12.3%"):
        assert field in line, line


PROFILE = ("import torch\nfrom torch.profiler import profile, ProfilerActivity\n{setup}\n"
           "with profile(activities=[ProfilerActivity.CPU]):\n    torch.ones(8, 8) @ torch.ones(8, 8)\n")


def test_profiler_lines_stay_out_of_the_log():
    # A fresh process: kineto reads its log level once, at the process's first profiler. Without
    # trainforge's logger the profiled step prints "USDT: ... profiler_start" and "profiler_stop".
    env = {k: v for k, v in os.environ.items() if k != "KINETO_LOG_LEVEL"}
    setup = "from trainforge.log import get_logger\nget_logger().info('trained')"
    proc = subprocess.run([sys.executable, "-c", PROFILE.format(setup=setup)], env=env, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr.endswith(" trained\n") and proc.stderr.count("\n") == 1, proc.stderr
