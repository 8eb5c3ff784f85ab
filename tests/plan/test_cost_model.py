"""The cost model against hand computations: memory of a known layout, the pipeline bubble,
monotone memory under FSDP, the link tiers and why a layout is infeasible. Shapes only:
nothing here builds a model."""

import dataclasses
import math

import pytest

from trainforge.model.config import FLAVORS
from trainforge.plan import comm_model as cm
from trainforge.plan import memory_model as mm
from trainforge.plan.cost_model import estimate
from trainforge.plan.hardware import GPUS, cluster
from trainforge.plan.memory_model import precision_bytes
from trainforge.plan.pipeline_sim import schedule_profile
from trainforge.plan.spec import Layout, Workload

LLAMA_8B = FLAVORS["llama-8b"]


def test_fsdp_model_state_is_16_bytes_per_parameter_over_the_shards():
    # bf16-mixed keeps fp32 parameters (4), fp32 gradients (4) and two fp32 AdamW moments (8):
    # 16 bytes per parameter, sharded 8 ways by FSDP2.
    est = estimate(Workload(LLAMA_8B, seq_len=2048, global_batch=8), Layout(dp_shard=8), cluster("h100", 8))
    b = est.breakdown
    state = b["params_bytes"] + b["grads_bytes"] + b["optimizer_bytes"]
    assert state == pytest.approx(16 * LLAMA_8B.num_params() / 8, rel=1e-9)
    assert est.feasible and est.memory_bytes_per_gpu > state  # activations and FSDP's gathered blocks on top


def test_low_precision_parameters_add_an_fp32_master_copy():
    bf16 = precision_bytes("bf16")
    assert (bf16.param, bf16.grad, 2 * bf16.optimizer_state + bf16.master) == (2, 2, 12)
    assert precision_bytes("bf16-mixed").master == 0
    with pytest.raises(ValueError, match="bf16-mixed"):
        precision_bytes("int3")


def test_activation_checkpointing_trades_memory_for_a_third_more_block_compute():
    w = Workload(LLAMA_8B, seq_len=4096, global_batch=8)
    plain, ckpt = (estimate(w, Layout(dp_shard=8, activation_checkpoint=ac), cluster("h100", 8)) for ac in (0, 1))
    assert ckpt.breakdown["activations_bytes"] < plain.breakdown["activations_bytes"] / 3
    assert 1.2 < ckpt.breakdown["compute_s"] / plain.breakdown["compute_s"] < 4 / 3
    assert ckpt.mfu < plain.mfu  # recomputation is not model FLOPs


@pytest.mark.parametrize("p,m", [(2, 4), (4, 8), (4, 16), (8, 8)])
def test_1f1b_bubble_from_the_action_list_is_the_textbook_value(p, m):
    assert schedule_profile("1f1b", p, m).bubble_fraction == pytest.approx((p - 1) / (m + p - 1))
    assert schedule_profile("gpipe", p, m).bubble_fraction == pytest.approx((p - 1) / (m + p - 1))
    # What each schedule keeps alive on its first rank: 1F1B at most p microbatches, GPipe all m.
    assert schedule_profile("1f1b", p, m).peak_in_flight == min(p, m)
    assert schedule_profile("gpipe", p, m).peak_in_flight == m


def test_zero_bubble_schedule_beats_1f1b_in_the_estimate():
    w = Workload(LLAMA_8B, seq_len=2048, global_batch=32)
    c = cluster("h100", 8)
    one, zbv = (estimate(w, Layout(dp_shard=2, pp=4, microbatches=8, pp_schedule=s), c) for s in ("1f1b", "zbv"))
    assert one.feasible and zbv.feasible
    assert zbv.bubble_fraction < one.bubble_fraction / 2 and zbv.step_s < one.step_s


def test_more_gpus_never_increase_fsdp_memory_per_gpu():
    w = Workload(FLAVORS["llama-70b"], seq_len=4096, global_batch=64)
    mem = [estimate(w, Layout(dp_shard=n, grad_accum_steps=64 // n), cluster("h100", n)).memory_bytes_per_gpu
           for n in (8, 16, 32, 64)]
    assert all(a >= b for a, b in zip(mem, mem[1:])) and mem[0] > mem[-1]


@pytest.mark.parametrize("layout,workload,words", [
    (Layout(tp=3, dp_shard=1), Workload(LLAMA_8B, 2048, 3), "n_heads"),
    (Layout(pp=64, microbatches=64), Workload(LLAMA_8B, 2048, 64), "n_layers"),
    (Layout(dp_shard=2, pp=4, microbatches=3), Workload(LLAMA_8B, 2048, 16), "microbatches"),
    (Layout(dp_shard=8, ep=2), Workload(LLAMA_8B, 2048, 16), "mixture-of-experts"),
    (Layout(dp_shard=8), Workload(LLAMA_8B, 2048, 12), "global batch 12"),
    (Layout(dp_shard=8), Workload(FLAVORS["llama-405b"], 8192, 8), "GiB per GPU"),
])
def test_an_infeasible_layout_says_why(layout, workload, words):
    est = estimate(workload, layout, cluster("h100", layout.n_gpus))
    assert not est.feasible and words in est.why and math.isinf(est.step_s)


def test_expert_parallelism_splits_the_routed_experts():
    w = Workload(FLAVORS["moe-small"], seq_len=512, global_batch=16)
    one, four = (estimate(w, Layout(dp_shard=8, ep=ep), cluster("h100", 8)) for ep in (1, 4))
    assert four.breakdown["params_bytes"] < one.breakdown["params_bytes"]
    assert four.breakdown["ep_comm_s"] > 0 == one.breakdown["ep_comm_s"]


def test_groups_across_nodes_use_the_slower_tier_and_compression_shrinks_their_bytes():
    c = cluster("h100", 16)
    links = cm.axis_links(Layout(dp_replicate=2, dp_shard=8), c)
    assert links["dp_shard"][1].tier == "intra" and links["dp_replicate"][1].tier == "inter"
    # One group member per node: one NIC's worth; a whole node's worth of members: eight.
    assert cm.group_link(c, 2, 8).bandwidth_bytes_per_s == pytest.approx(c.inter.bandwidth_bytes_per_s)
    assert cm.group_link(c, 16, 1).bandwidth_bytes_per_s == pytest.approx(
        min(c.intra.bandwidth_bytes_per_s, 8 * c.inter.bandwidth_bytes_per_s))
    w = Workload(FLAVORS["llama-1b"], seq_len=2048, global_batch=32)
    none, int8 = (estimate(dataclasses.replace(w, compression=codec), Layout(dp_replicate=16), c)
                  for codec in ("none", "int8"))
    assert int8.breakdown["dp_comm_s"] < none.breakdown["dp_comm_s"] / 3  # ~8 of 32 bits


def test_every_gpu_number_has_a_source_and_unknown_names_list_the_known_ones():
    for spec in GPUS.values():
        numeric = [f.name for f in dataclasses.fields(spec) if isinstance(getattr(spec, f.name), (int, float, dict))
                   and f.name not in ("name", "sources")]
        assert set(numeric) <= set(spec.sources), spec.name
        assert spec.peak_flops["bf16"] > spec.peak_flops["fp32"]
    with pytest.raises(ValueError, match="a100-80g, h100, h200, h800, mi300x"):
        cluster("v100", 8)


@pytest.mark.parametrize("flavor", ["debug", "tiny", "moe-debug", "dsv3-debug"])
def test_activation_formula_matches_what_autograd_saves(flavor):
    # The per-token bytes the cost model assumes for every block plus the head's norm, against
    # the bytes saved for backward by a real fp32 forward on CPU: the difference of two sequence
    # lengths, so constants (the rotary tables) cancel.
    import torch

    from trainforge.model.llama import build_model
    from trainforge.plan.memory_model import block_activation_elements
    from trainforge.precision.memory import measure_activation_bytes

    cfg = FLAVORS[flavor]
    model = build_model(cfg, seed=0)
    saved = {}
    for T in (32, 64):
        tokens = torch.randint(0, cfg.vocab_size, (2, T), generator=torch.Generator().manual_seed(0))
        saved[T] = sum(measure_activation_bytes(model, lambda: model(tokens)).values())
    measured_per_token = (saved[64] - saved[32]) / (2 * 32)
    predicted = sum(block_activation_elements(cfg, i, 4) * 4 for i in range(cfg.n_layers)) + 3 * cfg.dim * 4
    assert predicted == pytest.approx(measured_per_token, rel=0.02)


def test_hourglass_blocks_are_priced_at_their_shortened_rate_and_pipelines_refused():
    cfg = FLAVORS["hourglass-small"]
    table = mm.layer_table(cfg, 1024, 2)
    # the shortened middle runs on 1/k of the tokens: the planner's per-block sum is the model's own
    # count (less the pooling projections), well under a full-rate stack of the same blocks
    assert sum(table.flops_per_token) + table.head_flops_per_token == pytest.approx(cfg.flops_per_token(1024),
                                                                                    rel=0.01)
    w = Workload(cfg, seq_len=1024, global_batch=16)
    est = estimate(w, Layout(pp=2, dp_shard=4, microbatches=4), cluster("h100", 8))
    assert not est.feasible and "hourglass" in est.why and "pp_split" in est.why
    assert estimate(w, Layout(dp_shard=8), cluster("h100", 8)).feasible
