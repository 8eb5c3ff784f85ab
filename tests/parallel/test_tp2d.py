"""2-D tensor parallelism (parallel/tp2d): parity of a 2 x 2 grid with the single-process
modules, the bytes it sends against the analytic count, and the grid's validation.

The multi-process checks run once, in one torchrun launch of ``workers/tp2d_parity.py``
(4 gloo ranks, CPU, one thread each), which writes each rank's measured differences and the
collectives it issued to JSON; the tests below assert them.
"""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest
import torch

from tests.parallel.torchrun import WORKERS, rank_results
from trainforge.config import load_config
from trainforge.errors import ConfigError
from trainforge.model import FLAVORS, ModelConfig, build_model
from trainforge.parallel.tensor_parallel import check_tensor_parallel
from trainforge.parallel.tp2d.apply import apply_tp2d, check_tp2d
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


def _debug(**changes) -> ModelConfig:
    return dataclasses.replace(FLAVORS["debug"], **changes)


@pytest.mark.parametrize(("model_config", "kw", "named"), [
    (FLAVORS["moe-debug"], {}, "model.n_routed_experts"),
    (FLAVORS["dsv3-debug"], {}, "model.n_routed_experts"),  # MoE and MLA: the first refusal names MoE
    (_debug(q_lora_rank=32, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16),
     {}, "model.kv_lora_rank"),
    (FLAVORS["hourglass-tiny"], {}, "model.hourglass"),
    (_debug(mtp_depth=1), {}, "model.mtp_depth"),
    (_debug(tie_embeddings=True), {}, "model.tie_embeddings"),
    (_debug(n_heads=2, n_kv_heads=1), {}, "model.n_kv_heads' = 1"),
    (_debug(vocab_size=511), {}, "model.vocab_size' = 511"),
    (_debug(ffn_hidden_dim=175), {}, "model.ffn_hidden_dim' = 175"),
    (FLAVORS["debug"], {"batch_size": 3}, "training.batch_size' = 3"),
    (FLAVORS["debug"], {"pp": 2, "batch_size": 4, "microbatches": 4}, "parallel.microbatches' = 4 with "
                                                                       "training.batch_size = 4"),
    (FLAVORS["debug"], {"compile": True}, "parallel.compile"),
    (FLAVORS["debug"], {"loss_chunk_tokens": 64}, "training.loss_chunk_tokens"),
])
def test_2d_refuses_what_it_does_not_split_naming_the_key(model_config, kw, named):
    with pytest.raises(ConfigError) as e:
        check_tp2d(model_config, 4, **kw)
    assert named in str(e.value) and "tp_mode" in str(e.value)


def test_2d_accepts_the_debug_model_that_1d_tp_4_refuses():
    """tp 4 as a 2 x 2 grid splits heads and widths 2 ways: debug's 2 KV heads divide, where
    1-D tp 4 needs 4."""
    check_tp2d(FLAVORS["debug"], 4, batch_size=8)
    check_tp2d(FLAVORS["debug"], 4, batch_size=8, pp=2, microbatches=2)  # 4 rows per microbatch: 2 per grid row
    with pytest.raises(ConfigError, match="model.n_kv_heads = 2"):
        check_tensor_parallel(FLAVORS["debug"], 4)


def test_2d_refuses_before_any_collective():
    """A stub tp mesh whose only working methods are ``ndim`` and ``size()``: reaching the grid
    (a collective) would fail with another error; nothing is swapped."""
    model = build_model(FLAVORS["moe-debug"], seed=0)
    with pytest.raises(ConfigError, match="model.n_routed_experts"):
        apply_tp2d(model, SimpleNamespace(ndim=1, size=lambda: 4))
    assert all(type(p) is torch.nn.Parameter for p in model.parameters())


@pytest.mark.slow
def test_applied_model_matches_single_process(ranks):
    """``apply_tp2d`` on the debug Llama: logits, loss, every gradient and the gradient norm
    (DTensor's, each shard counted once) equal the single-process model's; every parameter is
    a DTensor; the logits are the (B, T, vocab) DTensor split by batch rows and vocab."""
    for r, res in enumerate(ranks):
        m = res["model"]
        assert m["all_dtensor"], r
        assert m["logits_shape"] == [4, 16, 512] and m["logits_placements"] == "(Shard(dim=0), Shard(dim=2))", m
        assert m["logits_max"] <= ATOL, (r, m["logits_max"])
        got, want = m["loss"]
        assert abs(got - want) <= 1e-6 * want, (r, m["loss"])
        assert m["grad_max"] <= ATOL, f"rank {r}: gradient of {m['worst_grad']} off by {m['grad_max']:.3g}"
        got, want = m["grad_norm"]
        assert abs(got - want) <= 1e-6 * want, (r, m["grad_norm"])


@pytest.mark.slow
def test_projections_sharing_an_input_gather_it_once(ranks):
    """Per block the forward gathers over the grid row 4 times (the attention's input for
    wq / wk / wv, wo's, the feed-forward's input for w1 / w3, w2's), not 7; one more for the
    output projection."""
    for r, res in enumerate(ranks):
        m = res["model"]
        assert m["forward_row_gathers"] == 4 * m["n_layers"] + 1, (r, m["forward_row_gathers"])
