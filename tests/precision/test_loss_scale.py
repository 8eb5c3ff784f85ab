"""fp16 loss scaling: an overflowing step is skipped, the scale halves, weights stay;
the scaler state survives a weights_only checkpoint round trip."""

from __future__ import annotations

import io

import pytest
import torch
from torch import nn

from trainforge.precision.casting import autocast_context
from trainforge.precision.loss_scale import LossScaler


def tiny():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 1))


def make_optimizer(kind, model):
    if kind == "sgd":
        return torch.optim.SGD(model.parameters(), lr=0.1)
    # The fused CPU kernel takes the scale and inf flag itself (no host sync in step).
    return torch.optim.AdamW(model.parameters(), lr=0.1, fused=True)


def train_step(model, opt, scaler, x):
    with autocast_context(torch.float16, "cpu"):
        out = model(x)
    loss = out.float().pow(2).mean()
    scaler.scale(loss).backward()
    scaler.unscale_(opt)
    norm = nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    scaler.step(opt)
    overflow = scaler.update()  # device-side flag for the dynamic controller
    opt.zero_grad(set_to_none=True)
    return norm, overflow


@pytest.mark.parametrize("kind", ["sgd", "adamw_fused"])
def test_overflow_skips_the_step_and_halves_the_scale(kind):
    model = tiny()
    opt = make_optimizer(kind, model)
    # 2**24 times a gradient of order 1 exceeds fp16's maximum (65504): a forced overflow.
    scaler = LossScaler(True, "cpu", init_scale=2.0**24, growth_steps=1000)
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(1))
    before = [p.detach().clone() for p in model.parameters()]
    norm, overflow = train_step(model, opt, scaler, x)
    assert not torch.isfinite(norm)
    assert scaler.skipped_steps() == 1 and scaler.get_scale() == 2.0**23
    assert overflow.item() == 1 and scaler.scale_tensor().item() == 2.0**23
    for p, b in zip(model.parameters(), before):
        assert torch.equal(p, b)
    # Each further overflow halves again until gradients fit; then the step is taken.
    for _ in range(20):
        norm, overflow = train_step(model, opt, scaler, x)
        if torch.isfinite(norm):
            break
    skipped = scaler.skipped_steps()
    assert 1 < skipped < 21 and scaler.get_scale() == 2.0 ** (24 - skipped)
    assert overflow.item() == 0
    assert any(not torch.equal(p, b) for p, b in zip(model.parameters(), before))


def test_scale_grows_after_clean_steps():
    model = tiny()
    opt = make_optimizer("sgd", model)
    scaler = LossScaler(True, "cpu", init_scale=256.0, growth_steps=2)
    x = torch.randn(4, 8)
    for _ in range(4):
        assert torch.isfinite(train_step(model, opt, scaler, x)[0])
    assert scaler.get_scale() == 1024.0 and scaler.skipped_steps() == 0


def test_state_round_trips_through_a_weights_only_checkpoint():
    model = tiny()
    opt = make_optimizer("sgd", model)
    scaler = LossScaler(True, "cpu", init_scale=2.0**20, growth_steps=3)
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(2))
    for _ in range(6):
        train_step(model, opt, scaler, x)
    state = scaler.state_dict()
    buf = io.BytesIO()
    torch.save(state, buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=True)

    resumed = LossScaler(True, "cpu", init_scale=1.0, growth_steps=3)
    resumed.load_state_dict(loaded)
    assert resumed.get_scale() == scaler.get_scale()
    assert resumed.skipped_steps() == scaler.skipped_steps() > 0
    assert resumed.scaler.state_dict() == scaler.scaler.state_dict()  # incl. the growth tracker
    # The resumed scaler continues exactly as the original would.
    twin_model = tiny()
    twin_model.load_state_dict(model.state_dict())
    twin_opt = make_optimizer("sgd", twin_model)
    for _ in range(3):
        train_step(model, opt, scaler, x)
        train_step(twin_model, twin_opt, resumed, x)
    assert resumed.get_scale() == scaler.get_scale() and resumed.skipped_steps() == scaler.skipped_steps()


def test_disabled_scaler_passes_through():
    model = tiny()
    opt = make_optimizer("sgd", model)
    scaler = LossScaler(False, "cpu")
    loss = model(torch.randn(4, 8)).pow(2).mean()
    assert scaler.scale(loss) is loss
    loss.backward()
    before = model[0].weight.detach().clone()
    scaler.unscale_(opt)
    scaler.step(opt)
    scaler.update()
    assert not torch.equal(model[0].weight, before)
    # A bf16 run's checkpoint resumed as fp16 starts from the configured scale.
    enabled = LossScaler(True, "cpu", init_scale=512.0)
    enabled.load_state_dict(scaler.state_dict())
    assert enabled.get_scale() == 512.0


def test_a_rank_that_never_scales_a_loss_still_steps_in_step():
    """Pipeline stages before the last hold no loss: ``ensure_scale`` gives them the scale,
    so unscale_/step/update run as on the last stage (GradScaler would refuse otherwise)."""
    model = tiny()
    opt = make_optimizer("sgd", model)
    scaler = LossScaler(True, "cpu", init_scale=2.0**10, growth_steps=1)
    model(torch.randn(4, 8)).pow(2).mean().mul(2.0**10).backward()  # as if scaled on another rank
    with pytest.raises(AssertionError, match="_scale is None"):
        scaler.unscale_(opt)
    scaler.ensure_scale(torch.device("cpu"))
    scaler.unscale_(opt)
    before = model[0].weight.detach().clone()
    scaler.step(opt)
    assert scaler.update().item() == 0 and scaler.get_scale() == 2.0**11  # grown after one clean step
    assert not torch.equal(model[0].weight, before)
