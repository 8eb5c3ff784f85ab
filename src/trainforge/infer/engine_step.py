"""What one engine step does for the running batch, chosen once when the engine is built.

The engine's step is the same for every model: reap aborts, admit and prefill, run the step
kind for the running rows, hand out the outputs. The *step kind* is the part that differs
between decoding modes, so the engine does not branch on the mode (as ``train/step_layout.py``
keeps the trainer from branching on local or pipeline): ``DecodeStep`` here samples one token
per row; other kinds subclass ``EngineStep`` in their own files and ``engine_parts.py`` picks
one from the engine's options.

``DecodeStep``: one decode step for every running request together, sampling the next tokens
straight into the runner's input buffer (no host round trip); every ``sync_interval`` steps
(``sync_interval_steps``: 0 means 1 on CPU, where reading a token costs nothing, and 8 on
CUDA) the sampled tokens are read to the host in one copy, handed to the output processor
(stops, text, streaming), and finished requests leave. Logprobs come back from the sampler
as device tensors and are read with the tokens (no extra sync).
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Callable

import numpy as np
import torch

from trainforge.infer.request import Request
from trainforge.infer.sampling import SamplingParams

if TYPE_CHECKING:
    from trainforge.infer.engine import Engine
    from trainforge.infer.row_state import RowState

# A participant's hook run before each decode forward: (the rows' sequence ids, their positions (B,)).
DecodeHook = Callable[[list[int], np.ndarray], None]


class EngineStep:
    """A step kind. ``lookahead``: slots a row may hold past its budget (reserved at
    admission); ``packs_prompts``: whether prompts admitted together may prefill in one
    forward (a kind that prefills state of its own per prompt says no)."""

    lookahead = 0
    packs_prompts = True

    def check(self, params: SamplingParams) -> None:
        """``ValueError`` naming the option if this kind cannot serve ``params``."""

    def bind(self, engine: Engine, decode_hooks: list[DecodeHook]) -> None:
        """Take the engine's parts (built once, after the pools are sized by ``lookahead``)."""
        self.scheduler, self.runner, self.sampler = engine.scheduler, engine.runner, engine.sampler
        self.layout, self.outputs, self.counters = engine.layout, engine.outputs, engine.counters
        self.device = engine.device
        self.hooks = decode_hooks

    def row_states(self) -> list[RowState]:
        """Per-row state this kind keeps (it joins the engine's ``RowStates``)."""
        return []

    def prefill(self, tokens: torch.Tensor, slots: torch.Tensor, row: int) -> torch.Tensor:
        """One new request's prompt (T,) at ``slots`` (T,), in batch row ``row``; its last logits."""
        return self.runner.prefill(tokens, slots)

    def run(self) -> None:
        """One step for running rows 0..B-1 (B >= 1)."""
        raise NotImplementedError

    def flush(self) -> None:
        """Hand out every token sampled but not yet read."""

    def discard(self) -> None:
        """Forget tokens sampled but not read (the batch failed)."""

    def stats(self) -> dict:
        return {}


class DecodeStep(EngineStep):
    """One sampled token per row per step (module docstring)."""

    def __init__(self, sync_interval_steps: int):
        self.sync_interval_steps = sync_interval_steps

    def bind(self, engine: Engine, decode_hooks: list[DecodeHook]) -> None:
        super().bind(engine, decode_hooks)
        self.sync_interval = self.sync_interval_steps or (1 if self.device.type == "cpu" else 8)
        self._ring = torch.zeros(self.sync_interval, engine.config.max_batch_size, dtype=torch.long,
                                 device=self.device)
        self._ring_rows: list[list[Request]] = []
        self._ring_logprobs: list = []  # per ring step: the sampler's Logprobs or None

    def run(self) -> None:
        rows = self.scheduler.running
        B = len(rows)
        pos, ids = self.layout.pos, [req.id for req in rows]
        S = self.layout.decode_layout(ids)
        t0 = time.perf_counter()
        for hook in self.hooks:  # a model's own per-step metadata (never compiled)
            hook(ids, pos[:B])
        logits = self.runner.decode(B, S)
        tokens = self.runner.tokens[:B]
        lp = self.sampler.sample(logits, 0, tokens)  # the next step's inputs, written in place
        k = len(self._ring_rows)
        self._ring[k, :B].copy_(tokens)
        self._ring_rows.append(list(rows))
        self._ring_logprobs.append(lp)  # device tensors (or None), read at the flush
        pos[:B] += 1
        counters = self.counters
        counters["decode_steps"] += 1
        counters["decode_s"] += time.perf_counter() - t0
        due = False
        for req in rows:
            req._sampled += 1
            due |= req._sampled >= req.params.max_new_tokens
        if due or len(self._ring_rows) == self.sync_interval:
            self.flush()
            self.scheduler.remove_finished()

    def flush(self) -> None:
        """Read the sampled tokens of the steps since the last flush and hand them out."""
        if not self._ring_rows:
            return
        values = self._ring[:len(self._ring_rows)].tolist()  # the host sync
        append = self.outputs.append
        for step_rows, step_values, lp in zip(self._ring_rows, values, self._ring_logprobs):
            lps = None if lp is None else lp.to_host([r.params.logprobs for r in step_rows])
            for r, req in enumerate(step_rows):
                if req.finish_reason is None:
                    append(req, [step_values[r]], None if lps is None or lps[r] is None else [lps[r]])
        self._ring_rows.clear()
        self._ring_logprobs.clear()

    def discard(self) -> None:
        self._ring_rows.clear()
        self._ring_logprobs.clear()
