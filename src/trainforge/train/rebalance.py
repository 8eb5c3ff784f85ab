"""Pipeline re-balancing as a loop component: at each logging window, compare the
measured per-stage compute times (``stage_compute_s``, identical on every rank) with
the split's plan and, when they drifted more than ``parallel.rebalance_threshold``,
stop with ``StopKind.REBALANCE``: the loop checkpoints, and the CLI reloads that
checkpoint into a fresh split measured now (resume is exact, so training is unchanged).
The decision itself is ``parallel/stage_balance.should_rebalance``."""

from __future__ import annotations

from typing import Any

from trainforge.parallel.stage_balance import should_rebalance
from trainforge.train.component import Component, Stop, StopKind


class PipelineRebalance(Component):
    """``predicted``: the plan's per-stage seconds; ``threshold``: the drift that triggers;
    ``min_steps``: steps since the last (re)start before judging; ``total_steps``: no
    re-split once the run is done. No checkpoint state: a restart counts from its step."""

    name = "pipeline_rebalance"

    def __init__(self, predicted: list[float], threshold: float, min_steps: int, total_steps: int):
        self.predicted, self.threshold, self.min_steps, self.total_steps = predicted, threshold, min_steps, total_steps
        self.last_balance_step = 0

    def on_load(self, loop: Any) -> None:
        self.last_balance_step = loop.step

    def on_log(self, loop: Any, window: Any) -> None:
        stage_s = window.stats.get("stage_compute_s")
        if stage_s is None or loop.step - self.last_balance_step < self.min_steps or loop.step >= self.total_steps:
            return
        if should_rebalance(stage_s, self.threshold, self.predicted):
            ms = [round(1e3 * t, 1) for t in stage_s]
            planned = [round(1e3 * t, 2) for t in self.predicted]
            loop.request(Stop(f"rebalance: measured stage ms {ms} drifted more than {self.threshold:.0%} from "
                              f"the plan {planned}", StopKind.REBALANCE))
