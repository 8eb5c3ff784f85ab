"""Expert parallelism: each rank holds ``E / ep`` of every MoE layer's routed experts, and
tokens travel to their experts' ranks and back with all-to-all (torchtitan / DeepSeek-V3).

Layout (``dims.py``): the ``ep`` ranks sharing one layer's experts are data-parallel ranks
too (neighbouring ranks of the flattened dp axis); ``edp = dp / ep`` groups each hold the
same experts. Expert weights ``w1, w2, w3`` of every ``GroupedExperts`` become DTensors on
the ``(edp, ep)`` mesh with placements ``(Replicate(), Shard(0))``: this rank's slice of
experts (``GroupedExperts.forward`` runs on ``.to_local()``). DCP saves them as the full
``(E, ...)`` tensors, so checkpoints load at any other ``ep`` or layout.

Dispatch wraps ``GroupedExperts`` from outside with a forward pre-hook and a forward hook
(FQNs unchanged; the model's forward stays the only definition of the math). The model
hands it ``x`` sorted by global expert and ``counts`` (E,); the hooks

1. exchange the per-expert counts (all-to-all of E integers: the only host sync, for the
   split sizes),
2. send each rank the tokens of its experts (``all_to_all_single``, uneven splits),
3. regroup the received chunks (by source rank, then expert) into local-expert order and
   run the local experts with the local counts,
4. undo the regrouping and send the results back (the inverse all-to-all).

Both exchanges are autograd functions whose backward is the opposite exchange.

Gradients: non-expert parameters are reduced by DDP / FSDP2 as before (the expert
parameters are excluded from them). An expert weight's gradient already sums the
contributions of its ``ep`` group's tokens (the all-to-all backward brings them);
``ExpertGradReducer`` then sums it over the ``edp`` ranks holding the same experts and
divides by ``dp`` (the loss is the mean over dp ranks), after backward and before
clipping. With ``[compression]`` these gradients go over ``edp`` uncompressed: the
compressor's hooks belong to DDP / FSDP2 units, and experts are excluded from those.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

from trainforge.errors import ConfigError
from trainforge.model.moe import GroupedExperts


class _AllToAll(torch.autograd.Function):
    """``dist.all_to_all_single`` along dim 0 with uneven splits; backward sends the
    gradients back the opposite way. (Gloo has no functional all-to-all with autograd.)"""

    @staticmethod
    def forward(ctx, x: torch.Tensor, out_splits: list[int], in_splits: list[int], group) -> torch.Tensor:
        ctx.out_splits, ctx.in_splits, ctx.group = out_splits, in_splits, group
        out = x.new_empty((sum(out_splits), *x.shape[1:]))
        dist.all_to_all_single(out, x.contiguous(), out_splits, in_splits, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        out = grad.new_empty((sum(ctx.in_splits), *grad.shape[1:]))
        dist.all_to_all_single(out, grad.contiguous(), ctx.in_splits, ctx.out_splits, group=ctx.group)
        return out, None, None, None


def dispatch(x: torch.Tensor, counts: torch.Tensor, group, ep: int
             ) -> tuple[torch.Tensor, torch.Tensor, tuple[list[int], list[int], torch.Tensor]]:
    """Send ``x`` (M, D), sorted by global expert with ``counts`` (E,) per expert, to the
    ranks of ``group`` owning the experts (rank r of the group: experts r*E/ep ..).
    Returns (this rank's tokens (M', D) in local-expert order, local counts (E/ep,), the
    route that ``combine`` needs)."""
    n_local = counts.numel() // ep
    recv = torch.empty_like(counts)
    dist.all_to_all_single(recv, counts.contiguous(), group=group)  # (ep x n_local): per source, my experts' counts
    send_splits, recv_splits = torch.stack([counts.view(ep, n_local).sum(1),
                                            recv.view(ep, n_local).sum(1)]).tolist()  # the one host sync
    got = _AllToAll.apply(x, recv_splits, send_splits, group)
    # Received chunks run (source 0: expert 0, 1, ..; source 1: ..): stable-sort them by
    # local expert so each expert's tokens are one slice again.
    chunk = torch.arange(ep * n_local, device=x.device).repeat_interleave(recv, output_size=got.shape[0])
    order = ((chunk % n_local) * ep + chunk // n_local).argsort(stable=True)
    return got[order], recv.view(ep, n_local).sum(0), (send_splits, recv_splits, order)


def combine(y: torch.Tensor, route: tuple[list[int], list[int], torch.Tensor], group) -> torch.Tensor:
    """Results ``y`` of ``dispatch``'s tokens (local-expert order) back to their ranks, in
    the order ``x`` had there."""
    send_splits, recv_splits, order = route
    return _AllToAll.apply(y[order.argsort()], send_splits, recv_splits, group)


class _ExpertHooks:
    """Forward pre-hook (dispatch) and forward hook (combine) on one ``GroupedExperts``."""

    def __init__(self, group, ep: int):
        self.group, self.ep = group, ep
        self._routes: list[tuple[tuple, torch.Tensor]] = []

    def pre(self, module: nn.Module, args: tuple) -> tuple:
        x, counts = args
        x_local, local_counts, route = dispatch(x, counts, self.group, self.ep)
        self._routes.append((route, x_local))
        return x_local, local_counts

    def post(self, module: nn.Module, args: tuple, y: torch.Tensor) -> torch.Tensor:
        route, x_local = self._routes.pop()
        if x_local.shape[0] == 0 and x_local.requires_grad and not y.requires_grad:
            # No tokens came: the experts return constant zeros. Keep the graph connected
            # so this rank still joins both exchanges' backward (collectives).
            y = y + x_local.sum() * 0
        return combine(y, route, self.group)


def check_expert_layout(model_config, ep: int) -> None:
    """``parallel.ep`` against the model, before any collective: it needs routed experts, and
    each rank holds the same number of them."""
    if ep > 1 and not model_config.is_moe:
        raise ConfigError(f"config key 'parallel.ep' = {ep} needs a mixture-of-experts model "
                          "(model.n_routed_experts > 0, e.g. model.flavor = moe-debug); use parallel.ep = 1")
    if ep > 1 and model_config.n_routed_experts % ep:
        raise ConfigError(f"config key 'parallel.ep' = {ep} must divide model.n_routed_experts = "
                          f"{model_config.n_routed_experts} (each rank holds the same number of experts)")


def apply_expert_parallel(model: nn.Module, experts_mesh: DeviceMesh) -> list[nn.Parameter]:
    """Shard every ``GroupedExperts`` of ``model`` over ``experts_mesh`` (2-D: ``edp``,
    ``ep``) and route its tokens through the ``ep`` group. Every rank must hold the same
    full weights (built from one seed): each keeps its slice without communication.
    Returns the expert parameters (to exclude from data parallelism)."""
    ep_mesh = experts_mesh["ep"]
    group, ep = ep_mesh.get_group(), ep_mesh.size()
    params: list[nn.Parameter] = []
    for module in model.modules():
        if not isinstance(module, GroupedExperts):
            continue
        for name, p in list(module.named_parameters(recurse=False)):
            assert p.shape[0] % ep == 0, f"{p.shape[0]} experts do not split over ep = {ep}"  # checked in dims
            local = distribute_tensor(p.detach(), experts_mesh, [Replicate(), Shard(0)], src_data_rank=None)
            param = nn.Parameter(local, requires_grad=p.requires_grad)
            module.register_parameter(name, param)
            params.append(param)
        hooks = _ExpertHooks(group, ep)
        module.register_forward_pre_hook(hooks.pre)
        module.register_forward_hook(hooks.post)
    return params


def expert_params(model: nn.Module) -> list[nn.Parameter]:
    """The expert-parallel parameters of ``model`` (DTensors of ``apply_expert_parallel``)."""
    return [p for m in model.modules() if isinstance(m, GroupedExperts)
            for p in m.parameters(recurse=False) if isinstance(p, DTensor)]


class ExpertGradReducer:
    """After backward, before clipping: each expert gradient summed over the ``edp``
    ranks holding the same experts, divided by ``dp``. One flat all-reduce per call.

    A rank whose experts received no token in the whole step gets zero gradients (so
    every rank joins the collective and the optimizer sees the same structure)."""

    def __init__(self, params: list[nn.Parameter], edp_mesh: DeviceMesh, dp: int):
        self.params, self.dp = params, dp
        self.group = edp_mesh.get_group() if edp_mesh.size() > 1 else None

    def __call__(self) -> None:
        if not self.params:
            return
        for p in self.params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        grads = [p.grad.to_local() for p in self.params]
        if self.group is not None:
            flat = torch.cat([g.reshape(-1) for g in grads])
            dist.all_reduce(flat, group=self.group)  # gloo has no AVG: sum, then divide
            torch._foreach_copy_(grads, [t.view_as(g) for t, g in zip(flat.split([g.numel() for g in grads]), grads)])
        torch._foreach_div_(grads, float(self.dp))
