"""The published recipes are expressible in `trainforge plan`: DeepSeek-V3's board (h800), FP8
priced from each board's FP8 peak (refused by name where there is none), and microbatch
counts derived from the batch as Megatron derives them, so DeepSeek-V3's own layout (2048
H800, PP 16, EP 64, batch 15,360) is a row the planner prices."""

from __future__ import annotations

import dataclasses
import json
import math

import pytest

from trainforge.cli import main
from trainforge.model.config import FLAVORS
from trainforge.plan import published as pub
from trainforge.plan.cost_model import estimate
from trainforge.plan.hardware import GPUS, cluster
from trainforge.plan.spec import Layout, Workload


def test_h800_and_fp8_are_planned_from_the_command_line(capsys):
    assert main(["plan", "--model", "llama-8b", "--gpus", "8", "--gpu", "h800", "--precision", "fp8",
                 "--seq_len", "4096", "--global_batch", "16", "--json", "--top", "3"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["gpu"] == "h800" and doc["precision"] == "fp8"
    assert doc["layouts"] and doc["layouts"][0]["feasible"]


def test_fp8_is_refused_by_name_on_a_board_without_it(capsys):
    assert main(["plan", "--model", "llama-8b", "--gpus", "8", "--gpu", "a100-80g", "--precision", "fp8"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "a100-80g has no FP8" in err and "--precision bf16-mixed" in err


def test_h800_is_the_h100_with_deepseeks_nvlink():
    h800, h100 = GPUS["h800"], GPUS["h100"]
    assert h800.peak_flops == h100.peak_flops and h800.memory_bytes == h100.memory_bytes
    assert h800.peak_flops["fp8"] == pytest.approx(2 * h800.peak_flops["bf16"], rel=1e-3)
    # NVLink 400 GB/s bidirectional; x 0.8 link efficiency = the 160 GB/s DeepSeek-V3 reports reaching
    assert cluster("h800", 16).intra.bandwidth_bytes_per_s == pytest.approx(160e9)
    assert "h800" in h800.sources["peak_flops"].lower()


@pytest.mark.parametrize("gpu", ["h100", "mi300x"])  # with a kernel table, and without one
def test_fp8_prices_the_linear_gemms_at_the_fp8_peak(gpu):
    cfg = FLAVORS["llama-8b"]
    layout = Layout(dp_shard=8)
    bf16 = estimate(Workload(cfg, seq_len=4096, global_batch=16), layout, cluster(gpu, 8))
    fp8 = estimate(Workload(cfg, seq_len=4096, global_batch=16, precision="fp8"), layout, cluster(gpu, 8))
    assert bf16.feasible and fp8.feasible
    ratio = fp8.breakdown["compute_s"] / bf16.breakdown["compute_s"]
    assert 0.5 < ratio < 0.75, ratio  # the GEMMs at twice the rate; attention and the head stay bf16
    assert fp8.memory_bytes_per_gpu == pytest.approx(bf16.memory_bytes_per_gpu)  # bf16-mixed bytes held
    # MFU stays of the bf16 peak, so it compares across precisions
    peak = cluster(gpu, 8).peak_flops["bf16"]
    assert fp8.mfu == pytest.approx(fp8.breakdown["model_flops"] / (fp8.step_s * 8 * peak))


def test_microbatch_counts_are_derived_from_the_batch_and_bounded():
    from trainforge.plan.planner import microbatch_counts

    # DeepSeek-V3: 15,360 / dp 128 = 120 per rank; no multiple of pp = 16 divides it
    assert microbatch_counts(120, 16) == [20, 40, 120]
    assert microbatch_counts(64, 16) == [16, 32, 64]  # where the old grid divides, it is the old grid
    assert microbatch_counts(8, 1) == [1] and microbatch_counts(8, 16) == []
    for pp in (2, 3, 4, 8, 16, 32):
        for b in range(1, 1025):
            counts = microbatch_counts(b, pp)
            assert len(counts) <= 4 and all(b % m == 0 and m >= pp for m in counts), (b, pp, counts)
            assert counts or b < pp


def test_deepseek_v3_row_is_priced_within_the_validation_tolerance():
    row = next(r for r in pub.ROWS if r.source == "deepseek-v3")
    # published: 2.664M H800 GPU hours for 14.8T tokens = 180K per trillion
    assert row.value == pytest.approx(1e12 / (180e3 * 3600), rel=1e-3)
    assert (row.gpu, row.n_gpus, row.global_batch, row.seq_len) == ("h800", 2048, 15360, 4096)
    assert (row.layout.pp, row.layout.ep, row.layout.dp, row.layout.tp) == (16, 64, 128, 1)
    assert row.workload().precision == "fp8" and not row.in_target and row.excluded_why
    (c,) = pub.compare([row])
    assert c.estimate.feasible, c.estimate.why
    assert abs(c.rel_error) <= pub.TARGET_MEDIAN_ERROR, c.rel_error  # -8.7 % at this commit


@pytest.mark.slow
def test_deepseek_v3_is_planned_on_2048_h800_with_its_batch(capsys):
    """The whole search (tens of seconds): the batch that gave "no layout fits" now has a plan,
    and the published layout's shape (pp 16, 120 microbatches) is among the feasible ones."""
    assert main(["plan", "--model", "deepseek-v3-671b", "--gpus", "2048", "--gpu", "h800", "--precision", "fp8",
                 "--seq_len", "4096", "--global_batch", "15360", "--json", "--top", "3"]) == 0
    doc = json.loads(capsys.readouterr().out)
    best = doc["layouts"][0]
    assert best["feasible"] and math.isfinite(best["step_s"])
    assert best["layout"]["pp"] == 16 and best["layout"]["microbatches"] == 120
    assert dataclasses.asdict(Layout()).keys() == best["layout"].keys()
