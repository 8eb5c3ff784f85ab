"""The engine's scheduler: the waiting queue, admission into batch rows, reservations.

``submit`` puts a request in a bounded FIFO queue (``QueueFull`` once running + waiting reach
``max_rows + max_queue``: a request submitted while a batch row is free waits only until the
next step, so it takes that row's share of the bound, not a queue place). ``take`` admits
waiting requests, FIFO, while a batch row is free and the pool set can reserve the request's
whole budget (prompt + max_new_tokens + the step kind's ``lookahead``); the head of the queue
waits for room and nothing overtakes it. Reservations make preemption unnecessary: a
running request never finds a pool empty. ``remove_row`` lets a request leave: its
reservations go back and the last row moves into its hole (``RowStates.compact``), so rows
0..B-1 stay dense.

``submit``, ``abort``, ``load`` may be called from any thread (under ``lock``); the rest runs
in the engine's thread.
"""

from __future__ import annotations

import itertools
import threading
from collections import deque
from typing import Callable

from trainforge.infer.pool_set import PoolSet
from trainforge.infer.request import Request
from trainforge.infer.row_state import RowStates
from trainforge.infer.sampling import SamplingParams


class QueueFull(RuntimeError):
    """The engine's waiting queue is at ``max_queue``."""


class Scheduler:
    """FIFO admission of requests into ``max_rows`` batch rows over ``pools``; ``counters``
    is the engine's (submitted, rejected, peak_batch)."""

    def __init__(self, max_rows: int, max_queue: int, pools: PoolSet, row_states: RowStates, lookahead: int,
                 counters: dict[str, float]):
        self.max_rows, self.max_queue = max_rows, max_queue
        self.pools, self.row_states, self.lookahead, self.counters = pools, row_states, lookahead, counters
        self.running: list[Request] = []  # rows 0..B-1, in row order
        self.waiting: deque[Request] = deque()
        self.lock = threading.Condition()
        self._ids = itertools.count()

    def budget(self, req: Request) -> int:
        """Tokens ``req`` reserves: its prompt, its max_new_tokens, and the step's lookahead."""
        return len(req.prompt_ids) + req.params.max_new_tokens + self.lookahead

    # -- any thread ---------------------------------------------------------------------------

    def submit(self, prompt_ids: list[int], params: SamplingParams,
               on_update: Callable[[Request, list[int], str, bool], None] | None) -> Request:
        cap = self.max_rows + self.max_queue
        with self.lock:
            # Counted against running + waiting, not waiting alone: between steps a burst sits in
            # the queue although batch rows are free, and counting it as queued refused requests
            # that had a row (a burst of max_batch_size + max_queue got 429s).
            if len(self.running) + len(self.waiting) >= cap:
                self.counters["rejected"] += 1
                raise QueueFull(f"{len(self.running)} requests running and {len(self.waiting)} waiting "
                                f"(max_batch_size + max_queue = {cap})")
            req = Request(next(self._ids), list(prompt_ids), params, on_update)
            self.waiting.append(req)
            self.counters["submitted"] += 1
            self.lock.notify_all()
        return req

    def abort(self, req: Request) -> None:
        with self.lock:
            if req.done.is_set():
                return
            req._abort = True
            self.lock.notify_all()

    def load(self) -> int:
        with self.lock:  # ``take`` moves requests from the queue to rows under it
            return len(self.running) + len(self.waiting)

    def has_work(self) -> bool:
        return bool(self.running or self.waiting)

    # -- the engine's thread ------------------------------------------------------------------

    def take(self, limit: int) -> list[tuple[Request, list[int]]]:
        """Move up to ``limit`` waiting requests, FIFO, into new rows while a row is free and the
        pools can reserve each one's budget; returns them with their prompts' KV slots."""
        taken: list[tuple[Request, list[int]]] = []
        while len(taken) < limit and len(self.running) < self.max_rows:
            with self.lock:
                if not self.waiting:
                    break
                req = self.waiting[0]
                total = self.budget(req)
                if not self.pools.can_reserve(total):
                    break  # FIFO: the head waits for blocks, nothing overtakes it
                self.waiting.popleft()
                row = len(self.running)  # under the lock: load() never misses a request in between
                req.row = row
                self.running.append(req)
            slots = self.pools.reserve(req.id, row, total, len(req.prompt_ids))
            self.counters["peak_batch"] = max(self.counters["peak_batch"], len(self.running))
            taken.append((req, slots))
        return taken

    def drop_aborted_waiting(self) -> list[Request]:
        """Take the aborted requests out of the queue; returns them."""
        with self.lock:
            dropped = [r for r in self.waiting if r._abort]
            for r in dropped:
                self.waiting.remove(r)
        return dropped

    def drain_waiting(self) -> list[Request]:
        """Empty the queue (the engine failed); returns what waited."""
        with self.lock:
            waiting = list(self.waiting)
            self.waiting.clear()
        return waiting

    def remove_row(self, row: int) -> None:
        """The request in ``row`` leaves: its reservations go back, the last row moves in."""
        rows = self.running
        req = rows[row]
        self.pools.free(req.id)
        req.row = None
        last = len(rows) - 1
        if row != last:
            moved = rows[last]
            rows[row] = moved
            moved.row = row
        rows.pop()
        self.row_states.compact(row, last)

    def remove_finished(self) -> None:
        """Let every running request with a finish reason leave (highest row first, so each
        move brings in a row that stays)."""
        for row in sorted((r.row for r in self.running if r.finish_reason is not None), reverse=True):
            self.remove_row(row)
