"""An exponential moving average of the weights (``[ema]``), as DeepSeek-V3 keeps one: in fp32,
in host memory, updated after every ``interval`` optimizer steps without blocking the next step,
saved with every checkpoint and resumed exactly. ``trainforge generate / serve / export
--weights ema`` read it (``loading/ema_weights.py``).

The update, per tensor: ``ema <- ema + (1 - decay) x (w - ema)`` (``torch._foreach_lerp_``),
on every floating parameter; buffers (a MoE router's balancing bias) are copied, not averaged:
they steer the current weights, and the average is served with the newest. The average starts
from the weights the run starts with (a resume: the checkpoint's average).

How it avoids both a stall and a race (``on_cpu = true``):

- training on the CPU: the host thread reads the live weights directly, no copy. The next
  write to them is the next optimizer step, and ``before_optimizer_step`` waits for the thread
  there, so the update overlaps the next step's forward and backward (which only read the
  weights) and can never see a half-updated tensor. The wait is almost always already over.
- training on a GPU: the weights are copied into pinned host buffers on a side stream (which
  waits for the optimizer's kernels), the host thread waits for that copy and averages from the
  buffers; the next optimizer step waits on the copy's event on the device (no host sync), and
  the next copy waits for the thread, so neither buffer is overwritten while read.

With ``on_cpu = false`` the average lives on the training device and is updated in the step.

Layouts: the sources are what the optimizer updates (``opt_parts``: the fp32 master copy when
parameters are stored low). A DTensor parameter (FSDP2, HSDP, TP) is averaged as this rank's
local shard: each rank keeps the average of what it holds and saves it in its own file
(``per_rank``: ``ema/rank_NNNNN.pt``), which resumes on the same layout. Under DDP every rank
holds the same weights, so only rank 0 keeps the average (it writes ``train_state.pt``).
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from trainforge.loading.ema_weights import STATE_KEY, WEIGHTS_KEY
from trainforge.train.component import Component


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def ema_sources(parts: list[torch.nn.Module]) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """(floating parameters, buffers) of ``parts`` by FQN, as this rank holds them (a DTensor's
    local shard), each tensor once: a tied matrix under its first name, as ``model.safetensors``
    stores it. Non-persistent buffers (rotary tables) are left out, as the checkpoint does."""
    params: dict[str, torch.Tensor] = {}
    buffers: dict[str, torch.Tensor] = {}
    seen: set[int] = set()
    for part in parts:
        param_ids = {id(p) for p in part.parameters()}
        for name, t in part.state_dict(keep_vars=True).items():
            if id(t) in seen:
                continue
            seen.add(id(t))
            local = _local(t.detach())
            if id(t) in param_ids and local.is_floating_point():
                params[name] = local
            else:
                buffers[name] = local
    return params, buffers


class EMAComponent(Component):
    """The weight average of ``parts`` (the modules the optimizer updates). ``section``: the
    ``[ema]`` section; ``device``: the training device; ``keep``: whether this rank keeps an
    average (False on DDP ranks other than 0); ``log``: a warning function or None."""

    name = STATE_KEY

    def __init__(self, section: Any, parts: list[torch.nn.Module], device: torch.device, keep: bool = True,
                 log: Callable[[str], None] | None = None):
        self.decay, self.interval, self.on_cpu = float(section.decay), int(section.interval), bool(section.on_cpu)
        self.device, self.keep, self.log = device, keep, log
        self.parts = parts
        params, buffers = ema_sources(parts)
        self.updates = 0  # averages taken since the run started (resumed with the average)
        self._pending: Future | None = None  # the host thread's update in flight
        self._copied: Any = None  # CUDA: the event of the snapshot copy the next optimizer step waits on
        self._pool: ThreadPoolExecutor | None = None
        self.weights: dict[str, torch.Tensor] = {}
        self.buffers: dict[str, torch.Tensor] = {}
        self._snapshot: dict[str, torch.Tensor] = {}
        self._stream: Any = None
        if not keep:
            self.after_optimizer_step = None  # the registry then never calls it on this rank
            return
        home = torch.device("cpu") if self.on_cpu else device
        pin = self.on_cpu and device.type == "cuda"
        self.weights = {k: self._alloc(t, home, torch.float32, pin) for k, t in params.items()}
        self.buffers = {k: self._alloc(t, home, t.dtype, pin) for k, t in buffers.items()}
        self._start_from(params, buffers)
        if self.on_cpu:
            if device.type == "cuda":  # the snapshot the thread averages from, in the weights' dtype
                self._snapshot = {k: self._alloc(t, home, t.dtype, True) for k, t in params.items()}
                self._stream = torch.cuda.Stream(device)

    @staticmethod
    def _alloc(t: torch.Tensor, device: torch.device, dtype: torch.dtype, pin: bool) -> torch.Tensor:
        return torch.empty(t.shape, dtype=dtype, device=device, pin_memory=pin)

    def _start_from(self, params: dict[str, torch.Tensor], buffers: dict[str, torch.Tensor]) -> None:
        """The average restarts at the current weights."""
        for k, t in params.items():
            self.weights[k].copy_(t)
        for k, t in buffers.items():
            self.buffers[k].copy_(t)

    # -- the update ------------------------------------------------------------------

    def wait(self) -> None:
        """Until the update in flight is done (re-raises its error). Every reader of the
        average and every writer of the weights comes through here first."""
        if self._pending is not None:
            pending, self._pending = self._pending, None
            pending.result()

    def _update(self, src: dict[str, torch.Tensor], buffers: dict[str, torch.Tensor], ready: Any = None) -> None:
        if ready is not None:
            ready.synchronize()  # the snapshot copy landed (host thread: only it waits)
        keys = list(self.weights)
        ema = [self.weights[k] for k in keys]
        new = [src[k] if src[k].dtype == torch.float32 else src[k].float() for k in keys]
        torch._foreach_lerp_(ema, new, 1.0 - self.decay)
        for k, t in buffers.items():
            self.buffers[k].copy_(t)

    def after_optimizer_step(self, loop: Any) -> None:
        if (loop.step + 1) % self.interval:  # loop.step: steps done before this one
            return
        self.updates += 1
        params, buffers = ema_sources(self.parts)
        if not self.on_cpu:
            self._update(params, buffers)
            return
        self.wait()  # the previous update (and, on CUDA, its read of the snapshot) is done
        if self._pool is None:  # one thread, from the first update to the end of fit
            self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ema")
        if self._stream is None:  # CPU training: averaged from the live weights (see the docstring)
            self._pending = self._pool.submit(self._update, params, buffers)
            return
        self._stream.wait_stream(torch.cuda.current_stream(self.device))  # after the optimizer's kernels
        with torch.cuda.stream(self._stream):
            for k, t in params.items():
                self._snapshot[k].copy_(t, non_blocking=True)
            host_buffers = {k: t.to("cpu", non_blocking=True) for k, t in buffers.items()}
            self._copied = torch.cuda.Event()
            self._copied.record(self._stream)
        self._pending = self._pool.submit(self._update, self._snapshot, host_buffers, self._copied)

    def before_optimizer_step(self, loop: Any, loss: torch.Tensor, grad_norm: torch.Tensor) -> bool:
        """The optimizer writes the weights next: the update reading them must be done."""
        if self._stream is not None:
            if self._copied is not None:
                torch.cuda.current_stream(self.device).wait_event(self._copied)  # on the device, no host sync
        elif self._pending is not None:
            self.wait()
        return True

    # -- checkpoint ------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        if not self.keep:
            return {}
        self.wait()
        if self._stream is not None:
            self._stream.synchronize()
        return {WEIGHTS_KEY: {**self.weights, **self.buffers}, "updates": self.updates, "decay": self.decay,
                "interval": self.interval}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """The saved average when it fits this run's tensors on every rank; else (saved under
        another layout) the average restarts at the loaded weights, on every rank alike, with a
        warning: never an error on some ranks only, which would leave the others waiting."""
        if not self.keep:
            return
        self.wait()
        why = _misfit(state, {**self.weights, **self.buffers})
        if self._agree(why is None):
            for k, t in {**self.weights, **self.buffers}.items():
                t.copy_(state[WEIGHTS_KEY][k])
            self.updates = int(state["updates"])
        else:
            self._restart(f"the checkpoint's weight average does not fit this run ({why or 'on another rank'}: saved "
                          "under another parallel layout?)")

    def on_missing_state(self, loop: Any, path: Path) -> None:
        """A checkpoint from before [ema] was on (or whose average this rank has no file of)."""
        if not self.keep:
            return
        self.wait()
        self._agree(False)
        self._restart(f"{path} holds no weight average for this layout ([ema] off when it was saved, or another "
                      "parallel layout)")

    def _agree(self, ok: bool) -> bool:
        """Whether every rank's saved average fits (a collective where each rank keeps its own)."""
        if not (self.per_rank and dist.is_initialized()):
            return ok
        flag = torch.tensor([1 if ok else 0], device=self.device)
        dist.all_reduce(flag, op=dist.ReduceOp.MIN)
        return bool(flag.item())

    def _restart(self, why: str) -> None:
        self._start_from(*ema_sources(self.parts))
        self.updates = 0
        if self.log is not None:
            self.log(f"{why}: the average starts again at the loaded weights")

    def on_fit_end(self, loop: Any, summary: dict[str, Any]) -> None:
        self.wait()
        if self._pool is not None:
            self._pool.shutdown()
            self._pool = None


def _misfit(state: Any, mine: dict[str, torch.Tensor]) -> str | None:
    """Why a saved component state cannot be this average, or None."""
    saved = state.get(WEIGHTS_KEY) if isinstance(state, dict) else None
    if not isinstance(saved, dict) or not isinstance(state.get("updates"), int):
        return "no weights or update count"
    if set(saved) != set(mine):
        missing, extra = sorted(set(mine) - set(saved)), sorted(set(saved) - set(mine))
        return f"other tensors: missing {missing[:3]}, unexpected {extra[:3]}"
    for k, t in mine.items():
        s = saved[k]
        if not isinstance(s, torch.Tensor) or tuple(s.shape) != tuple(t.shape):
            return f"{k} is {tuple(getattr(s, 'shape', ()))} there, {tuple(t.shape)} here"
    return None


def build_ema(section: Any, parts: list[torch.nn.Module], pp: int, log: Callable[[str], None] | None
              ) -> EMAComponent:
    """The component for this rank (``parts``: the modules the optimizer updates; ``pp``: the
    pipeline degree). Every rank keeps the average of what it holds when that differs per rank
    (DTensor shards, pipeline stages: ``per_rank`` state); with replicated parameters (one
    process, DDP) only rank 0 keeps one."""
    device = next(p.device for part in parts for p in part.parameters())
    sharded = pp > 1 or any(isinstance(p, DTensor) for part in parts for p in part.parameters())
    keep = sharded or not dist.is_initialized() or dist.get_rank() == 0
    component = EMAComponent(section, parts, device, keep=keep, log=log)
    component.per_rank = sharded and dist.is_initialized()
    return component
