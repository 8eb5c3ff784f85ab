"""fp16 dynamic loss scaling: ``torch.amp.GradScaler`` plus a skipped-step counter.

fp16's smallest normal is 6e-5, so small gradients underflow to zero; scaling the
loss by S (65536 at first) lifts them into range. A step whose gradients overflow
(inf/NaN) is skipped and S halves; after ``growth_steps`` clean steps S doubles.
All of that is GradScaler's; this wrapper adds the count of skipped steps (a device
tensor: read it at the logging interval, no sync per step) and one state dict for
checkpoints, loadable with ``torch.load(weights_only=True)``.

Disabled (bf16/fp32 compute) every method passes through, so the trainer has one code
path. Sharded gradients need no extra care: DTensor reduces GradScaler's inf check over
the mesh. Pipeline stages hold different parameters, so there pass the pipeline group
as ``process_group`` (FSDP's ``ShardedGradScaler`` then all-reduces the check).
"""

from __future__ import annotations

from typing import Any

import torch


class LossScaler:
    """Per optimizer step::

        for micro-batch: scaler.scale(loss).backward()
        for opt: scaler.unscale_(opt)         # before clipping: clip true gradients
        grad_norm = clip(...)                 # inf/NaN norm on an overflow step: harmless, skipped
        for opt: scaler.step(opt)             # skips the update on overflow
        scaler.update()                       # adjusts the scale, counts a skipped step
    """

    def __init__(self, enabled: bool, device_type: str, init_scale: float = 2.0**16, growth_steps: int = 2000,
                 process_group=None):
        self.enabled, self.device_type = enabled, device_type
        if process_group is not None and enabled:
            from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

            self.scaler: torch.amp.GradScaler = ShardedGradScaler(
                device_type, init_scale=init_scale, growth_interval=growth_steps, process_group=process_group)
        else:
            self.scaler = torch.amp.GradScaler(device_type, init_scale=init_scale, growth_interval=growth_steps,
                                               enabled=enabled)
        self._skipped = torch.zeros((), dtype=torch.int64)  # moved to the scale's device on first update
        self._steps = 0
        self._found_inf: torch.Tensor | None = None  # this step's, max over optimizers

    @classmethod
    def from_section(cls, section, enabled: bool, device_type: str, process_group=None) -> "LossScaler":
        """``section`` is ``[precision]``; ``enabled`` is ``policy.loss_scaling``."""
        return cls(enabled, device_type, section.loss_scale_init, section.loss_scale_growth_steps, process_group)

    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        return self.scaler.scale(loss) if self.enabled else loss

    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        self.scaler.unscale_(optimizer)

    def ensure_scale(self, device: torch.device) -> None:
        """A rank that never scales a loss (a pipeline stage before the last) still unscales,
        steps and updates with the others: give it the scale (GradScaler creates it lazily)."""
        if self.enabled and self.scaler._get_scale_async() is None:
            self.scaler.scale(torch.zeros((), device=device))

    def step(self, optimizer: torch.optim.Optimizer) -> None:
        self.scaler.step(optimizer)
        if not self.enabled:
            return
        # GradScaler keeps each optimizer's inf flags until update(); fused optimizers read
        # the same private accessor. Collected here so skipped steps are counted on device.
        found = [t.reshape(()).to(torch.float32) for t in self.scaler._found_inf_per_device(optimizer).values()]
        if found:
            step_found = torch.stack([t.to(found[0].device) for t in found]).amax()
            self._found_inf = step_found if self._found_inf is None else torch.maximum(self._found_inf, step_found)

    def update(self) -> torch.Tensor | None:
        """Returns this step's overflow flag as a device tensor (1 = skipped; None when
        disabled): buffer it for ``StepSignals.overflow`` without a host sync."""
        self.scaler.update()
        self._steps += 1
        overflow = None
        if self._found_inf is not None:
            overflow = (self._found_inf > 0).to(torch.int64)
            self._skipped = self._skipped.to(overflow.device) + overflow
            self._found_inf = None
        return overflow

    # -- reading (each a host sync: logging interval only) ---------------------------------

    @property
    def skipped_steps_tensor(self) -> torch.Tensor:
        """Skipped steps so far, as a device tensor (no sync)."""
        return self._skipped

    def skipped_steps(self) -> int:
        return int(self._skipped.item())

    def get_scale(self) -> float:
        return float(self.scaler.get_scale()) if self.enabled else 1.0

    def scale_tensor(self) -> torch.Tensor | None:
        """The current scale as a device tensor (no sync), for ``StepSignals.loss_scale``."""
        scale = self.scaler._get_scale_async() if self.enabled else None
        return None if scale is None else scale.detach().clone()  # None also before the first scale()

    # -- checkpointing ----------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """Python numbers only (``torch.load(weights_only=True)`` accepts it). Call after ``update``."""
        return {"enabled": self.enabled, "scaler": self.scaler.state_dict(), "skipped_steps": self.skipped_steps(),
                "steps": self._steps}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """A checkpoint from a run without loss scaling leaves the initial scale (and an
        fp16 checkpoint loaded into a bf16 run is ignored): the scale is a property of
        the compute dtype, not of the weights."""
        if not (self.enabled and state.get("enabled") and state.get("scaler")):
            return
        sc = state["scaler"]
        # GradScaler takes these as they are; a string or a NaN scale would fail (or train) steps later.
        checks = {"scale": lambda v: v > 0, "growth_factor": lambda v: v > 1, "backoff_factor": lambda v: 0 < v < 1,
                  "growth_interval": lambda v: isinstance(v, int) and v >= 1,
                  "_growth_tracker": lambda v: isinstance(v, int) and v >= 0}
        for key, ok in checks.items():
            v = sc.get(key) if isinstance(sc, dict) else None
            if isinstance(v, bool) or not isinstance(v, (int, float)) or v != v or v in (float("inf"), -float("inf")) \
                    or not ok(v):
                raise ValueError(f"loss scaler {key} = {v!r:.40} is out of range")
        self.scaler.load_state_dict(sc)
        self._skipped = torch.tensor(int(state["skipped_steps"]), dtype=torch.int64, device=self._skipped.device)
        self._steps = int(state["steps"])
