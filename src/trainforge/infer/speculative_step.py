"""The speculative step kind: draft k tokens per row, verify them in one forward.

Chosen when the engine is given a drafter (``speculative.py``; ``engine_parts.py`` picks the
kind). Each step the drafter proposes ``num_speculative_tokens`` (k) tokens per row, the
model verifies them in one forward (``ModelRunner.verify``), each row keeps its accepted
prefix plus one token (``speculative_sampling.accept``) and is rolled back to that length in
the pool; the tokens are read and handed out every step (rows accept different numbers).
Reservations cover k slots past a request's budget (``lookahead``), where its unused drafts
go. Prompts prefill one at a time: the drafter prefills its own state per prompt.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import numpy as np
import torch

from trainforge.infer.engine_step import DecodeHook, EngineStep
from trainforge.infer.sampling import SamplingParams
from trainforge.infer.speculative import DraftBatch, Drafter, SpecStats
from trainforge.infer.speculative_sampling import accept, accept_greedy, filtered_probs

if TYPE_CHECKING:
    from trainforge.infer.engine import Engine
    from trainforge.infer.row_state import RowState


class SpeculativeStep(EngineStep):
    packs_prompts = False

    def __init__(self, drafter: Drafter, num_speculative_tokens: int, compile: bool):
        if compile:
            raise ValueError("compile: the speculative step runs the plain forward; drop --compile or --speculative")
        self.drafter = drafter
        self.lookahead = num_speculative_tokens
        self.spec_stats = SpecStats(num_speculative_tokens)

    def check(self, params: SamplingParams) -> None:
        if params.logprobs is not None:
            raise ValueError("logprobs: not supported with speculative decoding (a step keeps tokens of two "
                             "distributions); serve without --speculative to get logprobs")
        if params.repetition_penalty != 1.0:
            raise ValueError(f"repetition_penalty={params.repetition_penalty}: not supported with speculative "
                             "decoding (the penalty would change within a step's drafts); use 1.0")

    def bind(self, engine: Engine, decode_hooks: list[DecodeHook]) -> None:
        super().bind(engine, decode_hooks)
        self.pool, self.max_pos = engine.pool, engine.model.cfg.max_seq_len - 1
        self.drafter.build(engine.model, engine.pool, engine.config.max_batch_size, engine.max_context,
                           self.lookahead)

    def row_states(self) -> list[RowState]:
        return [self.drafter]

    def prefill(self, tokens: torch.Tensor, slots: torch.Tensor, row: int) -> torch.Tensor:
        hidden = None
        if self.drafter.wants_hidden:
            logits, hidden = self.runner.prefill(tokens, slots, hidden=True)
        else:
            logits = self.runner.prefill(tokens, slots)
        self.drafter.prefill(tokens, slots, row, hidden)
        return logits

    def run(self) -> None:
        """Draft k tokens per row, verify them in one forward, keep each row's accepted
        prefix plus one token, roll the rest back; hand the tokens out (module docstring)."""
        rows, drafter, runner = self.scheduler.running, self.drafter, self.runner
        B, K = len(rows), self.lookahead
        pos = self.layout.pos
        slots, S = self.layout.verify_layout([req.id for req in rows], K)
        params, gens = self.sampler.rows(B)
        t0 = time.perf_counter()
        batch = DraftBatch(runner.tokens[:B].clone(), pos[:B].copy(), slots, self.layout.index[:B, :S], params, gens)
        draft, q = drafter.propose(batch, K)  # (B, k), (B, k, V)
        self.layout.push_verify(slots, S)  # after drafting: a drafter may run on the runner's buffers
        # Past max_seq_len a position is beyond every request's budget; clamp the rotary lookup.
        positions = np.minimum(pos[:B, None] + np.arange(K + 1), self.max_pos)
        logits = runner.verify(torch.cat([batch.tokens[:, None], draft], 1),
                               torch.from_numpy(positions).to(self.device), S, hidden=drafter.wants_hidden)
        if drafter.wants_hidden:
            logits, batch.hidden = logits  # (B, k+1, V), (B, k+1, dim)
        if q is None:  # every row greedy
            n, out = accept_greedy(draft, logits)
        else:
            n, out = accept(draft, q, filtered_probs(logits, params), params, gens)
        batch.next_tokens = out[torch.arange(B, device=self.device), n]  # the next step's inputs
        drafter.accepted(batch, draft, n)
        runner.tokens[:B] = batch.next_tokens
        n_host, out_host = n.tolist(), out.tolist()  # the host sync
        self.counters["decode_steps"] += 1
        self.counters["decode_s"] += time.perf_counter() - t0
        for r, req in enumerate(rows):
            a = n_host[r]
            length = int(pos[r]) + a + 1  # the last accepted token and a drafts are kept
            self.pool.truncate(req.id, length)
            self.layout.keep(r, length)
            req._sampled += a + 1
            self.spec_stats.add(a)
            self.outputs.append(req, out_host[r][:a + 1])  # stops and the length limit cut it short
        self.scheduler.remove_finished()

    def stats(self) -> dict:
        return self.spec_stats.as_dict(self.drafter)
