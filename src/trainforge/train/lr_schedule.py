"""Learning-rate schedules on ``torch.optim.lr_scheduler``.

``WarmupCosine`` is a picklable callable (not a lambda) so ``LambdaLR.state_dict``
stores its parameters and a resumed run rebuilds the identical schedule."""

from __future__ import annotations

import math

import torch
from torch.optim.lr_scheduler import LambdaLR


class WarmupCosine:
    """Multiplier of the peak LR at scheduler step k (0 = before the first update):
    linear ramp (k+1)/warmup_steps, then half-cosine from 1 to ``min_lr_ratio`` at ``total_steps``."""

    def __init__(self, warmup_steps: int, total_steps: int, min_lr_ratio: float):
        self.warmup_steps, self.total_steps, self.min_lr_ratio = warmup_steps, total_steps, min_lr_ratio

    def __call__(self, k: int) -> float:
        if k < self.warmup_steps:
            return (k + 1) / self.warmup_steps
        progress = min(1.0, (k - self.warmup_steps) / max(1, self.total_steps - self.warmup_steps))
        return self.min_lr_ratio + (1.0 - self.min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


def warmup_cosine_scheduler(optimizer: torch.optim.Optimizer, warmup_steps: int, total_steps: int,
                            min_lr_ratio: float) -> LambdaLR:
    return LambdaLR(optimizer, WarmupCosine(warmup_steps, total_steps, min_lr_ratio))
