"""Gradient aggregation on the host (``compression.host_reduce = true``).

Data parallelism across nodes over a slow link spends most of a step waiting on the
inter-node reduction. Here each DDP bucket's gradient is copied into host memory and a
host thread runs the reduction over the ``dp_replicate`` ranks with the ``[compression]``
codecs (``GradientCompressor``, the same compressed all-reduce as on the device), on a
gloo group of its own, while the training thread computes:

- ``host_reduce_delay = 1``: the hook hands the bucket's gradient of step t to the host
  thread and returns the mean gradient of step t-1 for that bucket (waiting for it if it
  is not done yet). So the update of step t applies the mean gradient of step t-1, and
  the reduction of step t's gradients overlaps step t+1's forward and backward. The
  first step has no mean yet: it applies no update (the component rejects it, so
  weights, optimizer state and LR schedule stay put). Exactly: weights_{t+1} =
  AdamW(weights_t, mean_grad(weights_{t-1}, batch_{t-1})), tested against a loop that
  does this literally.
- ``host_reduce_delay = 0``: the hook returns a future the host thread completes; DDP
  waits for all of them at the end of the backward. Same update as the on-device
  reduction (bit for bit on CPU); only the rest of the backward overlaps. (FSDP2's hook
  is synchronous: under HSDP delay 0 waits in the hook, and nothing overlaps.)

Hierarchy: the intra-node axis stays on the device: under HSDP, FSDP2 reduce-scatters
over ``dp_shard`` as usual and its all-reduce hook hands each unit's shard of the
gradient to the host thread for the ``dp_replicate`` axis. Under DDP every rank is one
"node".

Micro-batches (``grad_accum_steps`` = k): under DDP the gradient accumulates on the
device over the first k-1 micro-batches (their hooks hand the bucket back unreduced)
and is reduced once, after the last: one inter-node reduction per step instead of k.
FSDP2 adds each micro-batch's reduced shard into the gradient after the hook, so there
every micro-batch is reduced, under its own key (``unit#2``...).

A checkpoint waits for the reduction in flight and saves its result with the
compressor's state (per rank, ``compression/rank_NNNNN.pt``), so resume is exact. A
checkpoint of the on-device path loads here (the first step then applies no update),
and this one loads there (the pending mean is dropped, with a warning).

Hand-written: torch has no asynchronous host-side reduction for DDP (its comm hooks run
on the device's process group; PowerSGD's hook is the closest and stays on the device).
"""

from __future__ import annotations

import queue
import threading
from concurrent.futures import Future
from typing import Any, Callable

import torch
import torch.distributed as dist

from trainforge.compression.compressor import PENDING_KEY, GradientCompressor


def host_process_group(dims: Any) -> dist.ProcessGroup:
    """A gloo group over this rank's ``dp_replicate`` ranks, for the host thread alone (its
    collectives must not interleave with the training thread's on the mesh's groups).
    Collective: every rank creates every replicate group, in the same order."""
    grid = torch.arange(dims.world_size).reshape(dims.pp, dims.dp_replicate, dims.dp_shard, dims.tp)
    rows = grid.permute(0, 2, 3, 1).reshape(-1, dims.dp_replicate).tolist()
    me, mine = dist.get_rank(), None
    for ranks in rows:
        group = dist.new_group(ranks, backend="gloo")
        if me in ranks:
            mine = group
    assert mine is not None
    return mine


class _Worker:
    """One daemon thread running jobs in submission order (a daemon, unlike
    ``ThreadPoolExecutor``'s, so a collective stuck on a dead peer cannot hang the exit)."""

    def __init__(self):
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name="trainforge-host-reduce", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while True:
            fn, fut = self._jobs.get()
            if fn is None:
                return
            try:
                fut.set_result(fn())
            except BaseException as e:  # noqa: BLE001 - handed to whoever waits on it
                fut.set_exception(e)

    def submit(self, fn: Callable[[], Any]) -> Future:
        fut: Future = Future()
        self._jobs.put((fn, fut))
        return fut

    def flush(self) -> None:
        """Wait until every job submitted so far has run."""
        self.submit(lambda: None).result()

    def close(self) -> None:
        self._jobs.put((None, None))


class HostReduce:
    """The ``[compression]`` reduction of DDP buckets (or FSDP2 units' shards), run by a
    host thread.

    ``inner``: a ``GradientCompressor`` over a host gloo group (``host_process_group``) on
    the CPU; ``device``: where the gradients live; ``micro_batches``: the trainer's
    ``grad_accum_steps``; ``per_micro_batch``: reduce every micro-batch (FSDP2's hooks)
    instead of accumulating on the device first (DDP's). Presents the compressor
    interface the trainer's component uses (``end_step``, ``window_stats``,
    ``state_dict``, ``load_state_dict``) plus ``update_ready()``: whether this step's
    gradients are real (False on the first step with delay 1)."""

    def __init__(self, inner: GradientCompressor, delay: int, device: torch.device, micro_batches: int = 1,
                 per_micro_batch: bool = False):
        self.inner, self.delay, self.device = inner, delay, device
        self.micro_batches, self.per_micro_batch = max(1, micro_batches), per_micro_batch
        self.bypass = False  # DDP's bucket priming: hand buckets back untouched
        self._worker = _Worker()
        self._inflight: dict[str, Future] = {}  # key -> the mean of the last gradient handed over (delay 1)
        self._calls: dict[str, int] = {}  # hook calls per key this step (micro-batches)
        self._missing = False  # some bucket had no earlier mean this step: apply no update
        self._step_stats: list[dict[str, Any]] = []  # one entry per step whose reductions finished
        self._stats_lock = threading.Lock()

    # -- the hook's side (training thread) ------------------------------------------------

    def _step_key(self, key: str) -> str | None:
        """The key of this call's reduction; None: hand the bucket back unreduced (an
        earlier micro-batch under DDP, or DDP's bucket priming)."""
        if self.bypass:
            return None
        n = self._calls.get(key, 0) + 1
        self._calls[key] = n
        if self.per_micro_batch:
            return key if n == 1 else f"{key}#{n}"
        return key if n >= self.micro_batches else None

    def _submit(self, key: str, flat: torch.Tensor) -> Future:
        # A copy in host memory: DDP refills the bucket at the next backward.
        host = flat.detach().to("cpu", copy=True)
        return self._worker.submit(lambda: self.inner.all_reduce_mean(key, host))

    def all_reduce_mean(self, key: str, flat: torch.Tensor) -> torch.Tensor:
        """delay 1: hand ``flat`` (this step's gradient) to the host thread and return the
        mean of the previous one under ``key`` (zeros if there is none). delay 0 (FSDP2's
        synchronous hook): the mean of ``flat``, waited for."""
        key = self._step_key(key)
        if key is None:
            return flat
        if self.delay == 0:
            return self._submit(key, flat).result().to(device=flat.device, dtype=flat.dtype)
        previous = self._inflight.get(key)
        self._inflight[key] = self._submit(key, flat)
        mean = previous.result() if previous is not None else None
        if mean is None or mean.shape != flat.shape:
            self._missing = True
            return torch.zeros_like(flat)
        return mean.to(device=flat.device, dtype=flat.dtype)

    def reduce_async(self, key: str, flat: torch.Tensor) -> torch.futures.Future:
        """delay 0: a future of the mean of ``flat``, completed by the host thread."""
        # A future holding device tensors must name the device.
        fut: torch.futures.Future = torch.futures.Future(devices=[flat.device] if flat.is_cuda else None)
        key = self._step_key(key)
        if key is None:
            fut.set_result(flat)
            return fut

        def done(job: Future) -> None:  # runs on the host thread
            try:
                fut.set_result(job.result().to(device=flat.device, dtype=flat.dtype))
            except BaseException as e:  # noqa: BLE001 - DDP's wait raises it in the training thread
                fut.set_exception(e)

        self._submit(key, flat).add_done_callback(done)
        return fut

    # -- the component's side -------------------------------------------------------------

    def update_ready(self) -> bool:
        return not self._missing

    def end_step(self) -> None:
        """After the optimizer step. The host thread advances the compressor's step (the
        warm-up) after this step's reductions, as the on-device path does, and keeps the
        step's wire figures."""
        self._calls.clear()
        self._missing = False

        def finish() -> None:
            self.inner.end_step()
            stats = self.inner.window_stats()
            with self._stats_lock:
                self._step_stats.append(stats)

        self._worker.submit(finish)

    def window_stats(self) -> dict[str, Any]:
        """Wire figures of the steps whose reductions finished since the last call (with
        delay 1, the window's last step is usually still in flight and counts next time)."""
        with self._stats_lock:
            done, self._step_stats = self._step_stats, []
        if not done:
            return {}
        sent = sum(s["wire_bytes_per_step"] for s in done)
        ref = sum(s["wire_bytes_per_step"] / s["wire_ratio_vs_fp32"] for s in done if s["wire_ratio_vs_fp32"])
        return {"wire_bytes_per_step": sent / len(done), "wire_ratio_vs_fp32": sent / ref if ref else 1.0,
                "compression_bits": done[-1]["compression_bits"]}

    # -- checkpoint -----------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """Waits for the reductions in flight; the means not yet applied go with the state."""
        self._worker.flush()
        state = self.inner.state_dict()
        state[PENDING_KEY] = {k: f.result().detach().clone() for k, f in self._inflight.items()}
        return state

    def load_state_dict(self, state: dict[str, Any]) -> str | None:
        """Restore; returns a warning when something had to start afresh."""
        self._worker.flush()
        warning = self.inner.load_state_dict({k: v for k, v in state.items() if k != PENDING_KEY})
        pending = state.get(PENDING_KEY) or {}
        bad = [k for k, v in pending.items() if not isinstance(v, torch.Tensor) or not v.is_floating_point()]
        if bad:
            raise ValueError(f"pending gradient {bad[0]!r:.60} is not a floating-point tensor")
        self._inflight = {}
        same_group = state.get("group_size") == self.inner.group.size()
        if self.delay == 1 and same_group:
            for key, mean in pending.items():
                fut: Future = Future()
                fut.set_result(mean.to("cpu"))
                self._inflight[key] = fut
        if self.delay == 1 and not self._inflight:
            note = ("resumed without a pending reduced gradient (saved without compression.host_reduce, or over "
                    "another number of ranks): the first step applies no update")
            return f"{warning}; {note}" if warning else note
        if pending and not self._inflight:
            note = (f"the checkpoint holds the reduced gradient of its last step, not yet applied "
                    f"(compression.host_reduce_delay = 1); with delay {self.delay} it is dropped")
            return f"{warning}; {note}" if warning else note
        return warning

    def close(self) -> None:
        self._worker.close()
