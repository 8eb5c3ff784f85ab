"""Automatic stage balancing: the partition algorithm (hand-checked cases, memory
limits, properties against brute force), layer profiling, drift detection, and a
PP=2 run where the auto split's slowest stage beats the even split's."""

from __future__ import annotations

import itertools
import json
import statistics

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.parallel.torchrun import WORKERS, run_torchrun
from trainforge.errors import ConfigError
from trainforge.model.config import ModelConfig
from trainforge.model.llama import build_model
from trainforge.parallel.stage_balance import (
    LayerCost,
    choose_boundaries,
    plan_stages,
    profile_layer_costs,
    should_rebalance,
    stage_sums,
)

# ---------------------------------------------------------------- partition, by hand


@pytest.mark.parametrize("times, stages, expected", [
    ([1, 1, 1, 1], 2, [0, 2]),
    ([1, 2, 3, 4, 5, 6, 7, 8, 9], 3, [0, 5, 7]),   # 15 | 13 | 17: the slowest can't go below 17
    ([1] * 8 + [20], 3, [0, 4, 8]),                # the big layer alone; the rest split 4 | 4, not 1 | 7
    ([5, 1, 1, 1], 2, [0, 1]),
    ([3, 1, 4, 1, 5], 1, [0]),
    ([3, 1, 4], 3, [0, 1, 2]),
])
def test_choose_boundaries_by_hand(times, stages, expected):
    assert choose_boundaries(times, stages) == expected


def test_memory_limit_moves_the_cut():
    # Time alone says [0, 2] (2 | 2); layer 3 needs 5 units, so the stage holding it
    # can take nothing else under a 5.5 limit.
    assert choose_boundaries([1, 1, 1, 1], 2) == [0, 2]
    assert choose_boundaries([1, 1, 1, 1], 2, layer_memory=[1, 1, 1, 5], memory_limit=5.5) == [0, 3]


def test_memory_limit_that_nothing_fits_is_an_error():
    with pytest.raises(ConfigError, match="memory limit"):
        choose_boundaries([1, 1, 1, 1], 2, layer_memory=[3, 3, 3, 3], memory_limit=5.0)


def test_more_stages_than_layers_is_an_error():
    with pytest.raises(ConfigError, match="every stage needs a layer"):
        choose_boundaries([1, 1], 3)


def test_stage_sums():
    assert stage_sums([1, 2, 3, 4], [0, 1, 3]) == [1, 5, 4]


# ---------------------------------------------------------------- partition, properties


def _brute_force(times, stages, memory=None, limit=None):
    """Smallest slowest-stage time over every contiguous split, or None if none fits."""
    n, best = len(times), None
    for cuts in itertools.combinations(range(1, n), stages - 1):
        starts = [0, *cuts]
        if limit is not None and max(stage_sums(memory, starts)) > limit:
            continue
        worst = max(stage_sums(times, starts))
        best = worst if best is None else min(best, worst)
    return best


@settings(max_examples=150, deadline=None)
@given(st.data())
def test_choose_boundaries_is_optimal(data):
    n = data.draw(st.integers(1, 9))
    stages = data.draw(st.integers(1, n))
    times = data.draw(st.lists(st.integers(0, 50), min_size=n, max_size=n))
    use_memory = data.draw(st.booleans())
    memory = data.draw(st.lists(st.integers(0, 20), min_size=n, max_size=n)) if use_memory else None
    limit = data.draw(st.integers(0, 60)) if use_memory else None
    expected = _brute_force(times, stages, memory, limit)
    if expected is None:
        with pytest.raises(ConfigError):
            choose_boundaries(times, stages, memory, limit)
        return
    starts = choose_boundaries(times, stages, memory, limit)
    assert len(starts) == stages and starts[0] == 0
    assert all(a < b for a, b in zip(starts, starts[1:])) and starts[-1] < n
    assert max(stage_sums(times, starts)) == expected
    if limit is not None:
        assert max(stage_sums(memory, starts)) <= limit


# ---------------------------------------------------------------- plan, drift


def test_plan_moves_layers_off_a_heavy_last_stage():
    costs = [LayerCost(1.0, 10, 1)] * 7 + [LayerCost(7.0, 10, 1)]
    plan = plan_stages(costs, 2, log=False)
    assert plan.even_boundaries == [0, 4] and plan.even_stage_times_s == [4.0, 10.0]
    assert plan.boundaries == [0, 7] and plan.stage_times_s == [7.0, 7.0]
    assert plan.predicted_speedup == pytest.approx(10.0 / 7.0)


def test_plan_memory_counts_state_and_in_flight_activations():
    costs = [LayerCost(1.0, 100, 10)] * 4
    plan = plan_stages(costs, 2, in_flight_microbatches=[2, 1], param_state_factor=4.0, log=False)
    assert plan.boundaries == [0, 2]
    assert plan.stage_memory_bytes == [2 * 400 + 2 * 10 * 2, 2 * 400 + 2 * 10 * 1]
    # A limit between the two stages' needs pushes a layer onto the stage with fewer
    # microbatches in flight: 3 layers there need 1230; on stage 0 one layer needs 800, two 1600.
    plan = plan_stages(costs, 2, memory_limit_bytes=1250, in_flight_microbatches=[40, 1], log=False)
    assert plan.boundaries == [0, 1]


def test_should_rebalance():
    assert not should_rebalance([10.0, 10.5], 0.1)
    assert should_rebalance([10.0, 15.0], 0.1)           # 15 / 12.5 = 1.2 > 1.1
    # Relative to a plan that was never even: drift only if the imbalance grew.
    assert not should_rebalance([8.0, 12.0], 0.1, predicted_stage_times=[8.0, 12.0])
    assert should_rebalance([6.0, 14.0], 0.1, predicted_stage_times=[8.0, 12.0])


# ---------------------------------------------------------------- profiling


def test_profile_layer_costs_on_a_heavy_head():
    cfg = ModelConfig(dim=32, n_layers=4, n_heads=4, n_kv_heads=2, vocab_size=8192, ffn_hidden_dim=64,
                      max_seq_len=32)
    model = build_model(cfg, seed=0)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    tok = torch.randint(0, cfg.vocab_size, (2, 33), generator=torch.Generator().manual_seed(0))
    costs = profile_layer_costs(model, tok[:, :-1], tok[:, 1:], steps=7)  # median of 7: robust to a hiccup
    assert len(costs) == cfg.n_layers and all(c.time_s > 0 and c.activation_bytes > 0 for c in costs)
    block = sum(p.numel() for p in model.layers["1"].parameters()) * 4
    emb = cfg.vocab_size * cfg.dim * 4
    assert costs[1].param_bytes == block
    assert costs[0].param_bytes == block + emb                      # embedding folded into block 0
    assert costs[-1].param_bytes == block + emb + cfg.dim * 4       # output + norm into the last
    # The output projection and loss over 8192 classes dwarf a 32-wide block (~100x the
    # FLOPs); 2x leaves room for a noisy shared machine.
    assert costs[-1].time_s > 2 * statistics.median(c.time_s for c in costs[1:-1])
    assert all(p.grad is None for p in model.parameters())
    for k, v in model.state_dict().items():
        torch.testing.assert_close(v, before[k], rtol=0, atol=0)


# ---------------------------------------------------------------- multi-process

# The worker's model predicts 1.4x on the slowest stage; measured here 1.2-1.4x (the
# profile and the running pipeline disagree by ~10% per stage on this shared machine).
# The bar leaves room for that and for noise; a split that changed nothing gives ~1.0.
MIN_SPEEDUP = 1.10


@pytest.mark.slow
def test_auto_split_beats_even_split_on_uneven_model(tmp_path):
    """Timing on a shared 2-core machine: one run can be spoiled by a neighbour (seen: a run
    whose profile was so noisy the auto split moved a single block). Up to 3 independent
    runs; the auto split must win clearly in one of them, and its plan must be right in all."""
    outcomes = []
    for attempt in range(3):
        out = tmp_path / f"balance{attempt}.json"
        run_torchrun(WORKERS / "pp_balance.py", 2, "--out", str(out), timeout_s=240)
        r = json.loads(out.read_text())
        assert r["boundaries"]["even"] == [0, 4]
        assert r["boundaries"]["auto"][1] > 4, "auto split should move blocks off the heavy last stage"

        def per_rank(split: str) -> list[float]:
            # Median over steps of each rank's stage CPU time: the stage's own work, steadier
            # than wall time while the neighbours' load comes and goes.
            return [statistics.median(s["cpu_s"] for s in rank) for rank in r["measured"][split]]

        # The slowest stage is the one with the largest median; a per-step max over ranks
        # would add the noise of whichever rank was unlucky that step.
        even, auto = max(per_rank("even")), max(per_rank("auto"))
        outcomes.append(f"boundaries {r['boundaries']['auto']}: even {even * 1e3:.1f} ms, auto {auto * 1e3:.1f} ms")
        if even / auto > MIN_SPEEDUP and should_rebalance(per_rank("even"), 0.2) \
                and not should_rebalance(per_rank("auto"), 0.2):
            return
    pytest.fail("auto split never beat the even split's slowest stage by "
                f"{MIN_SPEEDUP}x: " + "; ".join(outcomes))
