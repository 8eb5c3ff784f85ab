"""2-D tensor parallelism (parallel/tp2d): parity of a 2 x 2 grid with the single-process
modules, the bytes it sends against the analytic count, and the grid's validation.

The multi-process checks run once, in one torchrun launch of ``workers/tp2d_parity.py``
(4 gloo ranks, CPU, one thread each), which writes each rank's measured differences and the
collectives it issued to JSON; the tests below assert them.
"""

from __future__ import annotations

import pytest

from tests.parallel.torchrun import WORKERS, rank_results
from trainforge.config import load_config
from trainforge.errors import ConfigError
from trainforge.model import FLAVORS
from trainforge.parallel.tp2d import (
    BlockShape,
    grid_side,
    summa_bytes_per_rank,
    summa_linear_bytes,
    summa_rmsnorm_bytes,
    tp1d_bytes_per_rank,
)

TP, Q = 4, 2
ATOL = 1e-5  # float32, outputs of magnitude ~1; the sums are split 2 ways, so only rounding differs
CASES = ["mlp", "swiglu"]


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> list[dict]:
    return rank_results(WORKERS / "tp2d_parity.py", TP, tmp_path_factory.mktemp("tp2d"), timeout_s=120)


@pytest.mark.slow
def test_grid_groups(ranks):
    """Rank r = i * 2 + j; its row group is grid row i, its column group grid column j."""
    for r, res in enumerate(ranks):
        i, j = divmod(r, Q)
        assert res["coordinate"] == [i, j]
        assert res["row_group"] == [i * Q, i * Q + 1]
        assert res["col_group"] == [j, Q + j]


@pytest.mark.slow
@pytest.mark.parametrize("case", CASES)
def test_2x2_grid_matches_single_process(ranks, case):
    for r, res in enumerate(ranks):
        c = res[case]
        assert c["out_scale"] > 100 * ATOL, "the outputs are not trivially near zero"
        assert c["out_max"] <= ATOL, f"rank {r}: outputs off by {c['out_max']:.3g}"
        assert c["x_grad_max"] <= ATOL, f"rank {r}: input gradient off by {c['x_grad_max']:.3g}"
        for name, diff in c["weight_grad_max"].items():
            assert diff <= ATOL, f"rank {r}: gradient of {name} off by {diff:.3g}"


@pytest.mark.slow
@pytest.mark.parametrize("case", CASES)
def test_bytes_sent_match_the_analytic_count(ranks, case):
    for r, res in enumerate(ranks):
        c = res[case]
        s = c["shape"]
        n, d, f, q = s["tokens"], s["dim"], s["ffn"], s["q"]
        up = [f] if case == "mlp" else [f, f]  # swiglu: w1 and w3 share one gathered input
        want = summa_rmsnorm_bytes(n, d, q) + summa_linear_bytes(n, d, up, q) + summa_linear_bytes(n, f, d, q)
        assert c["bytes_sent"] == pytest.approx(want, rel=1e-12), (r, c["collectives"])
        # No collective went around the counted calls (DTensor's own, for instance).
        assert c["comm_debug_count"] == len(c["collectives"]), (r, c["comm_debug_count"], c["collectives"])


@pytest.mark.parametrize("tp", [1, 2, 3, 6, 8])
def test_non_square_tp_is_refused_naming_both_keys(tp):
    with pytest.raises(ConfigError) as e:
        grid_side(tp)
    message = str(e.value)
    assert f"parallel.tp' = {tp}" in message and "parallel.tp_mode" in message and "4, 9, 16" in message


@pytest.mark.parametrize(("tp", "q"), [(4, 2), (9, 3), (16, 4), (64, 8)])
def test_square_tp_gives_the_grid_side(tp, q):
    assert grid_side(tp) == q


def _shape(flavor: str, batch: int, seq: int) -> BlockShape:
    c = FLAVORS[flavor]
    return BlockShape(batch, seq, c.dim, c.ffn_hidden_dim, c.n_heads, c.n_kv_heads)


def test_2d_sends_less_than_1d_and_its_advantage_grows_with_tp():
    """llama-8b, 16 x 8192 tokens, bf16: 2-D sends less at tp 4, and less still, relative to
    1-D, at tp 16 and 64 (1-D's bytes grow towards 8 N dim e, 2-D's fall with 1/q)."""
    shape = _shape("llama-8b", 16, 8192)
    ratios = [summa_bytes_per_rank(shape, tp, 2) / tp1d_bytes_per_rank(shape, tp, True, 2) for tp in (4, 16, 64)]
    assert ratios[0] < 0.7 and ratios[0] > ratios[1] > ratios[2], ratios


def test_1d_counts_four_stream_all_reduces():
    shape = BlockShape(batch=2, seq=8, dim=64, ffn=176, n_heads=4, n_kv_heads=2)
    assert tp1d_bytes_per_rank(shape, 4, False) == 4 * 2 * 3 / 4 * (16 * 64) * 4
    # sequence parallel: the same stream bytes, plus the two norms' weight gradients
    assert tp1d_bytes_per_rank(shape, 4, True) == 4 * 2 * 3 / 4 * (16 * 64) * 4 + 2 * 2 * 3 / 4 * 64 * 4


def test_2d_count_refuses_a_batch_the_grid_rows_cannot_split():
    with pytest.raises(ValueError, match="q = 2 must divide batch = 3"):
        summa_bytes_per_rank(BlockShape(3, 8, 64, 176, 4, 2), 4)


# --- the config edge: parallel.tp_mode and what 2-D refuses --------------------------------------

def test_tp_mode_2d_is_a_config_key_checked_at_load():
    cfg = load_config(None, ["--parallel.tp", "9", "--parallel.tp_mode", "2d"])
    assert (cfg.parallel.tp, cfg.parallel.tp_mode) == (9, "2d")
    assert load_config(None, []).parallel.tp_mode == "1d"
    with pytest.raises(ConfigError, match=r"parallel.tp' = 6 with parallel.tp_mode"):
        load_config(None, ["--parallel.tp", "6", "--parallel.tp_mode", "2d"])
    with pytest.raises(ConfigError, match=r"parallel.loss_parallel.*tp_mode = \"2d\""):
        load_config(None, ["--parallel.tp", "4", "--parallel.tp_mode", "2d", "--parallel.loss_parallel", "false"])
    with pytest.raises(ConfigError, match="parallel.tp_mode"):
        load_config(None, ["--parallel.tp_mode", "3d"])
