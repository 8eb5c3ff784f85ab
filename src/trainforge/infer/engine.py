"""The inference engine: continuous batching over a paged KV cache.

``Engine(model, EngineConfig, tokenizer, eos_ids)`` takes a ready model (fused and
quantised beforehand by ``prepare.prepare_model``, or plain; the engine never changes it)
and builds, once, the parts vLLM v1's engine draws the same lines between:

- the scheduler (scheduler.py): the bounded FIFO queue, admission into batch rows, the
  reservation of each request's whole budget in the pools;
- the pool set (pool_set.py): the paged ``KVPool`` and whatever pools the model adds;
- the model runner (runner.py) and the batch's layout in the pool (batch_rows.py);
- the row states (row_state.py): everything kept per batch row (layout, sampler, the
  runner's next tokens, and the model's and the step kind's own), moved and cleared through
  one ``move_row`` / ``clear_row`` protocol when a request leaves;
- the step kind (engine_step.py), chosen once from the engine's options: what one step
  does for the running rows;
- the output processor (output_processor.py): stop rules, detokenisation, streaming,
  callbacks.

What a model family or a decoding mode adds is decided in one place, ``engine_parts.py``;
this file names none. Each ``step``:

1. drops aborted requests (their blocks go back to the pools);
2. admits waiting requests while a batch row is free and the pools can reserve the request's
   budget, prefills them and samples each one's first token (prompt_prefill.py: packed into
   few forwards where the parts allow);
3. runs the step kind for every running request together (the plain kind: one decode
   step, the next tokens sampled straight into the runner's input buffer, read to the host
   every ``sync_interval_steps``);
4. hands sampled tokens to the output processor and lets finished requests leave (the last
   row moves into the hole, so rows 0..B-1 stay dense), then runs the callbacks.

New requests therefore join the running batch at step boundaries and finished ones leave at
the next sync, which is continuous batching (Orca / vLLM style) with FIFO admission and no
preemption (reservations make it unnecessary). ``start`` runs ``step`` in a background thread
for the server; ``generate`` runs it in the caller's thread.

A request with ``SamplingParams.logprobs`` set also gets, per token, the raw log-softmax of
the logits it was sampled from (sampling.py), read with the tokens (no extra sync).
"""

from __future__ import annotations

import threading
from typing import Any, Callable

import torch

from trainforge.infer.batch_rows import BatchRows
from trainforge.infer.engine_config import EngineConfig
from trainforge.infer.engine_parts import choose_step, model_parts
from trainforge.infer.kv_pool import KVPool
from trainforge.infer.output_processor import OutputProcessor, contained
from trainforge.infer.pool_set import PoolSet
from trainforge.infer.prepare import describe_model
from trainforge.infer.prompt_prefill import PromptPrefill
from trainforge.infer.request import Request
from trainforge.infer.row_state import RowStates, RunnerInputs
from trainforge.infer.runner import ModelRunner
from trainforge.infer.sampling import BatchSampler, SamplingParams
from trainforge.infer.scheduler import QueueFull, Scheduler
from trainforge.model.llama import Transformer

__all__ = ["Engine", "EngineConfig", "QueueFull", "RequestTooLong"]


class RequestTooLong(ValueError):
    """prompt + max_new_tokens does not fit the engine's context."""


class Engine:
    """Continuous batching of ``model`` (module docstring). ``tokenizer`` (None: token ids only)
    detokenises and finds stop strings; ``eos_ids`` end a request unless it ignores them.
    Keyword ``options`` choose the step kind (``engine_parts.choose_step`` lists them; an
    unknown one is a TypeError); the parts a family or a mode adds are readable by the name
    ``engine_parts`` gives them (None where this engine has none).

    ``submit`` / ``abort`` / ``load`` from any thread; ``step`` (or ``start``'s thread, or
    ``generate``) in one thread; ``stats`` for the counters."""

    def __init__(self, model: Transformer, config: EngineConfig | None = None, tokenizer=None,
                 eos_ids: tuple[int, ...] | list[int] = (), **options):
        config = config or EngineConfig()
        config.validate()
        self.step_kind, named = choose_step(model, config, **options)
        # Slots a row may hold past its budget (a step kind that writes ahead of the accepted tokens).
        self.lookahead = self.step_kind.lookahead
        self.config, self.model = config, model
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
        parts = model_parts(self.runner)
        self._named = {**named, **parts.named}
        self.pools = PoolSet(self.pool, parts.pool_members)
        self.sampler = BatchSampler(R, cfg.vocab_size, self.device)
        self.layout = BatchRows(self.runner, self.pool, R)  # rows 0..B-1: the running requests
        self.counters: dict[str, float] = {k: 0 for k in (
            "submitted", "rejected", "finished_stop", "finished_length", "finished_abort", "finished_error",
            "prompt_tokens",
            "generated_tokens", "decode_steps", "decode_s", "prefill_s", "peak_batch")}
        self.outputs = OutputProcessor(tokenizer, tuple(eos_ids), self.counters)
        row_states = RowStates([RunnerInputs(self.runner.tokens), self.layout, self.sampler])
        self.scheduler = Scheduler(R, config.max_queue, self.pools, row_states, self.lookahead, self.counters)
        self.step_kind.bind(self, parts.decode_hooks)
        row_states.participants += self.step_kind.row_states() + parts.row_states
        self.prefill = PromptPrefill(self, self.step_kind.packs_prompts and parts.packs_prompts)
        self._thread: threading.Thread | None = None
        self._stop = False
        self.last_error: str | None = None
        self.compile_s = self.runner.compile() if config.compile else None

    def __getattr__(self, name: str) -> Any:
        """The parts a family or a mode adds, by the name ``engine_parts`` reports them under
        (None where this engine has none)."""
        named = self.__dict__.get("_named")
        if named is not None and name in named:
            return named[name]
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    @property
    def tokenizer(self):
        return self.outputs.tokenizer

    @property
    def eos_ids(self) -> tuple[int, ...]:
        return self.outputs.eos_ids

    @property
    def _rows(self) -> list[Request]:
        """The running requests, row order (the scheduler's)."""
        return self.scheduler.running

    @property
    def _waiting(self):
        return self.scheduler.waiting

    @property
    def _lock(self) -> threading.Condition:
        return self.scheduler.lock

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
        self.step_kind.check(params)

    def submit(self, prompt_ids: list[int], params: SamplingParams,
               on_update: Callable[[Request, list[int], str, bool], None] | None = None) -> Request:
        """Queue a request; raises ``QueueFull`` or ``ValueError`` (see ``check``)."""
        self.check(prompt_ids, params)
        return self.scheduler.submit(prompt_ids, params, on_update)

    def abort(self, req: Request) -> None:
        """Stop ``req``; its KV blocks are freed at the next step boundary."""
        self.scheduler.abort(req)

    def load(self) -> int:
        """Requests running or waiting (an aborted one until the next step reaps it)."""
        return self.scheduler.load()

    def has_work(self) -> bool:
        return self.scheduler.has_work()

    # -- the step (one thread) --------------------------------------------------------------

    @torch.inference_mode()  # no autograd dispatch at all (the CLI's load runs in it too: ``cli._inference``)
    def step(self) -> None:
        """One scheduler iteration: reap aborts, admit, one step of the step kind, callbacks."""
        self._reap()
        self.prefill.admit()
        if self.scheduler.running:
            self.step_kind.run()
        self.outputs.dispatch()

    def _reap(self) -> None:
        for r in self.scheduler.drop_aborted_waiting():
            self.outputs.finish(r, "abort")
        running = self.scheduler.running
        if any(r._abort for r in running):
            self.step_kind.flush()
            for row in sorted((r.row for r in running if r._abort), reverse=True):
                req = running[row]
                if req.finish_reason is None:
                    self.outputs.finish(req, "abort")
                self.scheduler.remove_row(row)

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
                if not contained(e):
                    raise
                self._fail_all(e)

    def _fail_all(self, error: Exception) -> None:
        """End every request (reason "error") after an error in the batch's own step (the decode
        forward, say), freeing the pools. Errors one request causes end that request only
        (``OutputProcessor.fail``)."""
        from trainforge.log import get_logger

        get_logger().error(f"engine step failed, failing {self.load()} requests: {error!r}")
        self.last_error = repr(error)
        why = f"the engine step failed: {type(error).__name__}: {str(error)[:300]}"
        waiting = self.scheduler.drain_waiting()
        self.step_kind.discard()
        running = self.scheduler.running
        for row in range(len(running) - 1, -1, -1):
            req = running[row]
            if req.finish_reason is None:
                req.error = why
                self.outputs.finish(req, "error")
            self.scheduler.remove_row(row)
        for req in waiting:
            req.error = why
            self.outputs.finish(req, "error")
        self.outputs.dispatch()

    # -- reporting --------------------------------------------------------------------------

    @property
    def kv_pool_bytes(self) -> int:
        return self.pools.nbytes

    @property
    def kv_bytes_per_token(self) -> float:
        """Pool bytes a token of sequence takes, over every pool of the set (a pool that keeps
        one entry per several tokens counts its share)."""
        return self.pools.bytes_per_token

    def stats(self) -> dict[str, Any]:
        c = self.counters
        return {**c, "running": len(self.scheduler.running), "waiting": len(self.scheduler.waiting),
                "decode_tokens_per_s": c["generated_tokens"] / c["decode_s"] if c["decode_s"] else 0.0,
                "kv_pool": self.pool.utilisation(), "kv_pool_bytes": self.kv_pool_bytes,
                "kv_bytes_per_token": self.kv_bytes_per_token,
                "workspace_bytes": self.runner.workspace_bytes, "compile_s": self.compile_s,
                "fusions": self.fusions, "quant_kernels": self.kernels, **self.step_kind.stats()}
