"""Error feedback: what a lossy codec dropped this step is added back next step.

Without it, a value that always rounds to zero (a small gradient in a block with a
large absmax, or one outside the top-k) is never sent, and Adam, which normalises
per coordinate, never moves that weight. With it, the residual grows until it is
sent: over many steps the sum of what was sent tracks the sum of the true values
(the drift stays bounded by one step's compression error).
"""

from __future__ import annotations

import torch


class ErrorFeedback:
    """Residuals by key (one per bucket and stage). Pure bookkeeping, no communication.

    ``compensate(key, x)`` returns ``x + residual``; after encoding it,
    ``update(key, compensated, decoded)`` stores ``compensated - decoded``."""

    def __init__(self, enabled: bool = True):
        self.enabled = enabled
        self.residuals: dict[str, torch.Tensor] = {}

    def compensate(self, key: str, x: torch.Tensor) -> torch.Tensor:
        if not self.enabled:
            return x
        r = self.residuals.get(key)
        if r is None or r.shape != x.shape:
            return x.clone()  # the caller may change the result; x is a gradient buffer
        return x + r

    def update(self, key: str, compensated: torch.Tensor, decoded: torch.Tensor) -> None:
        if not self.enabled:
            return
        residual = compensated - decoded
        # A non-finite step must not poison every later step through the residual.
        self.residuals[key] = torch.nan_to_num(residual, nan=0.0, posinf=0.0, neginf=0.0)

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {k: v.detach().clone() for k, v in self.residuals.items()}

    def load_state_dict(self, state: dict[str, torch.Tensor], device: torch.device | None = None) -> None:
        """``ValueError`` unless every residual is a floating-point tensor (a residual of another
        shape than its bucket is ignored by ``compensate``)."""
        bad = [k for k, v in state.items() if not isinstance(v, torch.Tensor) or not v.is_floating_point()]
        if bad:
            raise ValueError(f"residual {bad[0]!r:.60} is not a floating-point tensor")
        self.residuals = {k: v.to(device) if device is not None else v for k, v in state.items()}
