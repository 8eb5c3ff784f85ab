"""Optimizer offload: fp32 master weights and AdamW state in host memory, the update on
host threads, bucket by bucket (ZeRO-Offload's scheme, in torch).

Per step (``micro_batches`` backward passes, then ``step()``):

1. as the backward produces a parameter's final gradient (the last micro-batch's
   post-accumulate-grad hook, or a DDP bucket's all-reduce), it is copied into the
   bucket's flat host buffer: on a copy thread on CPU, non-blocking on a side stream
   into pinned memory on CUDA. ``finish_backward`` (a step-layout gradient finisher)
   waits for the copies before clipping touches the device gradients. Gradients no hook
   delivered (FSDP2 shards, fp32 master copies of low-precision weights) are copied by
   the update task itself;
2. ``step()`` reads lr, betas, eps and weight decay from the param groups (schedules
   write them there), and hands each bucket to the update threads: scale the copied
   gradient by the step's clip coefficient (``set_grad_norm``: the same factor the
   device gradients got, so the same bits), run ``HostAdamW`` on the flat buffers, copy
   the fp32 master back into the parameters;
3. ``delay = 0``: ``step()`` returns when every bucket is back (AdamW on the device, to
   the bit with the same kernel). ``delay = 1``: the buckets' updates run during the next
   step's forward and backward, and land (master copied into the parameters) at the next
   ``step()``, once that backward no longer needs the old weights: the gradient of step t
   is applied after step t+1's forward. ``flush()`` lands a pending update (checkpoints).

``fraction`` < 1 keeps the first parameters (by count) on the device with a plain AdamW.
The state (``state_dict``) is torch AdamW's, keyed the same, so a checkpoint is the same
whether the state lived on the host or not. Hand-written because torch has no optimizer
offload for a DDP or single-device model (FSDP2's ``CPUOffloadPolicy`` is the other mode).
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from trainforge.train.host_adamw import HostAdamW, torch_host_adamw


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


@dataclass
class _Bucket:
    group: int                      # index into param_groups
    params: list[torch.nn.Parameter]
    offsets: list[int]              # start of each parameter in the flat buffers
    master: torch.Tensor            # (N,) fp32 host
    exp_avg: torch.Tensor
    exp_avg_sq: torch.Tensor
    grads: list[torch.Tensor]       # (N,) fp32 host, one per in-flight step (2 with delay = 1)
    steps: list[int] = field(default_factory=list)
    copied_back: Any = None         # CUDA: event after the last copy of the master to the device

    def view(self, flat: torch.Tensor, i: int) -> torch.Tensor:
        p = _local(self.params[i])
        return flat[self.offsets[i]:self.offsets[i] + p.numel()].view(p.shape)


class OffloadAdamW(torch.optim.Optimizer):
    """AdamW whose state lives on the host. Made from an existing AdamW (``from_optimizer``:
    its param groups and settings, so schedules and checkpoints see the same groups)."""

    def __init__(self, param_groups: list[dict[str, Any]], defaults: dict[str, Any], *, delay: int = 0,
                 fraction: float = 1.0, bucket_mb: float = 16.0, threads: int = 1, micro_batches: int = 1,
                 host_adamw: HostAdamW | None = None):
        super().__init__(param_groups, defaults)
        self.delay, self.micro_batches = delay, micro_batches
        params = [p for g in self.param_groups for p in g["params"]]
        device = params[0].device if params else torch.device("cpu")
        self._cuda = device.type == "cuda"
        fused = bool(self.param_groups[0].get("fused")) if self.param_groups else True
        self._host_adamw = host_adamw or torch_host_adamw("fused" if fused else "foreach")
        # The first (1 - fraction) of the parameters, by count, stay on the device.
        total, kept, on_device = sum(_local(p).numel() for p in params), 0, set()
        for p in params:
            if kept + _local(p).numel() > (1.0 - fraction) * total:
                break
            kept += _local(p).numel()
            on_device.add(p)
        self._inner: torch.optim.Optimizer | None = None
        if on_device:
            keys = ("lr", "betas", "eps", "weight_decay", "amsgrad", "maximize", "foreach", "fused",
                    "capturable", "differentiable")
            inner_groups = [{**{k: g[k] for k in keys if k in g}, "params": [p for p in g["params"] if p in on_device]}
                            for g in self.param_groups]
            self._inner = torch.optim.AdamW([g for g in inner_groups if g["params"]])
            self._inner.state = self.state  # one state dict: the checkpoint cannot tell where it lived
            self._inner_map = [i for i, g in enumerate(inner_groups) if g["params"]]
        self.buckets = self._make_buckets(on_device, bucket_mb)
        self._slot = {p: (b, i) for b in self.buckets for i, p in enumerate(b.params)}
        self._reload_masters()
        # CUDA's current device is per thread: the update threads copy to this rank's device.
        init = (lambda: torch.cuda.set_device(device)) if self._cuda else None
        self._pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="offload-update", initializer=init)
        self._copier = ThreadPoolExecutor(max_workers=1, thread_name_prefix="offload-copy")
        self._copy_futures: list[Future] = []
        self._copy_events: list[Any] = []
        self._side = torch.cuda.Stream(device) if self._cuda else None
        self._counts: dict[torch.nn.Parameter, int] = {}
        self._copied: set[torch.nn.Parameter] = set()  # raw (unclipped) gradient on the host this step
        self._clip_coef: torch.Tensor | None = None
        self._parity = 0
        self._pending: list[Future] = []
        self._pending_buckets: list[_Bucket] = []

    @classmethod
    def from_optimizer(cls, opt: torch.optim.Optimizer, **kw) -> "OffloadAdamW":
        groups = [{**{k: v for k, v in g.items() if k != "params"}, "params": list(g["params"])}
                  for g in opt.param_groups]
        return cls(groups, dict(opt.defaults), **kw)

    # -- layout ----------------------------------------------------------------------------

    def _make_buckets(self, on_device: set, bucket_mb: float) -> list[_Bucket]:
        cap = max(1, int(bucket_mb * 2**20 / 4))
        buckets, n_grads = [], 2 if self.delay else 1
        for gi, g in enumerate(self.param_groups):
            run: list[torch.nn.Parameter] = []
            for p in [p for p in g["params"] if p not in on_device] + [None]:
                if run and (p is None or sum(_local(q).numel() for q in run) + _local(p).numel() > cap):
                    buckets.append(self._bucket(gi, run, n_grads))
                    run = []
                if p is not None:
                    run.append(p)
        return buckets

    def _bucket(self, group: int, params: list[torch.nn.Parameter], n_grads: int) -> _Bucket:
        sizes = [_local(p).numel() for p in params]
        offsets = [sum(sizes[:i]) for i in range(len(sizes))]

        def buf() -> torch.Tensor:
            return torch.zeros(sum(sizes), dtype=torch.float32, pin_memory=self._cuda)

        return _Bucket(group, params, offsets, buf(), buf(), buf(), [buf() for _ in range(n_grads)],
                       steps=[0] * len(params))

    @torch.no_grad()
    def _reload_masters(self) -> None:
        """The fp32 masters from the parameters (at start and after a checkpoint loads)."""
        for b in self.buckets:
            for i, p in enumerate(b.params):
                b.view(b.master, i).copy_(_local(p))

    # -- gradient capture (offload.py wires these to the model) ------------------------------

    def offloaded_params(self) -> list[torch.nn.Parameter]:
        return list(self._slot)

    def on_param_grad(self, p: torch.nn.Parameter) -> None:
        """Post-accumulate-grad hook: copy ``p``'s gradient once it is final (last micro-batch)."""
        if p not in self._slot:
            return
        n = self._counts.get(p, 0) + 1
        self._counts[p] = n
        if n == self.micro_batches:
            self._copy_in([p], [p.grad])

    def on_reduced_bucket(self, params: list[torch.nn.Parameter], flat: torch.Tensor) -> None:
        """A DDP bucket's all-reduced gradients (``flat``: the params' gradients concatenated)."""
        offset, ready, grads = 0, [], []
        for p in params:
            n = p.numel()
            if p in self._slot:
                c = self._counts.get(p, 0) + 1
                self._counts[p] = c
                if c == self.micro_batches:
                    ready.append(p)
                    grads.append(flat[offset:offset + n].view(p.shape))
            offset += n
        if ready:
            self._copy_in(ready, grads)

    def _copy_in(self, params: list[torch.nn.Parameter], grads: list[torch.Tensor]) -> None:
        dst = [self._slot[p][0].view(self._slot[p][0].grads[self._parity], self._slot[p][1]) for p in params]
        self._copied.update(params)
        if self._cuda:
            cur = torch.cuda.current_stream()
            self._side.wait_stream(cur)
            with torch.cuda.stream(self._side):
                for d, g in zip(dst, grads):
                    d.copy_(_local(g), non_blocking=True)
                ev = torch.cuda.Event()
                ev.record()
            self._copy_events.append(ev)
        else:
            srcs = [_local(g) for g in grads]
            self._copy_futures.append(self._copier.submit(lambda: [d.copy_(s) for d, s in zip(dst, srcs)]))

    def finish_backward(self) -> None:
        """The backward is over: every copy of its gradients must be done before clipping
        scales the device gradients in place."""
        for f in self._copy_futures:
            f.result()
        self._copy_futures.clear()
        if self._cuda:
            cur = torch.cuda.current_stream()
            for ev in self._copy_events:
                cur.wait_event(ev)

    def set_grad_norm(self, norm: torch.Tensor, max_norm: float) -> None:
        """The step's pre-clip gradient norm: the copied gradients get the factor clipping
        gave the device ones (``step_layout.scale_grads_to_norm_``'s expression)."""
        # Left on the device: the update thread reads it, so the loop does not wait here.
        self._clip_coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0) if max_norm > 0 else None

    # -- the update --------------------------------------------------------------------------

    @torch.no_grad()
    def step(self, closure=None):
        if closure is not None:
            raise ValueError("OffloadAdamW.step takes no closure")
        self.finish_backward()
        if self._inner is not None:
            for gi, ig in zip(self._inner_map, self._inner.param_groups):
                ig.update({k: self.param_groups[gi][k] for k in ("lr", "betas", "eps", "weight_decay")})
            self._inner.step()
        self._land()  # delay = 1: the previous step's update, now that this backward is done
        coef, parity = self._clip_coef, self._parity
        if self._cuda:
            # Everything the update threads read from the device is copied here, on the side stream:
            # a blocking copy on an update thread would wait behind the next step's kernels.
            late = [(p, b.view(b.grads[parity], i)) for b in self.buckets for i, p in enumerate(b.params)
                    if p not in self._copied and p.grad is not None]
            self._side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(self._side):
                for p, dst in late:
                    dst.copy_(_local(p.grad), non_blocking=True)
                if coef is not None:
                    coef = torch.empty((), dtype=coef.dtype, pin_memory=True).copy_(coef, non_blocking=True)
                ready = torch.cuda.Event()
                ready.record()
            self._copy_events.append(ready)
        ev = self._copy_events[:]
        futures = []
        for b in self.buckets:
            g = self.param_groups[b.group]
            hyper = (float(g["lr"]), tuple(g["betas"]), g["eps"], g["weight_decay"])
            # (param index, device gradient the update thread copies (CPU) or None, copied raw: clip it)
            work = [(i, None if raw or self._cuda else p.grad, raw) for i, p in enumerate(b.params)
                    if (raw := p in self._copied) or p.grad is not None]
            if work:
                futures.append(self._pool.submit(self._update, b, work, parity, hyper, coef, ev, self.delay == 0))
        self._copied.clear()
        self._counts.clear()
        self._copy_events.clear()
        self._clip_coef = None
        if self.delay == 0:
            for f in futures:
                self._publish(*f.result())
        else:
            self._pending, self._pending_buckets = futures, list(self.buckets)
            self._parity ^= 1

    @torch.no_grad()  # grad mode is per thread: this runs on an update thread
    def _update(self, b: _Bucket, work: list, parity: int, hyper: tuple, coef: torch.Tensor | None,
                events: list, copy_back: bool) -> None:
        for e in [*events, b.copied_back]:
            if e is not None:
                e.synchronize()
        grads = b.grads[parity]
        for i, dev_grad, raw in work:
            if dev_grad is not None:  # final already (clipped on the device)
                b.view(grads, i).copy_(_local(dev_grad))
            elif raw and coef is not None:
                b.view(grads, i).mul_(coef)
        lr, betas, eps, wd = hyper
        idx = [i for i, _, _ in work]
        if len(idx) == len(b.params) and len(set(b.steps)) == 1:
            self._host_adamw(b.master, grads, b.exp_avg, b.exp_avg_sq, b.steps[0] + 1, lr, betas, eps, wd)
        else:  # some parameter had no gradient (skipped, as torch's AdamW skips it) or steps differ
            for i in idx:
                self._host_adamw(b.view(b.master, i), b.view(grads, i), b.view(b.exp_avg, i),
                                 b.view(b.exp_avg_sq, i), b.steps[i] + 1, lr, betas, eps, wd)
        for i in idx:
            b.steps[i] += 1
        if copy_back:
            self._copy_back(b)
        return b, idx

    def _publish(self, b: _Bucket, idx: list[int]) -> None:
        """Show the updated state in ``self.state`` (on the loop's thread: the monitor reads it)."""
        for i in idx:
            st = self.state[b.params[i]]
            if "exp_avg" not in st or st["exp_avg"].data_ptr() != b.view(b.exp_avg, i).data_ptr():
                st["exp_avg"], st["exp_avg_sq"] = b.view(b.exp_avg, i), b.view(b.exp_avg_sq, i)
                st["step"] = torch.zeros((), dtype=torch.float32)
            st["step"].fill_(b.steps[i])

    @torch.no_grad()
    def _copy_back(self, b: _Bucket) -> None:
        if self._cuda:
            with torch.cuda.stream(self._side):
                for i, p in enumerate(b.params):
                    _local(p).copy_(b.view(b.master, i), non_blocking=True)
                b.copied_back = torch.cuda.Event()
                b.copied_back.record()  # the next update of this master waits for it
            torch.cuda.current_stream().wait_stream(self._side)
        else:
            for i, p in enumerate(b.params):
                _local(p).copy_(b.view(b.master, i))

    def _land(self) -> None:
        pending, buckets = self._pending, self._pending_buckets
        self._pending, self._pending_buckets = [], []
        for f in pending:
            self._publish(*f.result())
        for b in buckets:
            self._copy_back(b)

    def flush(self) -> None:
        """Land a pending (delay = 1) update: weights and state then include every gradient."""
        self._land()

    def zero_grad(self, set_to_none: bool = True) -> None:
        # A step a component rejected leaves copied gradients behind: they are overwritten next step.
        self._copied.clear()
        self._counts.clear()
        super().zero_grad(set_to_none=set_to_none)

    # -- checkpoint: torch AdamW's state, wherever it lived ----------------------------------

    def state_dict(self) -> dict[str, Any]:
        self.flush()
        sd = super().state_dict()
        params = [p for g in self.param_groups for p in g["params"]]
        for idx, st in sd["state"].items():
            p = params[idx]
            if isinstance(p, DTensor) and p in self._slot:
                st = dict(st)
                for k in ("exp_avg", "exp_avg_sq"):
                    st[k] = DTensor.from_local(st[k], p.device_mesh, p.placements, run_check=False,
                                               shape=p.shape, stride=p.stride())
                sd["state"][idx] = st
        return sd

    @torch.no_grad()
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        for f in self._pending:  # an update from before the load (DCP's state init) must not land
            f.result()
        self._pending, self._pending_buckets = [], []
        super().load_state_dict(state_dict)
        if self._inner is not None:
            self._inner.state = self.state  # the load replaced the dict
        for b in self.buckets:
            for i, p in enumerate(b.params):
                st = self.state.get(p)
                if not st:
                    b.steps[i] = 0
                    continue
                b.view(b.exp_avg, i).copy_(_local(st["exp_avg"]))
                b.view(b.exp_avg_sq, i).copy_(_local(st["exp_avg_sq"]))
                b.steps[i] = int(_local(st["step"]).item())
                self.state[p] = {}
                self._publish(b, [i])
        self._reload_masters()  # the model loaded before its optimizer (dist_checkpoint._set_state)

    def close(self) -> None:
        self.flush()
        self._pool.shutdown()
        self._copier.shutdown()
