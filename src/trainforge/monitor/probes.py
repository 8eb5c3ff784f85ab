"""What the monitor measures inside a training step, through hooks only: the loop is
not edited, and no hook reads a value back to the host (``.item()`` waits for the
logging interval, when ``Monitor.write`` collects).

- Every step: phase timestamps from forward pre/post hooks on each model part and
  step pre/post hooks on each optimizer. On CPU a host clock; on CUDA events recorded
  on the current stream, read after the trainer's logging-interval synchronise.
- Every ``interval_steps``-th step ("sampled"): per layer group, the gradient norm (in
  the optimizer pre-step hook: after clipping), parameter norm and update/weight ratio
  (a copy of the parameters taken in the pre-step hook, compared in the post-step
  hook); with ``activation_stats``, mean/std/max |value| of each transformer block's
  output (forward hooks installed for that step only).
- Every ``profile_every``-th step: torch.profiler around the step (started in the
  first forward pre-hook, stopped in the last optimizer post-hook), moved to the next
  step while another profiler runs (the trainer's communication probe) or when the
  step is also sampled (the statistics' own ops would show in the profile).

Forwards of modules in eval mode (validation, sampling) are ignored. A step on which
no optimizer stepped (fp16 overflow) is merged into the next one's timing.
"""

from __future__ import annotations

import functools
import time
from dataclasses import dataclass, field
from functools import partial
from typing import Any, Callable

import torch
from torch import nn
from torch.distributed.tensor import DTensor

# Wrapper modules that torch.compile, activation checkpointing, FSDP1/DDP put into FQNs.
WRAPPER_NAMES = frozenset({"_orig_mod", "_checkpoint_wrapped_module", "_fsdp_wrapped_module", "module"})
DTYPE_SHORT = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16", torch.float64: "fp64"}


def layer_group(fqn: str) -> str:
    """``layers.3.attention.wq.weight`` -> ``layers.3``; ``tok_embeddings.weight`` -> ``tok_embeddings``."""
    parts = [p for p in fqn.split(".") if p not in WRAPPER_NAMES]
    if len(parts) > 2 and parts[0] == "layers":
        return f"layers.{parts[1]}"
    return parts[0] if len(parts) > 1 else fqn


def find_blocks(model_parts: list[nn.Module]) -> dict[str, nn.Module]:
    """The outermost module named ``layers.N`` (wrappers aside) of every part."""
    blocks: dict[str, nn.Module] = {}
    for part in model_parts:
        for name, mod in part.named_modules():
            parts = [p for p in name.split(".") if p not in WRAPPER_NAMES]
            if len(parts) == 2 and parts[0] == "layers" and f"layers.{parts[1]}" not in blocks:
                blocks[f"layers.{parts[1]}"] = mod
    return blocks


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def _sq_norm(tensors: list[torch.Tensor]) -> torch.Tensor | None:
    """Squared L2 norm of the full (unsharded) tensors, as a 0-dim tensor; a DTensor
    norm is completed with one collective (every rank runs the same hooks in order)."""
    if not tensors:
        return None
    norm = torch.nn.utils.get_total_norm(tensors, foreach=True)
    if isinstance(norm, DTensor):
        norm = norm.full_tensor()
    return norm.float().pow(2)


def _timed(fn):
    """Adds the host time spent in a hook to ``self.self_s`` (the monitor's own cost)."""
    @functools.wraps(fn)
    def wrapper(self, *args, **kwargs):
        t0 = time.perf_counter()
        try:
            return fn(self, *args, **kwargs)
        finally:
            self.self_s += time.perf_counter() - t0
    return wrapper


def cpu_self_us(prof) -> dict[str, float] | None:
    """CPU self time per operator name in microseconds, from the profiler's raw events:
    per thread, events nest by time, and an event's self time is its duration minus its
    direct children's. Equals ``key_averages()``'s ``self_cpu_time_total`` (checked in the
    tests) at a fraction of its cost (~70 ms vs ~1.2 s for the 8k events of a tiny-model
    step), which matters when a step is profiled every few dozen steps."""
    from torch._C._autograd import DeviceType

    try:
        events = prof.profiler.kineto_results.events()
    except AttributeError:  # another torch's internals: the caller falls back to key_averages
        return None
    by_thread: dict[int, list[tuple[int, int, str]]] = {}
    for e in events:
        if e.device_type() == DeviceType.CPU and not e.is_async():
            by_thread.setdefault(e.start_thread_id(), []).append((e.start_ns(), e.end_ns(), e.name()))
    totals: dict[str, float] = {}
    for evs in by_thread.values():
        evs.sort(key=lambda t: (t[0], -t[1]))  # parents before the children they contain
        stack: list[list] = []  # [start, end, name, children's ns]

        def pop() -> None:
            start, end, name, child = stack.pop()
            totals[name] = totals.get(name, 0.0) + (end - start - child) / 1e3

        for start, end, name in evs:
            while stack and stack[-1][1] <= start:
                pop()
            if stack:
                stack[-1][3] += end - start
            stack.append([start, end, name, 0])
        while stack:
            pop()
    return totals


class _HostClock:
    def mark(self) -> float:
        return time.perf_counter()

    def seconds(self, a: float, b: float) -> float:
        return b - a


class _CudaClock:
    def mark(self) -> torch.cuda.Event:
        ev = torch.cuda.Event(enable_timing=True)
        ev.record()
        return ev

    def seconds(self, a: torch.cuda.Event, b: torch.cuda.Event) -> float:
        b.synchronize()  # already done at the logging interval: the trainer synchronised
        return a.elapsed_time(b) / 1e3


@dataclass
class _Step:
    step: int
    start: Any
    wait_from: Any  # end of the previous step or of the monitor's last write, whichever came later
    fwd: list[list[Any]] = field(default_factory=list)  # [start, end] per forward call
    opt_start: Any = None
    opt_end: Any = None


class StepProbe:
    """Installs the hooks on ``model_parts`` and ``optimizers``; ``step_fn()`` returns the
    trainer's completed-step count (the step in progress is ``step_fn() + 1``)."""

    def __init__(self, model_parts: list[nn.Module], optimizers: list[torch.optim.Optimizer],
                 device: torch.device, step_fn: Callable[[], int], interval_steps: int = 10,
                 activation_stats: bool = False, profile_every: int = 0, top_ops: int = 10,
                 opt_parts: list[nn.Module] | None = None):
        self.device, self.step_fn = device, step_fn
        self.interval_steps, self.activation_stats = interval_steps, activation_stats
        self.profile_every, self.top_ops = profile_every, top_ops
        self.clock = _CudaClock() if device.type == "cuda" else _HostClock()
        self.optimizers = optimizers
        group_of = {id(p): layer_group(n) for part in [*model_parts, *(opt_parts or [])]
                    for n, p in part.named_parameters()}
        # Per optimizer: (params, their groups), in param_groups order.
        self._opt_params = []
        for opt in optimizers:
            params = [p for g in opt.param_groups for p in g["params"]]
            self._opt_params.append((params, [group_of.get(id(p), "other") for p in params]))
        self.precision = {}
        for part in model_parts:
            for n, p in part.named_parameters():
                self.precision.setdefault(layer_group(n), DTYPE_SHORT.get(p.dtype, str(p.dtype).split(".")[-1]))
        self.blocks = find_blocks(model_parts)
        self._handles = []
        for part in model_parts:
            self._handles.append(part.register_forward_pre_hook(self._fwd_pre))
            self._handles.append(part.register_forward_hook(self._fwd_post))
        for i, opt in enumerate(optimizers):
            self._handles.append(opt.register_step_pre_hook(partial(self._opt_pre, i)))
            self._handles.append(opt.register_step_post_hook(partial(self._opt_post, i)))
        self._cur: _Step | None = None
        self._last_end: Any = None
        self.optimizer_steps = 0
        self.last_forwards = 1  # forward calls of the last finished step (micro-batches x model parts)
        self.self_s = 0.0  # host seconds spent in these hooks
        self._done: dict[int, _Step] = {}
        # Sampled step -> {"grad": {group: sq tensor}, "param": ..., "delta": ..., "before": ...}
        self._sampled: dict[int, dict[str, dict[str, torch.Tensor]]] = {}
        self._acts: dict[int, dict[str, list[torch.Tensor]]] = {}
        self._profiles: dict[int, Any] = {}
        self._act_handles: list = []
        self._snapshot: dict[int, list[torch.Tensor]] = {}
        self._profiler = None
        self._profile_wanted = False

    # -- hooks ---------------------------------------------------------------------

    def mark_other_work(self) -> None:
        """Logging, validation or checkpointing just finished (the monitor is writing its
        record): the next step's data wait starts now, not at the last optimizer step."""
        self._last_end = self.clock.mark()

    def _is_sampled(self, step: int) -> bool:
        return self.interval_steps > 0 and step % self.interval_steps == 0

    def _begin(self) -> _Step:
        step = self.step_fn() + 1
        cur = _Step(step, self.clock.mark(), self._last_end)
        self._cur = cur
        if self._is_sampled(step):
            self._sampled[step] = {"grad": {}, "param": {}, "delta": {}, "before": {}}
            if self.activation_stats:
                acts = self._acts.setdefault(step, {})
                self._act_handles = [b.register_forward_hook(partial(self._act_hook, name, acts))
                                     for name, b in self.blocks.items()]
        if self.profile_every and (step % self.profile_every == 0 or self._profile_wanted):
            if self._is_sampled(step) and self.interval_steps > 1:
                self._profile_wanted = True  # keep the monitor's own statistics out of the profile
            else:
                self._start_profiler(step)
        return cur

    @_timed
    def _fwd_pre(self, module: nn.Module, args) -> None:
        if not module.training:
            return
        cur = self._cur or self._begin()
        cur.fwd.append([self.clock.mark(), None])

    @_timed
    def _fwd_post(self, module: nn.Module, args, output) -> None:
        if module.training and self._cur is not None and self._cur.fwd:
            self._cur.fwd[-1][1] = self.clock.mark()

    @_timed
    def _act_hook(self, name: str, acts: dict, module: nn.Module, args, output) -> None:
        if not module.training:
            return
        y = output[0] if isinstance(output, (tuple, list)) else output
        y = _local(y).detach().float()  # (B, T, D); a sequence-parallel shard under TP
        acts.setdefault(name, []).append(torch.stack([y.mean(), y.std(), y.abs().amax()]))

    @_timed
    def _opt_pre(self, i: int, opt, args, kwargs) -> None:
        cur = self._cur or self._begin()
        if cur.opt_start is None:
            cur.opt_start = self.clock.mark()
        stats = self._sampled.get(cur.step)
        if stats is None:
            return
        params, groups = self._opt_params[i]
        with torch.no_grad():
            for g in sorted(set(groups)):
                grads = [p.grad for p, pg in zip(params, groups) if pg == g and p.grad is not None]
                sq = _sq_norm(grads)
                if sq is not None:
                    stats["grad"][g] = stats["grad"].get(g, 0) + sq
            self._snapshot[i] = [p.detach().clone() for p in params]

    @_timed
    def _opt_post(self, i: int, opt, args, kwargs) -> None:
        cur = self._cur
        if cur is None:
            return
        stats = self._sampled.get(cur.step)
        if stats is not None and i in self._snapshot:
            params, groups = self._opt_params[i]
            before = self._snapshot.pop(i)
            with torch.no_grad():
                for g in sorted(set(groups)):
                    idx = [k for k, pg in enumerate(groups) if pg == g]
                    for what, tensors in (("param", [params[k].detach() for k in idx]),
                                          ("before", [before[k] for k in idx]),
                                          ("delta", [params[k].detach() - before[k] for k in idx])):
                        sq = _sq_norm(tensors)
                        if sq is not None:
                            stats[what][g] = stats[what].get(g, 0) + sq
        if i == len(self.optimizers) - 1:
            cur.opt_end = self.clock.mark()
            self._finish(cur)

    def _finish(self, cur: _Step) -> None:
        self.optimizer_steps += 1
        self.last_forwards = max(1, len(cur.fwd))
        self._done[cur.step] = cur
        self._last_end, self._cur = cur.opt_end, None
        for h in self._act_handles:
            h.remove()
        self._act_handles = []
        if self._profiler is not None:
            self._profiler.stop()
            self._profiles[cur.step] = self._profiler
            self._profiler = None
        self._prune(cur.step)

    def _start_profiler(self, step: int) -> None:
        from torch.profiler import ProfilerActivity, profile

        if torch._C._autograd._profiler_enabled():  # the communication probe is profiling this step
            self._profile_wanted = True
            return
        self._profile_wanted = False
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.device.type == "cuda" else [])
        self._profiler = profile(activities=activities)
        self._profiler.start()

    def _prune(self, step: int, keep: int = 1000) -> None:
        """Records of skipped or never-logged steps must not pile up."""
        for d in (self._done, self._sampled, self._acts, self._profiles):
            for s in [s for s in d if s < step - keep]:
                del d[s]

    # -- reading (logging interval) ---------------------------------------------------

    def timings(self, step: int) -> dict[str, float]:
        """Phase seconds of a finished step (empty if it was not measured)."""
        cur = self._done.pop(step, None)
        if cur is None or cur.opt_end is None:
            return {}
        sec = self.clock.seconds
        fwd = sum(sec(a, b) for a, b in cur.fwd if b is not None)
        to_opt = sec(cur.start, cur.opt_start)
        out = {"forward_s": fwd, "backward_s": max(0.0, to_opt - fwd), "optimizer_s": sec(cur.opt_start, cur.opt_end)}
        step_s = sec(cur.start, cur.opt_end)
        if cur.wait_from is not None:
            out["data_wait_s"] = sec(cur.wait_from, cur.start)
            step_s += out["data_wait_s"]
        out["step_s"] = step_s
        return out

    def sampled(self, step: int) -> dict[str, Any]:
        """Model statistics of a sampled step; one host sync for all of them."""
        stats, acts, prof = self._sampled.pop(step, None), self._acts.pop(step, None), self._profiles.pop(step, None)
        out: dict[str, Any] = {}
        if stats and stats["param"]:
            names, tensors = [], []
            for what in ("grad", "param", "delta", "before"):
                for g, t in stats[what].items():
                    names.append((what, g))
                    tensors.append(torch.as_tensor(t, dtype=torch.float32).reshape(()))
            values = dict(zip(names, torch.stack(tensors).tolist()))
            sq = {w: {g: v for (w2, g), v in values.items() if w2 == w} for w in ("grad", "param", "delta", "before")}
            out["grad_norm_group"] = {g: v ** 0.5 for g, v in sq["grad"].items()}
            out["param_norm_group"] = {g: v ** 0.5 for g, v in sq["param"].items()}
            out["param_norm"] = sum(sq["param"].values()) ** 0.5
            out["update_ratio_group"] = {g: (sq["delta"][g] / sq["before"][g]) ** 0.5
                                         for g in sq["delta"] if sq["before"].get(g, 0) > 0}
            total_before = sum(sq["before"].values())
            if total_before > 0:
                out["update_ratio"] = (sum(sq["delta"].values()) / total_before) ** 0.5
        if acts:
            # Per block (micro-batches, 3) -> mean of means, mean of stds, max of maxima.
            per_block = [torch.stack(v) for v in acts.values()]
            rows = torch.stack([torch.stack([t[:, 0].mean(), t[:, 1].mean(), t[:, 2].max()]) for t in per_block])
            vals = dict(zip(acts, rows.tolist()))
            out["act_mean"] = {n: v[0] for n, v in vals.items()}
            out["act_std"] = {n: v[1] for n, v in vals.items()}
            out["act_max"] = {n: v[2] for n, v in vals.items()}
        if prof is not None:
            out["top_ops"] = self._top_ops(prof)
        return out

    def _top_ops(self, prof) -> dict[str, float]:
        """Self seconds of the ``top_ops`` most expensive operators."""
        totals_us = None
        if self.device.type != "cuda":
            totals_us = cpu_self_us(prof)
        if totals_us is None:  # CUDA (device time per op needs kernel-to-op attribution), or no raw events
            on_device = self.device.type == "cuda"
            totals_us = {e.key: (e.self_device_time_total if on_device else e.self_cpu_time_total)
                         for e in prof.key_averages()}
        rows = sorted(((t, k) for k, t in totals_us.items() if t > 0 and not k.startswith("ProfilerStep")),
                      reverse=True)
        return {key: t / 1e6 for t, key in rows[: self.top_ops]}

    def close(self) -> None:
        for h in self._handles + self._act_handles:
            h.remove()
        self._handles, self._act_handles = [], []
        if self._profiler is not None:
            self._profiler.stop()
            self._profiler = None
