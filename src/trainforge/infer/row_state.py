"""State kept per batch row, and the one protocol that keeps it aligned with the rows.

Rows 0..B-1 of the engine's batch are its running requests, densely: when a request leaves,
the last row moves into its hole (``RowStates.compact``). Everything that keeps a value per
row (the attention layout, the sampler's parameters, the runner's next input token, and
whatever a model or a step kind adds) is a *participant*: it moves a row's state when told
and clears a row that falls empty. The engine loops over the participants and names none
(vLLM v1's persistent input batch condenses its per-row arrays the same way).
"""

from __future__ import annotations

from typing import Protocol

import torch


class RowState(Protocol):
    def move_row(self, src: int, dst: int) -> None:
        """The request in row ``src`` now sits in row ``dst``; ``src`` is left empty."""

    def clear_row(self, row: int) -> None:
        """``row`` holds no request any more."""


class RunnerInputs:
    """The runner's next input token per row (``runner.tokens``, written by sampling)."""

    def __init__(self, tokens: torch.Tensor):
        self.tokens = tokens

    def move_row(self, src: int, dst: int) -> None:
        self.tokens[dst] = self.tokens[src]

    def clear_row(self, row: int) -> None:
        pass  # an empty row's token is never read: the next request writes it at its prefill


class RowStates:
    """The participants, in the order they are told."""

    def __init__(self, participants: list[RowState]):
        self.participants = list(participants)

    def compact(self, row: int, last: int) -> None:
        """Row ``row``'s request left and ``last`` was the batch's last row: the last row's
        request moves into ``row`` (unless it was that one), and ``last`` is cleared."""
        if row != last:
            for p in self.participants:
                p.move_row(last, row)
        for p in self.participants:
            p.clear_row(last)
