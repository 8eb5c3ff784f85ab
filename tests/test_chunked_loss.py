"""The chunked output projection + cross-entropy (train/chunked_loss.py) against the
plain one: same loss and gradients to fp32 rounding, less memory saved for backward,
and refused where the output projection is sharded or staged."""

from __future__ import annotations

import pytest
import torch

from trainforge.config import Config, ParallelSection
from trainforge.errors import ConfigError
from trainforge.model import build_model
from trainforge.model.config import FLAVORS
from trainforge.parallel.dims import ParallelDims
from trainforge.parallel.tensor_parallel import cross_entropy_loss
from trainforge.precision.memory import measure_activation_bytes
from trainforge.train.chunked_loss import check_chunked_loss, chunked_cross_entropy, hidden_states


def _grads(model):
    return {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("chunk", [7, 16, 1000])
def test_chunked_loss_matches_the_plain_loss_and_gradients(chunk):
    """fp32: the loss within 1e-6 relative, every gradient within 1e-5 relative L2 (the
    sums run in another order); ignored targets (-100) count in neither."""
    torch.manual_seed(0)
    model = build_model(FLAVORS["debug"], seed=0)
    tokens = torch.randint(0, FLAVORS["debug"].vocab_size, (3, 17))
    targets = tokens[:, 1:].clone()
    targets[0, :5] = -100
    ref = cross_entropy_loss(model(tokens[:, :-1]), targets)
    ref.backward()
    ref_grads = _grads(model)
    model.zero_grad(set_to_none=True)
    loss = chunked_cross_entropy(hidden_states(model, model, tokens[:, :-1]), model.output, targets, chunk)
    loss.backward()
    assert model.output is not None  # restored after the forward
    torch.testing.assert_close(loss, ref, rtol=1e-6, atol=0)
    for name, g in _grads(model).items():
        assert (g - ref_grads[name]).norm() <= 1e-5 * ref_grads[name].norm(), name


def test_chunked_loss_saves_no_full_size_logits():
    model = build_model(FLAVORS["debug"], seed=0)
    tokens = torch.randint(0, FLAVORS["debug"].vocab_size, (4, 65))
    x, y = tokens[:, :-1], tokens[:, 1:]
    plain = measure_activation_bytes(model, lambda: cross_entropy_loss(model(x), y))
    chunked = measure_activation_bytes(model, lambda: chunked_cross_entropy(hidden_states(model, model, x),
                                                                           model.output, y, 32))
    logits_bytes = y.numel() * FLAVORS["debug"].vocab_size * 4
    # The plain loss keeps the fp32 log-probabilities; the chunked one keeps no logits at all.
    assert plain["fp32"] - chunked["fp32"] >= logits_bytes


@pytest.mark.parametrize("layout", [{"pp": 2, "dp_shard": 1}, {"tp": 2, "dp_shard": 1}, {"dp_shard": 2}])
def test_layouts_that_own_the_output_projection_refuse_the_chunked_loss(layout):
    section = ParallelSection(**layout)
    dims = ParallelDims.resolve(section, 2)
    with pytest.raises(ConfigError, match="training.loss_chunk_tokens"):
        check_chunked_loss(64, dims)
    check_chunked_loss(0, dims)  # off: any layout
    check_chunked_loss(64, ParallelDims.resolve(ParallelSection(dp_replicate=2, dp_shard=1), 2))  # DDP


def test_the_trainer_trains_with_the_chunked_loss(tmp_path):
    """Two runs from the same seed, plain and chunked: the same losses to fp32 rounding."""
    from trainforge.train.trainer import Trainer

    losses = []
    for chunk in (0, 100):
        cfg = Config()
        cfg.model.flavor = "debug"
        cfg.training.steps, cfg.training.batch_size, cfg.training.seq_len = 5, 2, 64
        cfg.training.val_batches, cfg.training.log_interval = 1, 1
        cfg.training.loss_chunk_tokens = chunk
        cfg.validate()
        trainer = Trainer(cfg, run_dir=tmp_path / f"run{chunk}")
        losses.append([float(trainer.train_step()[0]) for _ in range(5)])
    for a, b in zip(*losses):
        assert abs(a - b) <= 1e-5 * abs(a)
