import math

import torch

from trainforge.train.lr_schedule import warmup_cosine_scheduler


def test_warmup_then_cosine_to_floor_and_state_round_trip():
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    sched = warmup_cosine_scheduler(opt, warmup_steps=10, total_steps=110, min_lr_ratio=0.1)
    lrs = []
    for _ in range(120):
        lrs.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    assert lrs[0] == 0.1 and lrs[9] == 1.0  # linear ramp reaches the peak at the end of warmup
    assert all(a < b for a, b in zip(lrs[:9], lrs[1:10]))
    assert math.isclose(lrs[60], 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 0.5)))
    assert all(a >= b for a, b in zip(lrs[10:110], lrs[11:111]))
    assert math.isclose(lrs[110], 0.1) and math.isclose(lrs[119], 0.1)  # stays at the floor

    state = sched.state_dict()
    opt2 = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    sched2 = warmup_cosine_scheduler(opt2, warmup_steps=0, total_steps=1, min_lr_ratio=0.0)
    sched2.load_state_dict(state)  # the schedule's parameters travel with its state
    assert sched2.lr_lambdas[0](60) == sched.lr_lambdas[0](60)
