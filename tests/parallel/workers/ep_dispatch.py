"""Expert-parallel dispatch worker, run by tests/parallel/test_expert_parallel.py under torchrun.

Every rank builds the same ``MoE`` layer (moe-debug shape, same seed) twice: a plain
reference and a copy whose experts are split with ``apply_expert_parallel`` over all
ranks (ep = world size, edp = 1). Each rank feeds its own tokens; the expert-parallel
output and input gradient must equal the reference's on the same tokens, and the expert
weight gradients (after ``ExpertGradReducer``) must equal the reference gradients of the
mean loss over ranks. Cases: ordinary routing, and routing where every token picks the
first rank's experts (the others receive nothing). Any mismatch raises, so torchrun exits
non-zero.

usage: torchrun --nproc_per_node=2 ep_dispatch.py
"""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from trainforge.model import FLAVORS
from trainforge.model.moe import MoE
from trainforge.parallel.distributed import destroy_distributed, init_distributed
from trainforge.parallel.expert_parallel import ExpertGradReducer, apply_expert_parallel


def check(case: str, rank: int, world: int) -> None:
    cfg = FLAVORS["moe-debug"]
    torch.manual_seed(0)
    ref = MoE(cfg)
    for p in ref.parameters():
        torch.nn.init.normal_(p, std=0.2)
    if case == "one-rank":  # every token's top-k lands on experts 0 and 1 (rank 0's)
        ref.router.expert_bias[:2] = 100.0
    ep = copy.deepcopy(ref)
    mesh = init_device_mesh("cpu", (1, world), mesh_dim_names=("edp", "ep"))
    params = apply_expert_parallel(ep, mesh)
    assert len(params) == 3 and params[0].to_local().shape[0] == cfg.n_routed_experts // world

    torch.manual_seed(100 + rank)  # different tokens per rank
    x = torch.randn(2, 8, cfg.dim)
    x_ref, x_ep = x.clone().requires_grad_(), x.clone().requires_grad_()
    out_ref, out_ep = ref(x_ref), ep(x_ep)
    torch.testing.assert_close(out_ep, out_ref, atol=1e-5, rtol=1e-5, msg=f"{case}: output")
    out_ref.square().mean().backward()
    out_ep.square().mean().backward()
    ExpertGradReducer(params, mesh["edp"], dp=world)()
    torch.testing.assert_close(x_ep.grad, x_ref.grad, atol=1e-6, rtol=1e-5, msg=f"{case}: input grad")
    n = cfg.n_routed_experts // world
    for name in ("w1", "w2", "w3"):
        want = getattr(ref.experts, name).grad.clone()
        dist.all_reduce(want)  # reference: gradient of the mean loss over ranks
        want = (want / world)[rank * n:(rank + 1) * n]
        got = getattr(ep.experts, name).grad.to_local()
        torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-5, msg=f"{case}: {name} grad")
    # Non-expert parameters hold this rank's own gradient, like any data-parallel replica.
    torch.testing.assert_close(ep.router.gate.weight.grad, ref.router.gate.weight.grad, atol=1e-6, rtol=1e-5)
    with torch.no_grad():  # eval / no-grad forwards route too
        torch.testing.assert_close(ep(x), ref(x), atol=1e-5, rtol=1e-5, msg=f"{case}: no-grad output")


def main() -> None:
    info = init_distributed("cpu")
    for case in ("spread", "one-rank"):
        check(case, info.rank, info.world_size)
    destroy_distributed()


if __name__ == "__main__":
    main()
