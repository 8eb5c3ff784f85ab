"""``CpuAdamW``: torch's ``AdamW`` with its step run by the CPU AdamW kernel (``cpu_adamw.py``).

It is a ``torch.optim.AdamW`` in everything but the step: the same param groups (each group's
``lr`` and ``weight_decay`` are read at every step, so LR and weight-decay schedules act on it
as on torch's), the same per-parameter state (``step``, ``exp_avg``, ``exp_avg_sq``) and so the
same checkpoints: a run saved with it resumes on torch's AdamW and back. Moments may be kept in
bfloat16 (``moments_dtype``); a checkpoint holds them as they are, and loading casts them to
the dtype this optimizer keeps (torch's AdamW loads them as fp32, the parameters' dtype).

Plain CPU tensors only: a DTensor parameter (FSDP2, tensor parallelism) is refused by name.
"""

from __future__ import annotations

import torch

from trainforge.optim.cpu_adamw import adamw_foreach_


class CpuAdamW(torch.optim.AdamW):
    def __init__(self, params, lr: float, betas: tuple[float, float], eps: float, weight_decay: float,
                 moments_dtype: torch.dtype = torch.float32, stochastic_rounding: bool = True, seed: int = 0):
        super().__init__(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay)
        if moments_dtype not in (torch.float32, torch.bfloat16):
            raise ValueError(f"CpuAdamW keeps moments in float32 or bfloat16, not {moments_dtype}")
        self.moments_dtype = moments_dtype
        self.stochastic_rounding = stochastic_rounding
        self.seed = seed
        for group in self.param_groups:
            for p in group["params"]:
                _check_param(p)

    def _state_of(self, p: torch.Tensor) -> dict:
        state = self.state[p]
        if not state:
            state["step"] = torch.tensor(0.0, dtype=torch.float32)
            state["exp_avg"] = torch.zeros_like(p, dtype=self.moments_dtype, memory_format=torch.contiguous_format)
            state["exp_avg_sq"] = torch.zeros_like(p, dtype=self.moments_dtype, memory_format=torch.contiguous_format)
        for key in ("exp_avg", "exp_avg_sq"):  # loaded from a checkpoint of another dtype or layout
            t = state[key]
            if t.dtype != self.moments_dtype or not t.is_contiguous():
                state[key] = t.to(self.moments_dtype).contiguous()
        return state

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for gi, group in enumerate(self.param_groups):
            if group.get("amsgrad") or group.get("maximize"):
                raise ValueError("CpuAdamW runs plain AdamW: amsgrad and maximize are not supported")
            by_step: dict[int, tuple[list, list, list, list]] = {}
            for p in group["params"]:
                if p.grad is None:
                    continue
                if p.grad.is_sparse:
                    raise RuntimeError("CpuAdamW does not support sparse gradients")
                state = self._state_of(p)
                state["step"] += 1
                lists = by_step.setdefault(int(state["step"].item()), ([], [], [], []))
                for out, t in zip(lists, (p, p.grad.contiguous(), state["exp_avg"], state["exp_avg_sq"])):
                    out.append(t)
            # All parameters of a group share one step unless some skipped steps (no gradient).
            for step, (ps, gs, ms, vs) in by_step.items():
                adamw_foreach_(ps, gs, ms, vs, step=step, lr=_float(group["lr"]), betas=tuple(map(_float, group["betas"])),
                               eps=group["eps"], weight_decay=group["weight_decay"],
                               stochastic_rounding=self.stochastic_rounding, seed=self.seed + gi)
        return loss


def _float(x) -> float:
    return float(x.item()) if isinstance(x, torch.Tensor) else float(x)


def _check_param(p: torch.Tensor) -> None:
    from torch.distributed.tensor import DTensor

    if isinstance(p, DTensor):
        raise ValueError("the CPU AdamW kernel runs on plain tensors, not DTensors (FSDP2, tensor parallelism)")
    if p.device.type != "cpu" or p.dtype != torch.float32 or not p.is_contiguous():
        raise ValueError(f"the CPU AdamW kernel updates contiguous float32 CPU parameters, got a {p.dtype} tensor "
                         f"on {p.device}{'' if p.is_contiguous() else ' (not contiguous)'}")
