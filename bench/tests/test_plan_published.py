"""The published validation rows (plan/published.py), the harness that compares them with the
cost model, and DeepSpeed's memory formulas (plan/published_memory.py)."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import pytest

from trainforge.model.config import FLAVORS
from trainforge.plan import published as pub
from trainforge.plan import published_memory as mem
from trainforge.plan.spec import Cluster, Estimate, LinkTier

ROOT = Path(__file__).resolve().parents[2]


def _cp(row: pub.PublishedRow) -> int:
    return row.published.get("cp") or 1


def test_every_row_cites_a_source_and_quotes_its_line():
    ids = [r.id for r in pub.ROWS]
    assert len(ids) == len(set(ids)), "row ids must be unique"
    assert {r.source for r in pub.ROWS} <= set(pub.SOURCES)
    for url in pub.SOURCES.values():
        assert url.startswith("https://")
    for r in pub.ROWS:
        assert r.quote.strip(), r.id
        assert r.in_target or r.excluded_why, f"{r.id}: a row left out of the median must say why"
        assert r.precision in ("bf16", "float8")
        assert not (r.in_target and r.precision != "bf16"), f"{r.id}: only bf16 rows count toward the target"


def test_layouts_multiply_to_the_gpu_count_and_match_what_was_published():
    for r in pub.ROWS:
        lay, p = r.layout, r.published
        assert lay.n_gpus * _cp(r) == r.n_gpus, r.id
        assert lay.tp == p["tp"] and lay.pp == p["pp"], r.id
        dp = p.get("dp") or p.get("fsdp")
        if dp is not None:
            assert dp * p["tp"] * p["pp"] * _cp(r) == r.n_gpus, r.id
            assert lay.dp == dp, r.id
        # each data-parallel rank gets a whole number of sequences per microbatch
        per_rank = r.global_batch / (lay.dp * lay.grad_accum_steps * lay.microbatches)
        assert per_rank >= 1 and per_rank == int(per_rank), r.id
        if "local_batch" in p:
            assert r.global_batch == p["local_batch"] * lay.dp, r.id


def test_megatron_shapes_have_the_published_sizes_and_flop_count():
    rows = [r for r in pub.ROWS if r.source == "megatron"]
    assert len(rows) == 9
    for r in rows:
        size = float(re.match(r"GPT ([\d.]+)B", r.model_name).group(1))
        assert r.model.num_params() / 1e9 == pytest.approx(size, rel=0.03), r.id
        # Megatron's MFU numerator (Narayanan et al. 2021) per token: the SwiGLU mapping keeps it
        m, s = r.model, r.seq_len
        megatron = 72 * m.n_layers * m.dim**2 * (1 + s / (6 * m.dim) + m.vocab_size / (12 * m.n_layers * m.dim))
        assert m.flops_per_token(s) == pytest.approx(megatron, rel=1e-3), r.id
        # the transcription: TFLOP/s / peak is the table's rounded MFU
        mfu = float(r.published["mfu"].rstrip("%")) / 100
        assert r.value * 1e12 / pub.H100_BF16_PEAK_FLOPS == pytest.approx(mfu, abs=0.011), r.id


def test_published_metrics_are_plausible_utilisations():
    """Each figure, converted with our FLOPs per token, is a believable H100 MFU; the 405B
    torchtitan row's own MFU (29.0 %) comes back, so our FLOP count is theirs too."""
    for r in pub.ROWS:
        flops = r.model.flops_per_token(r.seq_len)
        tflops = r.value if r.metric == "tflops_per_gpu" else r.value * flops / 1e12
        assert 0.15 < tflops * 1e12 / pub.H100_BF16_PEAK_FLOPS < 0.65, r.id
    row = next(r for r in pub.ROWS if r.id == "torchtitan-405b-fsdp16-tp8")
    mfu = row.value * row.model.flops_per_token(row.seq_len) / pub.H100_BF16_PEAK_FLOPS
    assert mfu == pytest.approx(0.290, abs=0.005)


def test_the_issue_asks_for_megatron_and_torchtitan_llama_rows_in_the_target():
    target = [r for r in pub.ROWS if r.in_target]
    assert sum(r.source == "megatron" for r in target) == 9
    assert {r.flavor for r in target if r.source.startswith("torchtitan")} == {"llama-8b", "llama-70b", "llama-405b"}


# ----------------------------------------------------------------------------- harness, fake model
def _fake_cluster(name: str, n: int) -> Cluster:
    link = LinkTier(bandwidth_bytes_per_s=1e11, latency_s=1e-5)
    return Cluster(name=name, n_gpus=n, gpus_per_node=8, peak_flops={"bf16": 989e12}, memory_bytes=80 * 2**30,
                   memory_bandwidth_bytes_per_s=3e12, intra=link, inter=link)


def _fake_estimate(mfu: float):
    """An estimate that reaches ``mfu`` of the bf16 peak on every layout, 16 B/param sharded."""
    def estimate(workload, layout, cluster):
        tok = mfu * cluster.peak_flops["bf16"] / workload.model.flops_per_token(workload.seq_len)
        p = workload.model.num_params() / (layout.dp_shard * layout.tp * layout.pp)
        return Estimate(layout=layout, step_s=1.0, memory_bytes_per_gpu=16 * p, mfu=mfu, comm_share=0.1,
                        bubble_fraction=0.0, tokens_per_s_per_gpu=tok,
                        breakdown={"params_bytes": 4 * p, "grads_bytes": 4 * p, "optimizer_bytes": 8 * p})
    return estimate


def test_harness_scores_a_model_that_predicts_the_published_utilisation_exactly():
    # a fake that hits each Megatron row's own utilisation gives zero error on it
    for r in [r for r in pub.ROWS if r.source == "megatron"][:3]:
        (c,) = pub.compare([r], estimate=_fake_estimate(r.value * 1e12 / 989e12), cluster=_fake_cluster)
        assert c.rel_error == pytest.approx(0.0, abs=1e-9)


def test_harness_error_and_median_follow_the_prediction():
    comps = pub.compare(estimate=_fake_estimate(0.40), cluster=_fake_cluster)
    assert all(_cp(c.row) == 1 for c in comps)  # context-parallel rows are not predicted
    assert len(comps) == sum(_cp(r) == 1 for r in pub.ROWS)
    meg = next(c for c in comps if c.row.id == "megatron-gpt-16b-192")
    assert meg.predicted == pytest.approx(0.40 * 989.0)
    assert meg.rel_error == pytest.approx(0.40 * 989.0 / 489.1 - 1)
    # doubling the prediction doubles (1 + error)
    comps2 = pub.compare(estimate=_fake_estimate(0.80), cluster=_fake_cluster)
    for a, b in zip(comps, comps2):
        assert 1 + b.rel_error == pytest.approx(2 * (1 + a.rel_error))
    errs = sorted(abs(c.rel_error) for c in comps if c.row.in_target)
    assert pub.median_abs_error(comps) == pytest.approx((errs[len(errs) // 2] + errs[(len(errs) - 1) // 2]) / 2)
    with pytest.raises(ValueError):
        pub.median_abs_error([])


def test_constant_mfu_yardstick_is_the_fake_model_at_that_mfu():
    mfu, err = pub.constant_mfu_baseline()
    assert 0.25 < mfu < 0.5 and 0 < err < 1
    comps = pub.compare(estimate=_fake_estimate(mfu), cluster=_fake_cluster)
    assert pub.median_abs_error(comps) == pytest.approx(err, rel=1e-6)


# ----------------------------------------------------------------------------- DeepSpeed formulas
def test_deepspeed_formulas_reproduce_its_documented_outputs():
    for case in mem.DOC_CASES:
        assert round(case.computed_gb(), 2) == pytest.approx(case.documented_gb, abs=0.006), case.name


def test_stored_llm_analysis_figures_are_18_bytes_per_parameter_of_its_own_count():
    for (flavor, n), (params, weight, grad, opt) in mem.LLM_ANALYSIS.items():
        assert (weight + grad + opt) * n / params == pytest.approx(18.0, rel=1e-3), flavor
        assert params < FLAVORS[flavor].num_params()  # its two-matrix MLP: fewer than the SwiGLU shape has


def test_memory_comparison_reads_the_estimate_breakdown():
    comps = mem.compare_memory(_fake_estimate(0.4), _fake_cluster)
    assert [(m.flavor, m.n_gpus) for m in comps] == list(mem.MEMORY_CASES)
    for m in comps:
        p = FLAVORS[m.flavor].num_params()
        assert m.ours_bytes == pytest.approx(16 * p / m.n_gpus)
        assert m.deepspeed_sharded_bytes == pytest.approx(18 * p / m.n_gpus)
        assert m.ratio < 16 / 18  # DeepSpeed also counts a half-precision copy and the gathered layer


def test_bench_prints_the_table_and_json(capsys):
    sys.path.insert(0, str(ROOT))
    try:
        from bench import plan_validation
    finally:
        sys.path.remove(str(ROOT))
    t = plan_validation.published_table(estimate=_fake_estimate(0.4), cluster=_fake_cluster)
    json.dumps(t)
    assert t["target"] == pub.TARGET_MEDIAN_ERROR and len(t["rows"]) > 20
    plan_validation.print_published(t)
    out = capsys.readouterr().out
    assert "megatron-gpt-462b-6144" in out and "median |error|" in out and "DeepSpeed" in out


# ----------------------------------------------------------------------------- the real cost model
def test_every_row_names_the_stack_that_ran_it():
    from trainforge.plan.gemm_efficiency import STACKS

    for r in pub.ROWS:
        assert r.stack in STACKS and r.workload().stack == r.stack, r.id
        if r.source == "megatron":
            assert r.stack == "megatron", r.id
        elif r.source.startswith("torchtitan"):
            compiled = r.published.get("compile") is not False  # on, or not stated with the preset's compile on
            assert r.stack == ("trainforge-compile" if compiled else "trainforge"), r.id
            assert r.gpu == "h100-96g-500w", r.id  # the 500 W HBM2e board the source names


def test_the_torchtitan_board_has_a_source_for_every_number():
    from trainforge.plan.hardware import VARIANTS, cluster

    spec = VARIANTS["h100-96g-500w"]
    assert spec.sources["peak_flops"] and "torchtitan" in spec.sources["peak_flops"]
    assert "assumption" in spec.sources["memory_bandwidth_bytes_per_s"]
    assert cluster("h100-96g-500w", 8).peak_flops["bf16"] == pytest.approx((989.4 + 835.5) / 2 * 1e12)


def test_the_compile_gain_is_predicted_not_fitted():
    """torchtitan publishes eager and compiled runs of one layout (1.16x at 8 and at 128 GPUs);
    the stacks differ only by the counted elementwise bytes, so the predicted gain is a check."""
    from trainforge.plan import cost_model, hardware

    comps = {c.row.id: c for c in pub.compare(estimate=cost_model.estimate, cluster=hardware.cluster)}
    for n in (8, 128):
        eager, compiled = comps[f"torchtitan-8b-fsdp{n}"], comps[f"torchtitan-8b-fsdp{n}-compile"]
        published = compiled.row.value / eager.row.value
        predicted = compiled.predicted / eager.predicted
        assert 1.05 < predicted < 1.4 and abs(predicted / published - 1) < 0.15, (n, predicted, published)


def test_cost_model_meets_the_published_target():
    cost_model = pytest.importorskip("trainforge.plan.cost_model")
    from trainforge.plan import hardware

    comps = pub.compare(estimate=cost_model.estimate, cluster=hardware.cluster)
    err = pub.median_abs_error(comps)
    detail = ", ".join(f"{c.row.id} {c.rel_error:+.0%}" for c in comps if c.row.in_target)
    assert err <= pub.TARGET_MEDIAN_ERROR, f"median |error| {err:.1%} > {pub.TARGET_MEDIAN_ERROR:.0%}: {detail}"
    # and each family on its own: one stack's terms must not pay for the other's
    for family in ("megatron", "torchtitan"):
        fam = pub.median_abs_error([c for c in comps if c.row.source.startswith(family)])
        assert fam <= pub.TARGET_MEDIAN_ERROR, f"{family}: median |error| {fam:.1%}: {detail}"


def test_every_published_layout_is_one_the_cost_model_accepts():
    cost_model = pytest.importorskip("trainforge.plan.cost_model")
    from trainforge.plan import hardware

    # memory is lifted in compare(), so an infeasible estimate is a layout the trainer would refuse
    bad = [f"{c.row.id}: {c.estimate.why}" for c in pub.compare(estimate=cost_model.estimate,
                                                                  cluster=hardware.cluster) if not c.estimate.feasible]
    assert not bad, bad
