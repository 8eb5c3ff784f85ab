"""``[ema]``: an exponential moving average of the weights (``train/ema.py``), validated at the edge.

Off by default: a run without the section trains, saves and resumes exactly as before."""

from __future__ import annotations

import math
from dataclasses import dataclass

from trainforge.config_base import _f, _require


@dataclass
class EMASection:
    enabled: bool = _f(False, "keep an exponential moving average of the weights (fp32), saved with every "
                              "checkpoint; generate, export and serve use it with --weights ema")
    decay: float = _f(0.999, "weight of the old average at each update: ema = decay x ema + (1 - decay) x weights; "
                             "the average spans about interval / (1 - decay) steps")
    interval: int = _f(1, "update the average after every this many optimizer steps")
    on_cpu: bool = _f(True, "keep the average in host memory and update it on a host thread, overlapping the next "
                            "step (on a GPU: copied out on a side stream); false = on the training device, "
                            "updated in the step")

    def validate(self) -> None:
        _require(math.isfinite(self.decay) and 0.0 <= self.decay < 1.0, "ema.decay", self.decay,
                 "a number in [0, 1) (e.g. 0.999: about the last 1000 updates)")
        _require(self.interval >= 1, "ema.interval", self.interval, "an integer >= 1 (optimizer steps per update)")
