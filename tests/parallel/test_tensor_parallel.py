"""Tensor parallelism: TP=2 parity against the single-device model (with and without
multi-token prediction), and layout validation.

The parity checks run once, in one torchrun launch of ``workers/tp_parity.py`` (gloo, CPU,
one thread per process), which writes each rank's measured maxima to JSON; the tests
below assert them against the stated tolerances.
"""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from tests.parallel.torchrun import WORKERS, rank_results
from trainforge.errors import ConfigError
from trainforge.model import FLAVORS, ModelConfig, build_model
from trainforge.parallel.tensor_parallel import (
    apply_tensor_parallel,
    check_tensor_parallel,
    cross_entropy_loss,
    loss_context,
)

TP = 2
LOSS_RTOL = 1e-5  # relative, per step, over 3 steps
GRAD_ATOL = 1e-5  # every parameter's gradient, gathered with full_tensor(), every step
WEIGHT_ATOL = 1e-5  # every parameter after 3 clipped AdamW steps (lr 1e-3)
# sequence / loss parallel, tied embeddings; latent attention (MLA) with a low- or full-rank query;
# multi-token prediction (1 or 2 depths, dense or MLA) with its own loss
CASES = ["sp-lp", "sp-nolp", "nosp-lp", "nosp-nolp", "sp-lp-tied", "mla-sp-lp", "mla-nosp-nolp", "mla-fullq-sp-lp",
         "mtp-sp-lp", "mtp-sp-nolp", "mtp-nosp-lp", "mtp-sp-lp-tied", "mla-mtp-sp-lp",
         # with the trainer's grad finisher that sums the Partial norm gradients once (parallel/partial_grads.py)
         "sp-lp-reduced", "mtp-sp-lp-reduced"]


@pytest.fixture(scope="module")
def tp_results(tmp_path_factory) -> list[dict]:
    return rank_results(WORKERS / "tp_parity.py", TP, tmp_path_factory.mktemp("tp_parity"), timeout_s=180)


@pytest.mark.slow
@pytest.mark.parametrize("case", CASES)
def test_tp2_training_matches_single_device(tp_results, case):
    for rank, results in enumerate(tp_results):
        r = results[case]
        where = f"{case}, rank {rank}"
        assert r["loss_rel"] <= LOSS_RTOL, f"{where}: losses (tp, ref) {r['losses']}"
        assert r["grad_max"] <= GRAD_ATOL, f"{where}: gradient of {r['worst_grad']} off by {r['grad_max']:.3g}"
        assert r["grad_norm_rel"] <= LOSS_RTOL, f"{where}: clip_grad_norm_ total norm off by {r['grad_norm_rel']:.3g}"
        assert r["weight_max"] <= WEIGHT_ATOL, f"{where}: weights off by {r['weight_max']:.3g} after 3 steps"
        # The optimizer moved the weights far beyond the tolerance, so the weight check has teeth.
        assert r["weight_moved"] > 100 * WEIGHT_ATOL, where


@pytest.mark.slow
@pytest.mark.parametrize("case", ["sp-lp", "mtp-sp-lp"])
def test_partial_gradients_are_summed_once_per_step(tp_results, case):
    """Under sequence parallelism the norm weights' gradients come back Partial. Left so,
    AdamW re-reduces each of them on every foreach op; the reducer sums them all in one
    all-reduce after backward, and the optimizer step then communicates nothing."""
    for rank, results in enumerate(tp_results):
        plain, reduced = results[case], results[f"{case}-reduced"]
        assert min(plain["partial_grads"]) > 0, f"rank {rank}: no Partial gradient to reduce in {case}"
        assert min(plain["optimizer_collectives"]) >= 2 * plain["partial_grads"][0], (rank, plain)
        assert reduced["reducer_collectives"] == [1] * len(reduced["losses"]), (rank, reduced)
        assert reduced["optimizer_collectives"] == [0] * len(reduced["losses"]), (rank, reduced)


@pytest.mark.slow
def test_tp2_pipeline_stage_shapes(tp_results):
    """Stages without embedding or output: the sequence shard crosses the boundary, forward
    and backward (incl. the gradient sent back to the previous stage) match."""
    for rank, results in enumerate(tp_results):
        r = results["stages"]
        assert r["hidden_max"] <= GRAD_ATOL, (rank, r)
        assert r["loss_rel"] <= LOSS_RTOL, (rank, r)
        assert r["grad_max"] <= GRAD_ATOL, (rank, r)


@pytest.mark.slow
def test_sequence_parallel_rejects_indivisible_sequence(tp_results):
    message = tp_results[0]["seq_len_error"]
    assert "training.seq_len" in message and "parallel.tp = 2" in message and "15 tokens" in message


@pytest.mark.parametrize(("model_config", "tp", "named"), [
    (FLAVORS["debug"], 3, "model.n_heads = 4"),  # heads 4, kv heads 2
    (FLAVORS["debug"], 4, "model.n_kv_heads = 2"),
    (ModelConfig(dim=64, n_layers=1, n_heads=4, n_kv_heads=4, vocab_size=64, ffn_hidden_dim=174), 4,
     "model.ffn_hidden_dim = 174"),
])
def test_bad_tp_degree_raises_config_error(model_config, tp, named):
    with pytest.raises(ConfigError, match="parallel.tp") as err:
        check_tensor_parallel(model_config, tp)
    assert named in str(err.value)


def test_apply_validates_before_any_collective():
    """No process group exists here and the mesh is a stub whose only working methods are
    ``ndim`` and ``size()``: reaching any collective would fail with another error."""
    model = build_model(FLAVORS["debug"], seed=0)
    stub_mesh = SimpleNamespace(ndim=1, size=lambda: 3)
    with pytest.raises(ConfigError, match="parallel.tp"):
        apply_tensor_parallel(model, stub_mesh)
    assert all(type(p) is torch.nn.Parameter for p in model.parameters())  # nothing was sharded


def test_cross_entropy_loss_on_plain_tensors():
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(2, 8, 32, generator=gen, dtype=torch.bfloat16, requires_grad=True)
    targets = torch.randint(0, 32, (2, 8), generator=gen)
    with loss_context(False):
        loss = cross_entropy_loss(logits, targets)
        loss.backward()
    want = F.cross_entropy(logits.detach().float().reshape(16, 32), targets.reshape(16))
    torch.testing.assert_close(loss, want, rtol=0, atol=0)  # computed in fp32 whatever the logits' dtype
    assert logits.grad is not None and logits.grad.shape == logits.shape



def test_mla_tp_degree_is_checked_against_heads_only():
    """Latent attention has no KV heads to split (one latent serves all heads): a tp that
    divides n_heads is accepted whatever n_kv_heads, one that does not is refused."""
    mla = dataclasses.replace(FLAVORS["debug"], dim=96, n_heads=6, n_kv_heads=3, q_lora_rank=32, kv_lora_rank=32,
                              qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, ffn_hidden_dim=180)
    check_tensor_parallel(mla, 2)  # 3 KV heads do not matter
    with pytest.raises(ConfigError, match="model.n_heads = 6"):
        check_tensor_parallel(mla, 4)
