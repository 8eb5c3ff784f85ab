"""2-D tensor-parallel parity worker, run by tests/parallel/test_tp2d.py under torchrun (4 ranks).

Every rank builds the same single-device reference (same seed): RMSNorm -> Linear -> SiLU ->
Linear ("mlp"), and a SwiGLU whose w1 and w3 share one gathered input ("swiglu"); then the
2 x 2 grid copy of it (parallel/tp2d). Both run forward and backward on the same input and
output cotangent; each rank compares its blocks of the output, the input gradient and the
weight gradients with the reference's, and counts the collectives the 2-D step issued (bytes
by the ring model of comm_bytes.py, per rank). "model": the debug Llama split by
``apply_tp2d`` against the same model on one process (one forward and backward).
Writes ``<out_dir>/rank<r>.json``.

usage: torchrun --nproc_per_node=4 tp2d_parity.py OUT_DIR
"""

from __future__ import annotations

import contextlib
import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.debug import CommDebugMode

from trainforge.model import FLAVORS, build_model
from trainforge.model.norm import RMSNorm
from trainforge.parallel.distributed import destroy_distributed, init_distributed
from trainforge.parallel.tensor_parallel import cross_entropy_loss, loss_context
from trainforge.parallel.tp2d import Grid2D, Linear2D, RMSNorm2D, shard_activation, summa_matmul
from trainforge.parallel.tp2d.apply import apply_tp2d

BATCH, SEQ, DIM, FFN = 4, 3, 8, 12  # q = 2 divides batch, dim and ffn


@contextlib.contextmanager
def counted_collectives(log: list[dict]):
    """Wrap the torch.distributed calls tp2d makes; record each with the bytes this rank sends."""
    real = {name: getattr(dist, name) for name in ("all_gather_single", "reduce_scatter_single", "all_reduce")}

    def record(op: str, group, elems: int, elem_bytes: int) -> None:
        p = dist.get_world_size(group)
        sent = {"all_gather_single": (p - 1) * elems,  # elems: this rank's chunk
                "reduce_scatter_single": (p - 1) * elems,  # elems: this rank's output chunk
                "all_reduce": 2 * (p - 1) / p * elems}[op] * elem_bytes
        log.append({"op": op, "group": dist.get_process_group_ranks(group), "bytes": sent})

    def all_gather_single(out, inp, group=None, async_op=False):
        record("all_gather_single", group, inp.numel(), inp.element_size())
        return real["all_gather_single"](out, inp, group=group, async_op=async_op)

    def reduce_scatter_single(out, inp, op=dist.ReduceOp.SUM, group=None, async_op=False):
        record("reduce_scatter_single", group, out.numel(), out.element_size())
        return real["reduce_scatter_single"](out, inp, op=op, group=group, async_op=async_op)

    def all_reduce(t, op=dist.ReduceOp.SUM, group=None, async_op=False):
        record("all_reduce", group, t.numel(), t.element_size())
        return real["all_reduce"](t, op=op, group=group, async_op=async_op)

    wrapped = {"all_gather_single": all_gather_single, "reduce_scatter_single": reduce_scatter_single,
               "all_reduce": all_reduce}
    for name, fn in wrapped.items():
        setattr(dist, name, fn)
    try:
        yield
    finally:
        for name, fn in real.items():
            setattr(dist, name, fn)


def weight_block(full: torch.Tensor, grid: Grid2D) -> torch.Tensor:
    """Rank (i, j)'s block of an nn.Linear weight (out, in): out block j, in block i."""
    return full.chunk(grid.q, dim=0)[grid.col].chunk(grid.q, dim=1)[grid.row]


def max_diff(got: torch.Tensor, want: torch.Tensor) -> float:
    assert got.shape == want.shape, (got.shape, want.shape)
    return (got.detach() - want.detach()).abs().max().item()


def run_case(name: str, grid: Grid2D) -> dict:
    torch.manual_seed(0)
    norm = RMSNorm(DIM, eps=1e-5)
    nn.init.uniform_(norm.weight, 0.5, 1.5)  # not all ones, so a wrong weight block shows
    w1, w2, w3 = nn.Linear(DIM, FFN, bias=False), nn.Linear(FFN, DIM, bias=False), nn.Linear(DIM, FFN, bias=False)
    x = torch.randn(BATCH, SEQ, DIM, requires_grad=True)
    cotangent = torch.randn(BATCH, SEQ, DIM)

    def reference(h):
        h = norm(h)
        return w2(F.silu(w1(h))) if name == "mlp" else w2(F.silu(w1(h)) * w3(h))

    y = reference(x)
    (y * cotangent).sum().backward()

    norm2d, l1, l2 = RMSNorm2D.from_rmsnorm(norm, grid), Linear2D.from_linear(w1, grid), Linear2D.from_linear(w2, grid)
    l3 = Linear2D.from_linear(w3, grid)
    x_ij = shard_activation(x.detach(), grid).requires_grad_()
    log: list[dict] = []
    with CommDebugMode() as comm, counted_collectives(log):
        h = norm2d(x_ij)
        if name == "mlp":
            y_ij = l2(F.silu(l1(h)))
        else:
            gate, up = summa_matmul(h, [l1.weight.to_local(), l3.weight.to_local()], grid)
            y_ij = l2(F.silu(gate) * up)
        (y_ij * shard_activation(cotangent, grid)).sum().backward()

    used = [("norm", norm, norm2d), ("w1", w1, l1), ("w2", w2, l2)] + ([("w3", w3, l3)] if name == "swiglu" else [])
    grads = {}
    for key, ref, mod in used:
        g = mod.weight.grad
        assert isinstance(g, DTensor) and g.placements == mod.weight.placements, (key, g)
        want = ref.weight.grad.chunk(grid.q)[grid.col] if key == "norm" else weight_block(ref.weight.grad, grid)
        grads[key] = max_diff(g.to_local(), want)
    return {
        "out_max": max_diff(y_ij, shard_activation(y, grid)),
        "out_scale": y.abs().max().item(),
        "x_grad_max": max_diff(x_ij.grad, shard_activation(x.grad, grid)),
        "weight_grad_max": grads,
        "collectives": log,
        "bytes_sent": sum(c["bytes"] for c in log),
        "comm_debug_count": comm.get_total_counts(),  # how many c10d collectives ran, DTensor's included
        "shape": {"tokens": BATCH * SEQ, "dim": DIM, "ffn": FFN, "q": grid.q},
    }


def run_model(tp_mesh) -> dict:
    """The debug Llama split by ``apply_tp2d`` against the same model on one process: logits,
    loss, every parameter's gradient (gathered with full_tensor), the total gradient norm, and
    how many times the 2-D forward gathered an activation over the grid row."""
    cfg = FLAVORS["debug"]
    ref, model = build_model(cfg, seed=0), build_model(cfg, seed=0)
    tokens = torch.randint(0, cfg.vocab_size, (4, 17), generator=torch.Generator().manual_seed(1))
    x, y = tokens[:, :-1], tokens[:, 1:]
    ref_logits = ref(x)
    ref_loss = cross_entropy_loss(ref_logits, y)
    ref_loss.backward()
    grid = apply_tp2d(model, tp_mesh)
    row = dist.get_process_group_ranks(grid.row_group)
    log: list[dict] = []
    with loss_context(True):
        with counted_collectives(log):
            logits = model(x)
        forward_log = list(log)
        loss = cross_entropy_loss(logits, y)
        loss.backward()
    ref_params = dict(ref.named_parameters())
    grads = {n: max_diff(p.grad.full_tensor(), ref_params[n].grad) for n, p in model.named_parameters()}
    norm = torch.nn.utils.get_total_norm([p.grad for p in model.parameters()], foreach=True).full_tensor()
    ref_norm = torch.nn.utils.get_total_norm([p.grad for p in ref.parameters()])
    return {
        "logits_shape": list(logits.shape), "logits_placements": str(logits.placements),
        "logits_max": max_diff(logits.full_tensor(), ref_logits), "loss": [loss.item(), ref_loss.item()],
        "grad_max": max(grads.values()), "worst_grad": max(grads, key=grads.get),
        "grad_norm": [norm.item(), ref_norm.item()],
        "all_dtensor": all(isinstance(p, DTensor) for p in model.parameters()),
        "forward_row_gathers": sum(c["op"] == "all_gather_single" and c["group"] == row for c in forward_log),
        "n_layers": cfg.n_layers,
    }


def main(out_dir: Path) -> None:
    info = init_distributed("cpu")
    world = init_device_mesh("cpu", (1, info.world_size), mesh_dim_names=("dp", "tp"))
    grid = Grid2D.from_tp_mesh(world["tp"])
    results = {
        "coordinate": [grid.row, grid.col],
        "row_group": dist.get_process_group_ranks(grid.row_group),
        "col_group": dist.get_process_group_ranks(grid.col_group),
        "placements": {"linear": str(Linear2D.from_linear(nn.Linear(4, 4, bias=False), grid).weight.placements),
                       "norm": str(RMSNorm2D.from_rmsnorm(RMSNorm(4, 1e-5), grid).weight.placements)},
    }
    assert (Shard(1), Shard(0)) == tuple(Linear2D.from_linear(nn.Linear(4, 4, bias=False), grid).weight.placements)
    assert (Replicate(), Shard(0)) == tuple(RMSNorm2D.from_rmsnorm(RMSNorm(4, 1e-5), grid).weight.placements)
    for name in ("mlp", "swiglu"):
        results[name] = run_case(name, grid)
    results["model"] = run_model(world["tp"])
    (out_dir / f"rank{info.rank}.json").write_text(json.dumps(results))
    destroy_distributed()


if __name__ == "__main__":
    torch.set_num_threads(1)
    main(Path(sys.argv[1]))
