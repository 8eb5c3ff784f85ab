"""The inference engine: continuous batching over a paged KV cache.

``Engine(model, EngineConfig, tokenizer, eos_ids)`` takes a ready model (fused and
quantised beforehand by ``prepare.prepare_model``, or plain; the engine never changes it)
and owns one ``KVPool``, one ``ModelRunner`` and one ``BatchSampler``, all sized once.
``submit`` puts a request in a bounded FIFO queue (``QueueFull`` once running + waiting
reach ``max_batch_size + max_queue``: a request submitted while a batch row is free waits
only until the next step, so it takes that row's share of the bound, not a queue place);
each ``step``:

1. drops aborted requests (their blocks go back to the pool);
2. admits waiting requests while a batch row is free and the pool can reserve blocks for
   the request's whole budget (prompt + max_new_tokens), then prefills them and samples
   each one's first token. Prompts admitted together prefill in one forward per pack of up
   to ``max_prefill_tokens`` tokens (``ModelRunner.prefill_packed``: the matrix products
   run on hundreds of rows, not tens; 32 prompts of 8-48 tokens on the 90m model at 2 threads
   on Zen 4 prefilled x1.56 faster than one by one, x1.67 held to AVX2, paired medians of 8,
   ``bench/packed_prefill.py``);
   with a drafter, for hourglass and latent-attention models, or for a lone request, each
   prompt prefills alone (``ModelRunner.prefill``);
3. runs one decode step for every running request together, sampling the next tokens
   straight into the runner's input buffer (no host round trip);
4. every ``sync_interval_steps`` steps (1 on CPU, where reading a token costs nothing;
   8 on CUDA) reads the sampled tokens to the host, applies stop tokens / stop strings /
   length limits, streams text, and lets finished requests leave (the last row moves into
   the hole, so rows 0..B-1 stay dense).

Where each row's tokens sit in the pool (positions, slots, block index and mask, written on the
host and pushed to the runner once per step) is kept by ``batch_rows.BatchRows``.

New requests therefore join the running batch at decode-step boundaries and finished ones
leave at the next sync, which is continuous batching (Orca / vLLM style) with FIFO
admission and no preemption (reservations make it unnecessary). ``start`` runs ``step`` in
a background thread for the server; ``generate`` runs it in the caller's thread.

A request with ``SamplingParams.logprobs`` set also gets, per token, the raw log-softmax
of the logits it was sampled from (sampling.py): the sampler returns device tensors at
step 3 and they are read with the tokens at step 4 (no extra sync); refused with a drafter.

With a ``drafter`` (``speculative.py``), step 3 is a speculative step instead: the drafter
proposes ``num_speculative_tokens`` (k) tokens per row, the model verifies them in one
forward, each row keeps its accepted prefix plus one token and is rolled back to that length
in the pool; the tokens are read and handed out every step (step 4 at every step).
Reservations cover k slots past a request's budget, where its unused drafts go.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np
import torch

from trainforge.infer.batch_rows import BatchRows
from trainforge.infer.kv_pool import KVPool
from trainforge.infer.prepare import describe_model
from trainforge.infer.request import Request
from trainforge.infer.runner import ModelRunner
from trainforge.infer.sampling import BatchSampler, SamplingParams
from trainforge.infer.speculative import DraftBatch, Drafter, SpecStats, check_num_speculative_tokens
from trainforge.infer.speculative_sampling import accept, accept_greedy, filtered_probs
from trainforge.model.llama import Transformer


def _contained(error: BaseException) -> bool:
    """Whether the engine contains ``error`` (fails the requests it belongs to) rather than let it
    end the engine thread: any ``Exception``, and the ``PanicException`` of a Rust panic in the
    tokenizers library, which derives from ``BaseException`` (a tokenizer.json regex that hits
    Oniguruma's retry limit raises one from ``decode``: uncaught, it ended the thread and every
    client waited forever). Not ``KeyboardInterrupt`` / ``SystemExit``."""
    return not isinstance(error, (KeyboardInterrupt, SystemExit, GeneratorExit))


# A failed request's sampler row until it leaves: greedy, so the rest of its batch still samples.
_PLACEHOLDER = SamplingParams(temperature=0)


class QueueFull(RuntimeError):
    """The engine's waiting queue is at ``max_queue``."""


class RequestTooLong(ValueError):
    """prompt + max_new_tokens does not fit the engine's context."""


@dataclass
class EngineConfig:
    max_batch_size: int = 8  # sequences decoded together
    max_queue: int = 64  # requests waiting beyond the free batch rows; more are refused (QueueFull)
    block_size: int = 16  # tokens per KV-cache block
    n_blocks: int = 0  # KV pool size in blocks; 0 = max_batch_size full-context sequences
    max_context: int = 0  # prompt + generated tokens per sequence; 0 = the model's max_seq_len
    compile: bool = False  # torch.compile the decode step (slow to start on CPU)
    sync_interval_steps: int = 0  # decode steps between host reads of tokens; 0 = 1 on CPU, 8 on CUDA
    num_speculative_tokens: int = 4  # drafts per row per step when the engine has a drafter
    max_prefill_tokens: int = 512  # prompt tokens prefilled together in one forward (a longer prompt: alone)

    def validate(self) -> None:
        for name in ("max_batch_size", "block_size", "max_queue", "max_prefill_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)}: must be >= 1")
        for name in ("n_blocks", "max_context", "sync_interval_steps"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name}={getattr(self, name)}: must be >= 0")
        check_num_speculative_tokens(self.num_speculative_tokens)


class Engine:
    def __init__(self, model: Transformer, config: EngineConfig | None = None, tokenizer=None,
                 eos_ids: tuple[int, ...] | list[int] = (), drafter: Drafter | None = None):
        config = config or EngineConfig()
        config.validate()
        if drafter is not None and config.compile:
            raise ValueError("compile: the speculative step runs the plain forward; drop --compile or --speculative")
        if model.cfg.is_hourglass and (drafter is not None or config.compile):
            from trainforge.errors import ConfigError

            raise ConfigError(f"model.hourglass = {model.cfg.hourglass!r}: an hourglass model decodes with the plain "
                              f"engine step only ({'speculative decoding' if drafter is not None else 'compile'} "
                              "is not supported for it); drop --speculative / --compile")
        self.drafter = drafter
        # Slots a row may hold past its budget: a speculative step writes k drafts ahead.
        self.lookahead = config.num_speculative_tokens if drafter is not None else 0
        self.config, self.tokenizer, self.eos_ids = config, tokenizer, tuple(eos_ids)
        self.model = model
        described = describe_model(model)  # what prepare_model applied (read only)
        self.fusions, self.kernels = described["fusions"], described["quant_kernels"]
        cfg = model.cfg
        emb = model.norm.weight  # the model's float dtype: a quantised embedding's weight is its codes
        self.device = emb.device
        self.max_context = config.max_context or cfg.max_seq_len
        if self.max_context > cfg.max_seq_len:
            raise ValueError(f"max_context={self.max_context} exceeds the model's max_seq_len={cfg.max_seq_len}")
        bs, R = config.block_size, config.max_batch_size
        n_blocks = config.n_blocks or R * -(-(self.max_context + self.lookahead) // bs) + 1
        self.pool = KVPool.for_model(cfg, n_blocks, bs, emb.dtype, self.device)
        self.runner = ModelRunner(model, self.pool, R, self.max_context, lookahead=self.lookahead)
        self.hourglass = self.runner.extra_pools  # an hourglass model's shortened depths (hourglass_pools.py)
        # Packed prefill (step 2) needs one paged cache of per-head keys/values: a drafter prefills
        # its own state per prompt, and hourglass and latent caches prefill one prompt at a time.
        self._packs_prompts = drafter is None and self.hourglass is None and not self.runner.cache.latent
        self.sampler = BatchSampler(R, cfg.vocab_size, self.device)
        self.sync_interval = config.sync_interval_steps or (1 if self.device.type == "cpu" else 8)
        if drafter is not None:
            drafter.build(model, self.pool, R, self.max_context, self.lookahead)
            self.sync_interval = 1  # rows accept different numbers of tokens: read them every step
        # Rows 0..B-1 are the running requests, in self._rows order; their layout in the pool:
        self.layout = BatchRows(self.runner, self.pool, R)
        self._ring = torch.zeros(self.sync_interval, R, dtype=torch.long, device=self.device)
        self._ring_rows: list[list[Request]] = []
        self._ring_logprobs: list = []  # per ring step: the sampler's Logprobs or None
        self._rows: list[Request] = []
        self._waiting: deque[Request] = deque()
        self._lock = threading.Condition()
        self._ids = itertools.count()
        self._events: list[tuple[Request, list[int], str, bool]] = []
        self._thread: threading.Thread | None = None
        self._stop = False
        self.last_error: str | None = None
        self.counters: dict[str, float] = {k: 0 for k in (
            "submitted", "rejected", "finished_stop", "finished_length", "finished_abort", "finished_error",
            "prompt_tokens",
            "generated_tokens", "decode_steps", "decode_s", "prefill_s", "peak_batch")}
        self.spec_stats = SpecStats(self.lookahead)
        self.compile_s = self.runner.compile() if config.compile else None

    # -- requests (any thread) --------------------------------------------------------------

    def check(self, prompt_ids: list[int], params: SamplingParams) -> None:
        """Raise ``ValueError`` (``RequestTooLong`` for length) if the request can never run."""
        params.validate()
        if not prompt_ids:
            raise ValueError("the prompt is empty: give at least one token")
        V = self.model.cfg.vocab_size
        bad = [t for t in prompt_ids if not 0 <= t < V]
        if bad:
            raise ValueError(f"prompt token ids {bad[:5]} outside the vocabulary [0, {V})")
        total = len(prompt_ids) + params.max_new_tokens
        if total > self.max_context:
            raise RequestTooLong(f"prompt ({len(prompt_ids)} tokens) + max_new_tokens ({params.max_new_tokens}) = "
                                 f"{total} exceeds the context of {self.max_context} tokens")
        total += self.lookahead
        if self.pool.blocks_for(total) > self.pool.usable_blocks:
            raise RequestTooLong(f"{total} tokens need {self.pool.blocks_for(total)} KV blocks; the pool has "
                                 f"{self.pool.usable_blocks} (raise n_blocks)")
        if params.stop and self.tokenizer is None:
            raise ValueError("stop strings need a tokenizer; this engine has none (use stop_token_ids)")
        if self.drafter is not None and params.logprobs is not None:
            raise ValueError("logprobs: not supported with speculative decoding (a step keeps tokens of two "
                             "distributions); serve without --speculative to get logprobs")
        if self.drafter is not None and params.repetition_penalty != 1.0:
            raise ValueError(f"repetition_penalty={params.repetition_penalty}: not supported with speculative "
                             "decoding (the penalty would change within a step's drafts); use 1.0")

    def submit(self, prompt_ids: list[int], params: SamplingParams,
               on_update: Callable[[Request, list[int], str, bool], None] | None = None) -> Request:
        """Queue a request; raises ``QueueFull`` or ``ValueError`` (see ``check``)."""
        self.check(prompt_ids, params)
        cap = self.config.max_batch_size + self.config.max_queue
        with self._lock:
            # Counted against running + waiting, not waiting alone: between steps a burst sits in
            # the queue although batch rows are free, and counting it as queued refused requests
            # that had a row (a burst of max_batch_size + max_queue got 429s).
            if len(self._rows) + len(self._waiting) >= cap:
                self.counters["rejected"] += 1
                raise QueueFull(f"{len(self._rows)} requests running and {len(self._waiting)} waiting "
                                f"(max_batch_size + max_queue = {cap})")
            req = Request(next(self._ids), list(prompt_ids), params, on_update)
            self._waiting.append(req)
            self.counters["submitted"] += 1
            self._lock.notify_all()
        return req

    def abort(self, req: Request) -> None:
        """Stop ``req``; its KV blocks are freed at the next step boundary."""
        with self._lock:
            if req.done.is_set():
                return
            req._abort = True
            self._lock.notify_all()

    def load(self) -> int:
        """Requests running or waiting (an aborted one until the next step reaps it)."""
        with self._lock:  # the engine thread moves requests from the queue to rows under it
            return len(self._rows) + len(self._waiting)

    def has_work(self) -> bool:
        return bool(self._rows or self._waiting)

    # -- the step (one thread) --------------------------------------------------------------

    @torch.inference_mode()  # no autograd dispatch at all (the CLI's load runs in it too: ``cli._inference``)
    def step(self) -> None:
        """One scheduler iteration: reap aborts, admit, one decode step, sync if due."""
        self._reap()
        self._admit()
        if self._rows:
            self._decode_step()
        self._dispatch()

    def _reap(self) -> None:
        with self._lock:
            dropped = [r for r in self._waiting if r._abort]
            for r in dropped:
                self._waiting.remove(r)
        for r in dropped:
            self._finish(r, "abort")
        if any(r._abort for r in self._rows):
            self._flush()
            for row in sorted((r.row for r in self._rows if r._abort), reverse=True):
                req = self._rows[row]
                if req.finish_reason is None:
                    self._finish(req, "abort")
                self._remove_row(row)

    def _admit(self) -> None:
        """Step 2 (module docstring): take waiting requests into free rows, prefill them, sample
        their first tokens."""
        if not self._packs_prompts:
            while taken := self._take(1):
                self._prefill_alone(*taken[0])
            return
        # Rows of requests that end on their first token are free again after the packs: take again.
        while taken := self._take(self.config.max_batch_size):
            if len(taken) == 1:
                self._prefill_alone(*taken[0])
            else:
                self._prefill_packs(taken)

    def _take(self, limit: int) -> list[tuple[Request, list[int]]]:
        """Move up to ``limit`` waiting requests, FIFO, into new rows while a row is free and the
        pool can reserve each one's budget; returns them with their prompts' slots."""
        taken: list[tuple[Request, list[int]]] = []
        while len(taken) < limit and len(self._rows) < self.config.max_batch_size:
            with self._lock:
                if not self._waiting:
                    break
                req = self._waiting[0]
                total = len(req.prompt_ids) + req.params.max_new_tokens + self.lookahead
                if not self.pool.can_reserve(total) or (self.hourglass is not None
                                                         and not self.hourglass.can_reserve(total)):
                    break  # FIFO: the head waits for blocks, nothing overtakes it
                self._waiting.popleft()
                row = len(self._rows)  # under the lock: load() never misses a request in between
                req.row = row
                self._rows.append(req)
            T = len(req.prompt_ids)
            self.pool.add(req.id, total)
            slots = self.pool.append_slots(req.id, T)
            if self.hourglass is not None:
                self.hourglass.add(req.id, row, total, T)
            self.counters["peak_batch"] = max(self.counters["peak_batch"], len(self._rows))
            taken.append((req, slots))
        return taken

    def _prefill_alone(self, req: Request, slots: list[int]) -> None:
        """Prefill one request's prompt (``runner.prefill``: the fast step for a short one) and
        sample its first token; its row leaves at once if that ends it."""
        row = req.row
        t0 = time.perf_counter()
        try:  # this request alone: an error here fails it, not the batch
            tokens = torch.tensor(req.prompt_ids, dtype=torch.long, device=self.device)
            slots = torch.tensor(slots, dtype=torch.long, device=self.device)
            hidden = None
            if self.drafter is not None and self.drafter.wants_hidden:
                logits, hidden = self.runner.prefill(tokens, slots, hidden=True)
            else:
                logits = self.runner.prefill(tokens, slots)
            if self.drafter is not None:
                self.drafter.prefill(tokens, slots, row, hidden)
            self.sampler.set_row(row, req.params, req.prompt_ids)
            lp = self.sampler.sample(logits, row, self.runner.tokens[row:row + 1])
            first = int(self.runner.tokens[row])  # one host read per request, not per token
            lp = None if lp is None else lp.to_host([req.params.logprobs])
        except BaseException as e:
            if not _contained(e):
                raise
            self._fail_request(req, e, "prefilling its prompt")
            self._remove_row(row)
            return
        self.counters["prefill_s"] += time.perf_counter() - t0
        self._start_row(req, first, lp)
        if req.finish_reason is not None:
            self._remove_row(row)

    def _prefill_packs(self, taken: list[tuple[Request, list[int]]]) -> None:
        """Prefill ``taken`` (new requests in consecutive rows, FIFO order) in packs of at most
        ``max_prefill_tokens`` prompt tokens, one forward each (a longer prompt alone), and sample
        each pack's first tokens together. Requests that end on their first token leave only
        after the last pack: removing a row moves the last row into it, which may not be
        prefilled yet."""
        packs: list[list[tuple[Request, list[int]]]] = [[]]
        pack_tokens = 0
        for item in taken:
            T = len(item[0].prompt_ids)
            if packs[-1] and pack_tokens + T > self.config.max_prefill_tokens:
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
                if not _contained(e):
                    raise
                for r in reqs:
                    if r.finish_reason is None:
                        self._fail_request(r, e, "prefilling its prompt")
                continue
            self.counters["prefill_s"] += time.perf_counter() - t0
            for i, r in enumerate(reqs):
                if r.finish_reason is None:  # not failed by its sampler row
                    self._start_row(r, firsts[i], None if lps is None or lps[i] is None else [lps[i]])
        for row in sorted((req.row for req, _ in taken if req.finish_reason is not None), reverse=True):
            self._remove_row(row)

    def _set_row(self, req: Request) -> None:
        """The sampler's row for ``req``. An error there (its parameters) fails ``req`` alone; the
        row then samples greedily until it leaves, so its pack's draw still runs."""
        try:
            self.sampler.set_row(req.row, req.params, req.prompt_ids)
        except BaseException as e:
            if not _contained(e):
                raise
            self._fail_request(req, e, "setting up its sampler")
            self.sampler.set_row(req.row, _PLACEHOLDER, [])

    def _start_row(self, req: Request, first: int, logprobs: list | None) -> None:
        """A prefilled request's row: counters, position and context of its prompt; then its
        first token, which may end it (the caller removes the row)."""
        T = len(req.prompt_ids)
        self.counters["prompt_tokens"] += T
        req._sampled = 1
        self.layout.start(req.row, req.id, T)
        self._append(req, [first], logprobs)

    def _decode_step(self) -> None:
        if self.drafter is not None:
            return self._speculative_step()
        B = len(self._rows)
        pos, ids = self.layout.pos, [req.id for req in self._rows]
        S = self.layout.decode_layout(ids)
        t0 = time.perf_counter()
        if self.hourglass is not None:  # the shortened depths' rows this step (never compiled)
            self.hourglass.set_decode(ids, pos[:B])
        logits = self.runner.decode(B, S)
        tokens = self.runner.tokens[:B]
        lp = self.sampler.sample(logits, 0, tokens)  # the next step's inputs, written in place
        k = len(self._ring_rows)
        self._ring[k, :B].copy_(tokens)
        self._ring_rows.append(list(self._rows))
        self._ring_logprobs.append(lp)  # device tensors (or None), read at the flush
        pos[:B] += 1
        self.counters["decode_steps"] += 1
        self.counters["decode_s"] += time.perf_counter() - t0
        due = False
        for req in self._rows:
            req._sampled += 1
            due |= req._sampled >= req.params.max_new_tokens
        if due or len(self._ring_rows) == self.sync_interval:
            self._flush()
            for row in sorted((r.row for r in self._rows if r.finish_reason is not None), reverse=True):
                self._remove_row(row)

    def _speculative_step(self) -> None:
        """Draft k tokens per row, verify them in one forward, keep each row's accepted
        prefix plus one token, roll the rest back; hand the tokens out (module docstring)."""
        B, K = len(self._rows), self.lookahead
        pos = self.layout.pos
        slots, S = self.layout.verify_layout([req.id for req in self._rows], K)
        params, gens = self.sampler.rows(B)
        t0 = time.perf_counter()
        batch = DraftBatch(self.runner.tokens[:B].clone(), pos[:B].copy(), slots, self.layout.index[:B, :S], params,
                           gens)
        draft, q = self.drafter.propose(batch, K)  # (B, k), (B, k, V)
        self.layout.push_verify(slots, S)  # after drafting: a drafter may run on the runner's buffers
        # Past max_seq_len a position is beyond every request's budget; clamp the rotary lookup.
        positions = np.minimum(pos[:B, None] + np.arange(K + 1), self.model.cfg.max_seq_len - 1)
        logits = self.runner.verify(torch.cat([batch.tokens[:, None], draft], 1),
                                    torch.from_numpy(positions).to(self.device), S,
                                    hidden=self.drafter.wants_hidden)  # (B, k+1, V)
        if self.drafter.wants_hidden:
            logits, batch.hidden = logits
        if q is None:  # every row greedy
            n, out = accept_greedy(draft, logits)
        else:
            n, out = accept(draft, q, filtered_probs(logits, params), params, gens)
        batch.next_tokens = out[torch.arange(B, device=self.device), n]  # the next step's inputs
        self.drafter.accepted(batch, draft, n)
        self.runner.tokens[:B] = batch.next_tokens
        n_host, out_host = n.tolist(), out.tolist()  # the host sync
        self.counters["decode_steps"] += 1
        self.counters["decode_s"] += time.perf_counter() - t0
        for r, req in enumerate(self._rows):
            a = n_host[r]
            length = int(pos[r]) + a + 1  # the last accepted token and a drafts are kept
            self.pool.truncate(req.id, length)
            self.layout.keep(r, length)
            req._sampled += a + 1
            self.spec_stats.add(a)
            self._append(req, out_host[r][:a + 1])  # stops and the length limit cut it short
        for row in sorted((r.row for r in self._rows if r.finish_reason is not None), reverse=True):
            self._remove_row(row)

    def _flush(self) -> None:
        """Read the sampled tokens of the steps since the last flush and hand them out."""
        if not self._ring_rows:
            return
        values = self._ring[:len(self._ring_rows)].tolist()  # the host sync
        for step_rows, step_values, lp in zip(self._ring_rows, values, self._ring_logprobs):
            lps = None if lp is None else lp.to_host([r.params.logprobs for r in step_rows])
            for r, req in enumerate(step_rows):
                if req.finish_reason is None:
                    self._append(req, [step_values[r]], None if lps is None or lps[r] is None else [lps[r]])
        self._ring_rows.clear()
        self._ring_logprobs.clear()

    def _remove_row(self, row: int) -> None:
        req = self._rows[row]
        self.pool.free(req.id)
        if self.hourglass is not None:
            self.hourglass.free(req.id)
        req.row = None
        last = len(self._rows) - 1
        if row != last:
            moved = self._rows[last]
            self._rows[row] = moved
            moved.row = row
            self.runner.tokens[row] = self.runner.tokens[last]
            self.layout.move(last, row)
            self.sampler.move_row(last, row)
            if self.drafter is not None:
                self.drafter.move_row(last, row)
            if self.hourglass is not None:
                self.hourglass.move_row(last, row)
        else:
            self.sampler.clear_row(row)
        self._rows.pop()
        self.layout.clear(last)
        if self.hourglass is not None:
            self.hourglass.clear_row(last)

    # -- outputs ----------------------------------------------------------------------------

    def _append(self, req: Request, ids: list[int], logprobs: list | None = None) -> None:
        """Hand sampled ids (and their logprobs) to ``req`` and queue what it streams (request.py).
        An error in its detokenisation or stop check fails ``req`` alone."""
        try:
            new, delta, reason = req.add_tokens(ids, self.eos_ids, self.tokenizer, logprobs)
        except BaseException as e:
            if not _contained(e):
                raise
            return self._fail_request(req, e, "detokenising its output")
        self.counters["generated_tokens"] += len(new)
        if reason is not None:
            self._finish(req, reason, new, delta)
        elif new or delta:
            self._events.append((req, new, delta, False))

    def _finish(self, req: Request, reason: str, new: list[int] | None = None, delta: str = "") -> None:
        req.finish_reason = reason
        req.finished_s = time.perf_counter()
        self.counters[f"finished_{reason}"] += 1
        self._events.append((req, new or [], delta, True))

    def _fail_request(self, req: Request, error: BaseException, during: str) -> None:
        """End ``req`` alone (reason "error", ``req.error`` says why) after an error only it met;
        its row leaves with the step's finished rows. The others go on."""
        from trainforge.log import get_logger

        req.error = f"{during} failed: {type(error).__name__}: {str(error)[:300]}"
        get_logger().warning(f"engine: request {req.id} failed, the others go on: {req.error}")
        self._finish(req, "error")

    def _dispatch(self) -> None:
        """Callbacks after the step, once finished requests' blocks are back in the pool."""
        events, self._events = self._events, []
        for req, ids, text, finished in events:
            if req.on_update is not None:
                try:
                    req.on_update(req, ids, text, finished)
                except BaseException as e:  # a consumer's bug must not stop the engine for everyone
                    if not _contained(e):
                        raise
            if finished:
                req.done.set()

    # -- drivers ----------------------------------------------------------------------------

    def generate(self, prompts: list[list[int]], params: SamplingParams | list[SamplingParams]) -> list[Request]:
        """Run ``prompts`` to completion in this thread (queue bound respected); returns the
        requests in prompt order."""
        plist = params if isinstance(params, list) else [params] * len(prompts)
        for p, sp in zip(prompts, plist):
            self.check(p, sp)
        pending = list(zip(prompts, plist))
        reqs: list[Request] = []
        while pending or self.has_work():
            while pending and len(self._waiting) < self.config.max_queue:
                reqs.append(self.submit(*pending.pop(0)))
            self.step()
        return reqs

    def start(self) -> None:
        """Step in a background thread until ``stop``."""
        if self._thread is not None:
            return
        self._stop = False
        self._thread = threading.Thread(target=self._loop, name="trainforge-engine", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        with self._lock:
            self._stop = True
            self._lock.notify_all()
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    def _loop(self) -> None:
        while True:
            with self._lock:
                while not self._stop and not self.has_work():
                    self._lock.wait()
                if self._stop:
                    return
            try:
                self.step()
            except BaseException as e:  # a failing step must not leave clients waiting forever
                if not _contained(e):
                    raise
                self._fail_all(e)

    def _fail_all(self, error: Exception) -> None:
        """End every request (reason "error") after an error in the batch's own step (the decode
        forward, say), freeing the pool. Errors one request causes end that request only
        (``_fail_request``)."""
        from trainforge.log import get_logger

        get_logger().error(f"engine step failed, failing {self.load()} requests: {error!r}")
        self.last_error = repr(error)
        why = f"the engine step failed: {type(error).__name__}: {str(error)[:300]}"
        with self._lock:
            waiting, self._waiting = list(self._waiting), deque()
        self._ring_rows.clear()
        self._ring_logprobs.clear()
        for row in range(len(self._rows) - 1, -1, -1):
            req = self._rows[row]
            if req.finish_reason is None:
                req.error = why
                self._finish(req, "error")
            self._remove_row(row)
        for req in waiting:
            req.error = why
            self._finish(req, "error")
        self._dispatch()

    # -- reporting --------------------------------------------------------------------------

    @property
    def kv_pool_bytes(self) -> int:
        return self.pool.nbytes + (self.hourglass.nbytes if self.hourglass is not None else 0)

    @property
    def kv_bytes_per_token(self) -> float:
        """Pool bytes a token of sequence takes (an hourglass model's shortened depths store
        one entry per ``rate`` tokens)."""
        return self.pool.bytes_per_token + (self.hourglass.bytes_per_token() if self.hourglass is not None else 0)

    def stats(self) -> dict[str, Any]:
        c = self.counters
        return {**c, "running": len(self._rows), "waiting": len(self._waiting),
                "decode_tokens_per_s": c["generated_tokens"] / c["decode_s"] if c["decode_s"] else 0.0,
                "kv_pool": self.pool.utilisation(), "kv_pool_bytes": self.kv_pool_bytes,
                "kv_bytes_per_token": self.kv_bytes_per_token,
                "workspace_bytes": self.runner.workspace_bytes, "compile_s": self.compile_s,
                "fusions": self.fusions, "quant_kernels": self.kernels,
                **(self.spec_stats.as_dict(self.drafter) if self.drafter is not None else {})}
