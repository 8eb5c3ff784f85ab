"""AdamW with decoupled weight decay on matrices only (norm gains and biases are
not decayed: decaying a gain pulls it towards 0 and hurts, per common practice).

Parameters that are DTensors on different meshes (expert parallelism's (edp, ep) mesh
beside FSDP2's) go into separate param groups with the same settings: foreach kernels
group a param group's tensors by device and dtype only, and one op cannot mix meshes."""

from __future__ import annotations

import torch
from torch import nn

from trainforge.errors import ConfigError
from trainforge.train.step_layout import by_mesh


def is_decayed(p: torch.Tensor) -> bool:
    """Whether ``optimizer.weight_decay`` applies to ``p``: matrices (and embeddings), not
    norm gains or biases. One rule for the optimizer's groups and the weight-decay schedule."""
    return p.dim() >= 2


def decayed_groups(optimizer: torch.optim.Optimizer) -> list[dict]:
    """The param groups ``optimizer.weight_decay`` applies to (decided by their parameters,
    so it holds after ``load_state_dict`` replaced the groups' hyperparameters)."""
    return [g for g in optimizer.param_groups if g["params"] and is_decayed(g["params"][0])]


def _pick_implementation(requested: str, device: torch.device, distributed: bool = False) -> dict[str, bool]:
    if requested == "fused":
        return {"fused": True}
    if requested == "foreach":
        return {"foreach": True}
    if requested == "for-loop":
        return {"foreach": False}
    # auto: the fused kernel exists for CPU and CUDA in torch >= 2.4 and is the fastest on both.
    if distributed and device.type != "cuda":
        return {"foreach": True}
    return {"fused": device.type in ("cpu", "cuda")} if device.type in ("cpu", "cuda") else {"foreach": True}


def build_optimizer(model: nn.Module, section, lr: float, device: torch.device,
                    distributed: bool = False, seed: int = 0) -> torch.optim.AdamW:
    """``section`` is the ``[optimizer]`` config section; ``lr`` the peak learning rate.
    ``distributed``: parameters are DTensors, where auto picks foreach (the fused CPU
    kernel does not take DTensors). ``seed``: the bf16 moments' stochastic rounding (cpu)."""
    groups = []
    for params in by_mesh([p for p in model.parameters() if p.requires_grad]):
        groups += [{"params": [p for p in params if is_decayed(p)], "weight_decay": section.weight_decay},
                   {"params": [p for p in params if not is_decayed(p)], "weight_decay": 0.0}]
    groups = groups[:2] + [g for g in groups[2:] if g["params"]]  # the first two always exist (as before)
    if section.implementation == "cpu":
        return _cpu_adamw(groups, section, lr, device, seed)
    return torch.optim.AdamW(groups, lr=lr, betas=(section.beta1, section.beta2), eps=section.eps,
                             **_pick_implementation(section.implementation, device, distributed))


def _cpu_adamw(groups: list[dict], section, lr: float, device: torch.device, seed: int = 0) -> torch.optim.AdamW:
    """The C++ CPU AdamW (optim/): plain CPU fp32 parameters, one process or DDP replicas."""
    from trainforge.optim.adamw_optimizer import CpuAdamW

    if device.type != "cpu":
        raise ConfigError(f"config key 'optimizer.implementation' = 'cpu' updates CPU parameters, but training runs "
                          f"on {device}; use auto (or fused) there, or training.device = cpu")
    try:
        return CpuAdamW(groups, lr=lr, betas=(section.beta1, section.beta2), eps=section.eps,
                        weight_decay=section.weight_decay, moments_dtype=getattr(torch, section.moments_dtype),
                        stochastic_rounding=section.moments_rounding == "stochastic", seed=seed)
    except ValueError as exc:
        raise ConfigError(f"config key 'optimizer.implementation' = 'cpu': {exc}; use auto with this layout "
                          "(FSDP2 / tensor parallelism keep DTensor parameters)") from None
