"""Admitted requests' prompts: prefill them and sample each one's first token.

Prompts admitted together prefill in one forward per pack of up to ``max_prefill_tokens``
tokens (``ModelRunner.prefill_packed``: the matrix products run on hundreds of rows, not
tens; 32 prompts of 8-48 tokens on the 90m model at 2 threads on Zen 4 prefilled x1.56
faster than one by one, x1.67 held to AVX2, paired medians of 8, ``bench/packed_prefill.py``).
Where the model or the step kind keeps per-prompt state of its own (``packs_prompts`` false),
or for a lone request, each prompt prefills alone through the step kind
(``EngineStep.prefill``). An error in a prefill fails the requests of that forward, not the
running batch.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import torch

from trainforge.infer.output_processor import contained
from trainforge.infer.request import Request
from trainforge.infer.sampling import SamplingParams

if TYPE_CHECKING:
    from trainforge.infer.engine import Engine

# A failed request's sampler row until it leaves: greedy, so the rest of its batch still samples.
_PLACEHOLDER = SamplingParams(temperature=0)


class PromptPrefill:
    def __init__(self, engine: Engine, packs_prompts: bool):
        self.scheduler, self.step_kind, self.runner = engine.scheduler, engine.step_kind, engine.runner
        self.sampler, self.layout, self.outputs = engine.sampler, engine.layout, engine.outputs
        self.counters, self.device = engine.counters, engine.device
        self.max_batch_size, self.max_prefill_tokens = engine.config.max_batch_size, engine.config.max_prefill_tokens
        self.packs_prompts = packs_prompts

    def admit(self) -> None:
        """Take waiting requests into free rows, prefill them, sample their first tokens."""
        take = self.scheduler.take
        if not self.packs_prompts:
            while taken := take(1):
                self.alone(*taken[0])
            return
        # Rows of requests that end on their first token are free again after the packs: take again.
        while taken := take(self.max_batch_size):
            if len(taken) == 1:
                self.alone(*taken[0])
            else:
                self.packs(taken)

    def alone(self, req: Request, slots: list[int]) -> None:
        """Prefill one request's prompt (``runner.prefill``: the fast step for a short one) and
        sample its first token; its row leaves at once if that ends it."""
        row = req.row
        t0 = time.perf_counter()
        try:  # this request alone: an error here fails it, not the batch
            tokens = torch.tensor(req.prompt_ids, dtype=torch.long, device=self.device)
            slots = torch.tensor(slots, dtype=torch.long, device=self.device)
            logits = self.step_kind.prefill(tokens, slots, row)
            self.sampler.set_row(row, req.params, req.prompt_ids)
            lp = self.sampler.sample(logits, row, self.runner.tokens[row:row + 1])
            first = int(self.runner.tokens[row])  # one host read per request, not per token
            lp = None if lp is None else lp.to_host([req.params.logprobs])
        except BaseException as e:
            if not contained(e):
                raise
            self.outputs.fail(req, e, "prefilling its prompt")
            self.scheduler.remove_row(row)
            return
        self.counters["prefill_s"] += time.perf_counter() - t0
        self._start_row(req, first, lp)
        if req.finish_reason is not None:
            self.scheduler.remove_row(row)

    def packs(self, taken: list[tuple[Request, list[int]]]) -> None:
        """Prefill ``taken`` (new requests in consecutive rows, FIFO order) in packs of at most
        ``max_prefill_tokens`` prompt tokens, one forward each (a longer prompt alone), and sample
        each pack's first tokens together. Requests that end on their first token leave only
        after the last pack: removing a row moves the last row into it, which may not be
        prefilled yet."""
        packs: list[list[tuple[Request, list[int]]]] = [[]]
        pack_tokens = 0
        for item in taken:
            T = len(item[0].prompt_ids)
            if packs[-1] and pack_tokens + T > self.max_prefill_tokens:
                packs.append([])
                pack_tokens = 0
            packs[-1].append(item)
            pack_tokens += T
        for pack in packs:
            t0 = time.perf_counter()
            reqs = [req for req, _ in pack]
            row0, n = reqs[0].row, len(reqs)
            assert [r.row for r in reqs] == list(range(row0, row0 + n)), "a pack's rows are consecutive"
            try:  # an error in the pack's forward fails the pack's requests, not the running batch
                tokens = torch.tensor([t for r in reqs for t in r.prompt_ids], dtype=torch.long, device=self.device)
                slots = torch.tensor([s for _, sl in pack for s in sl], dtype=torch.long, device=self.device)
                if n == 1:
                    logits = self.runner.prefill(tokens, slots)  # the fast step for a short prompt
                else:
                    logits = self.runner.prefill_packed(tokens, slots, [len(r.prompt_ids) for r in reqs])
                for r in reqs:
                    self._set_row(r)
                out = self.runner.tokens[row0:row0 + n]
                lp = self.sampler.sample(logits, row0, out)
                firsts = out.tolist()  # one host read per pack
                lps = None if lp is None else lp.to_host([r.params.logprobs for r in reqs])
            except BaseException as e:
                if not contained(e):
                    raise
                for r in reqs:
                    if r.finish_reason is None:
                        self.outputs.fail(r, e, "prefilling its prompt")
                continue
            self.counters["prefill_s"] += time.perf_counter() - t0
            for i, r in enumerate(reqs):
                if r.finish_reason is None:  # not failed by its sampler row
                    self._start_row(r, firsts[i], None if lps is None or lps[i] is None else [lps[i]])
        for row in sorted((req.row for req, _ in taken if req.finish_reason is not None), reverse=True):
            self.scheduler.remove_row(row)

    def _set_row(self, req: Request) -> None:
        """The sampler's row for ``req``. An error there (its parameters) fails ``req`` alone; the
        row then samples greedily until it leaves, so its pack's draw still runs."""
        try:
            self.sampler.set_row(req.row, req.params, req.prompt_ids)
        except BaseException as e:
            if not contained(e):
                raise
            self.outputs.fail(req, e, "setting up its sampler")
            self.sampler.set_row(req.row, _PLACEHOLDER, [])

    def _start_row(self, req: Request, first: int, logprobs: list | None) -> None:
        """A prefilled request's row: counters, position and context of its prompt; then its
        first token, which may end it (the caller removes the row)."""
        T = len(req.prompt_ids)
        self.counters["prompt_tokens"] += T
        req._sampled = 1
        self.layout.start(req.row, req.id, T)
        self.outputs.append(req, [first], logprobs)
