"""Each schedule's LR at given steps equals its formula (exact values, in the spirit of
torchtitan's scheduler tests), and a checkpointed schedule resumes the identical sequence."""

import io
import math

import pytest
import torch

from trainforge.train.lr_schedule import (WarmupCosine, WarmupDecay, build_scheduler, warmup_cosine_scheduler,
                                          warmup_decay)

PEAK = 0.5


def _opt() -> torch.optim.Optimizer:
    # Two param groups (like decay / no-decay): every group must follow the schedule.
    return torch.optim.SGD([{"params": [torch.nn.Parameter(torch.zeros(1))]},
                            {"params": [torch.nn.Parameter(torch.zeros(1))], "lr": PEAK}], lr=PEAK)


def _lrs(n: int, **kw) -> list[float]:
    """LR used by updates 1..n (read before each optimizer step, as the trainer logs it)."""
    opt = _opt()
    sched = build_scheduler(opt, **kw)
    out = []
    for _ in range(n):
        assert opt.param_groups[0]["lr"] == opt.param_groups[1]["lr"]
        out.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    return out


def _check(actual: list[float], multipliers: list[float]) -> None:
    assert actual == pytest.approx([PEAK * m for m in multipliers], rel=1e-12, abs=0)


def test_cosine_exact_values_warmup_edges_and_floor():
    # warmup 2: k=0 -> 1/2, k=1 -> 1 (the peak at the last warmup step); cosine over k=2..6 to 0.2.
    half = lambda p: 0.2 + 0.8 * 0.5 * (1 + math.cos(math.pi * p))  # noqa: E731
    _check(_lrs(9, kind="cosine", warmup_steps=2, total_steps=6, min_lr_ratio=0.2),
           [0.5, 1.0, 1.0, half(0.25), half(0.5), half(0.75), 0.2, 0.2, 0.2])


def test_cosine_kind_matches_the_original_warmup_cosine_exactly():
    new, old = WarmupDecay("cosine", 10, 110, 0.1), WarmupCosine(10, 110, 0.1)
    assert [new(k) for k in range(130)] == [old(k) for k in range(130)]


def test_linear_exact_values():
    _check(_lrs(9, kind="linear", warmup_steps=2, total_steps=6, min_lr_ratio=0.2),
           [0.5, 1.0, 1.0, 0.8, 0.6, 0.4, 0.2, 0.2, 0.2])


def test_linear_without_warmup_starts_at_the_peak():
    _check(_lrs(6, kind="linear", warmup_steps=0, total_steps=4, min_lr_ratio=0.0),
           [1.0, 0.75, 0.5, 0.25, 0.0, 0.0])


def test_constant_exact_values():
    _check(_lrs(7, kind="constant", warmup_steps=3, total_steps=5, min_lr_ratio=0.1),
           [1 / 3, 2 / 3, 1.0, 1.0, 1.0, 1.0, 1.0])


@pytest.mark.parametrize("shape, decay", [
    ("linear", [1.0, 2 / 3, 1 / 3, 0.0]),
    ("sqrt", [1.0, 1 - math.sqrt(1 / 3), 1 - math.sqrt(2 / 3), 0.0]),
    ("cosine", [1.0, 0.75, 0.25, 0.0]),
])
def test_wsd_phases_exact_values(shape, decay):
    # total 10, decay_ratio 0.3 -> 3 decay steps starting at k=7; warmup k=0,1; stable k=2..6.
    floor = 0.1
    want = [0.5, 1.0] + [1.0] * 5 + [floor + (1 - floor) * d for d in decay] + [floor]
    _check(_lrs(12, kind="wsd", warmup_steps=2, total_steps=10, min_lr_ratio=floor, decay_ratio=0.3,
                decay_shape=shape), want)


def test_invalid_settings_name_the_argument():
    opt = _opt()
    with pytest.raises(ValueError, match="kind"):
        build_scheduler(opt, kind="step")
    with pytest.raises(ValueError, match="warmup_steps .* decay"):
        build_scheduler(opt, kind="wsd", warmup_steps=8, total_steps=10, decay_ratio=0.3)
    with pytest.raises(ValueError, match="min_lr_ratio"):
        build_scheduler(opt, kind="linear", total_steps=10, min_lr_ratio=1.5)
    with pytest.raises(ValueError, match="decay_shape"):
        build_scheduler(opt, kind="wsd", total_steps=10, decay_shape="exp")


@pytest.mark.parametrize("kind", ["cosine", "wsd", "linear", "constant"])
def test_state_dict_round_trip_resumes_identical_lr_sequence(kind):
    kw = dict(kind=kind, warmup_steps=3, total_steps=20, min_lr_ratio=0.1, decay_ratio=0.4, decay_shape="sqrt")
    want = _lrs(25, **kw)
    opt = _opt()
    sched = build_scheduler(opt, **kw)
    got = []
    for _ in range(9):
        got.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    buf = io.BytesIO()
    torch.save({"opt": opt.state_dict(), "sched": sched.state_dict()}, buf)
    buf.seek(0)
    state = torch.load(buf, weights_only=True)  # plain values only: the checkpoint loader's contract
    # Rebuilt with other settings: the saved kind and parameters travel with the state.
    opt2 = _opt()
    sched2 = build_scheduler(opt2, kind="constant", warmup_steps=0, total_steps=1)
    opt2.load_state_dict(state["opt"])
    sched2.load_state_dict(state["sched"])
    assert sched2.lr_lambdas[0].kind == kind
    for _ in range(16):
        got.append(opt2.param_groups[0]["lr"])
        opt2.step()
        sched2.step()
    assert got == want


def test_a_warmup_cosine_checkpoint_resumes_under_the_new_cosine_schedule():
    # Checkpoints written before build_scheduler hold WarmupCosine's three attributes.
    old_opt = _opt()
    old = warmup_cosine_scheduler(old_opt, 4, 30, 0.1)
    for _ in range(7):
        old_opt.step()
        old.step()
    opt = _opt()
    new = build_scheduler(opt, kind="cosine", warmup_steps=0, total_steps=1)
    opt.load_state_dict(old_opt.state_dict())
    new.load_state_dict(old.state_dict())
    assert vars(new.lr_lambdas[0]) == vars(warmup_decay("cosine", 4, 30, 0.1))  # what a resume compares
    for _ in range(30):
        assert opt.param_groups[0]["lr"] == old_opt.param_groups[0]["lr"]
        for o, sc in ((old_opt, old), (opt, new)):
            o.step()
            sc.step()
