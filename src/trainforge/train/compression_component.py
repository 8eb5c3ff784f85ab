"""Gradient compression as a loop component (an adapter: ``compression/`` knows nothing
of the trainer). The compressor's state (error-feedback residuals, bit widths, warm-up
count) differs per rank, so sharded checkpoints keep it in ``compression/rank_NNNNN.pt``."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

from trainforge.train.component import Component


class CompressionComponent(Component):
    """``compressor``: a ``GradientCompressor``, ``HostReduce`` or ``PowerSGDBaseline``
    (``end_step``, ``window_stats``, ``state_dict``, ``load_state_dict`` returning a
    warning or None; optionally ``update_ready()``: False rejects this step's update)."""

    name = "compression"
    per_rank = True

    def __init__(self, compressor: Any, warn: Callable[[str], None] | None = None):
        self.compressor, self.warn = compressor, warn
        if not hasattr(compressor, "update_ready"):
            self.before_optimizer_step = None  # the registry then skips the hook

    def before_optimizer_step(self, loop: Any, loss: Any, grad_norm: Any) -> bool:
        # compression.host_reduce_delay = 1: the first step has no reduced gradient to apply.
        return self.compressor.update_ready()

    def on_step_end(self, loop: Any, step: int) -> None:
        self.compressor.end_step()  # advances the warm-up, counts the window

    def on_log(self, loop: Any, window: Any) -> dict[str, Any]:
        return self.compressor.window_stats()

    def on_missing_state(self, loop: Any, path: Path) -> None:
        if loop.is_main:
            loop.log.warning(f"{path} has no compression state for this layout: error-feedback residuals "
                             "start at zero and the warm-up restarts")

    def state_dict(self) -> dict[str, Any]:
        return self.compressor.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        warning = self.compressor.load_state_dict(state)  # another codec or group size: residuals dropped
        if warning and self.warn is not None:
            self.warn(warning)
