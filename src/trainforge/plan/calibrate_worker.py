"""torchrun worker of ``calibration.calibrate``: the per-pass and per-step fixed costs
of one model on this CPU, plain and with every parameter a DTensor (the tensor-parallel plan
on a one-rank mesh), written as JSON. Not a command on its own:

    python -m torch.distributed.run --standalone --nproc_per_node=1 \
        -m trainforge.plan.calibrate_worker --flavor tiny --seq_len 128 --batch_sizes 2,8 --out F

Why a one-rank mesh: it runs the project's own TP plan (``apply_tensor_parallel``), so every
op goes through DTensor's dispatch, sharding propagation and redistribution bookkeeping, but
no byte crosses a link. The difference to the plain model at the same batch is DTensor's
per-op CPU cost, which a tp-way run pays on every rank (the op count does not shrink with
tp), on top of the collectives ``comm_model`` charges. FSDP2 likewise: the project's
``fully_shard`` units (each block, then the root) on a one-rank mesh run its hooks, the
copies into and out of the all-gather and reduce-scatter buffers and its DTensor bookkeeping,
which every FSDP2 rank pays beside the collectives.

Timed, one thread, best of ``--repeats`` after a warm-up (oneDNN builds kernels on first
use; a burst of someone else's load spoils some repeats, not all):

- ``pass_s[b]``: forward + loss + backward on (b, seq_len) random tokens, plain model;
- ``tp_pass_s[b]``: the same on the DTensor model;
- ``fsdp_pass_s[b]``: the same under FSDP2;
- ``opt_s`` / ``tp_opt_s``: clip (foreach, as the trainer) + fused AdamW step + zero_grad.

Launched with N > 1 processes it times only the plain passes, on every rank at once with no
communication between them (``pass_s``: the slowest rank's best): how much the model's own
mix of GEMMs, memory-bound kernels and dispatch slows when N processes share this CPU, which
a lone 1024^3 matmul rate does not show (hyper-threads share a core's caches and ports).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import time

import torch
import torch.distributed as dist


def _best_s(fn, repeats: int, setup=None) -> float:
    """Best wall seconds of ``fn()`` over ``repeats`` after one warm-up; ``setup()`` (untimed) before each."""
    best = math.inf
    for i in range(repeats + 1):
        if setup is not None:
            setup()
        t0 = time.perf_counter()
        fn()
        if i:
            best = min(best, time.perf_counter() - t0)
    return best


def _slowest(t: float) -> float:
    """The largest of every rank's ``t`` (a data-parallel step waits for its slowest rank)."""
    x = torch.tensor([t], dtype=torch.float64)
    dist.all_reduce(x, op=dist.ReduceOp.MAX)
    return float(x)


def measure(flavor: str, seq_len: int, batch_sizes: list[int], repeats: int) -> dict:
    from torch.distributed.device_mesh import init_device_mesh

    from trainforge.model import FLAVORS, build_model
    from trainforge.parallel.data_parallel import apply_fsdp
    from trainforge.parallel.dims import AXES, ParallelDims, ParallelMesh
    from trainforge.parallel.tensor_parallel import apply_tensor_parallel, cross_entropy_loss, loss_context

    cfg = dataclasses.replace(FLAVORS[flavor], max_seq_len=max(FLAVORS[flavor].max_seq_len, seq_len))
    gen = torch.Generator().manual_seed(0)
    out: dict = {"pass_s": {}, "tp_pass_s": {}, "fsdp_pass_s": {}}

    def runner(model: torch.nn.Module, lp: bool):
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)

        def pass_at(b: int):
            x = torch.randint(0, cfg.vocab_size, (b, seq_len), generator=gen)

            def once():
                with loss_context(lp):
                    cross_entropy_loss(model(x), x).backward()
            return once

        def step():
            params = [p for p in model.parameters() if p.grad is not None]
            norm = torch.nn.utils.get_total_norm([p.grad for p in params], foreach=True)
            torch.nn.utils.clip_grads_with_norm_(params, 1.0, norm, foreach=True)
            opt.step()
            opt.zero_grad(set_to_none=True)
        return pass_at, step

    plain = build_model(cfg, seed=0)
    pass_at, step = runner(plain, False)
    for b in batch_sizes:
        out["pass_s"][str(b)] = _best_s(pass_at(b), repeats)
    if dist.get_world_size() > 1:  # --concurrent: every rank timed the same passes at once; the slowest counts
        return {"pass_s": {b: _slowest(t) for b, t in out["pass_s"].items()}}
    out["opt_s"] = _best_s(step, repeats, setup=pass_at(batch_sizes[0]))  # each step on fresh gradients
    del plain

    sharded = build_model(cfg, seed=0)
    apply_tensor_parallel(sharded, init_device_mesh("cpu", (1,), mesh_dim_names=("tp",)))
    pass_at, step = runner(sharded, True)
    for b in batch_sizes:
        out["tp_pass_s"][str(b)] = _best_s(pass_at(b), repeats)
    out["tp_opt_s"] = _best_s(step, repeats, setup=pass_at(batch_sizes[0]))
    del sharded

    fsdp = build_model(cfg, seed=0)
    one = init_device_mesh("cpu", (1, 1, 1, 1), mesh_dim_names=AXES)  # the trainer's own units and options
    apply_fsdp(fsdp, ParallelMesh(one, one["dp_replicate", "dp_shard"]._flatten("dp")), ParallelDims(1, 1, 1, 1, 1))
    pass_at, _ = runner(fsdp, False)
    for b in batch_sizes:
        out["fsdp_pass_s"][str(b)] = _best_s(pass_at(b), repeats)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--flavor", required=True)
    ap.add_argument("--seq_len", type=int, required=True)
    ap.add_argument("--batch_sizes", required=True, help="comma-separated, ascending")
    ap.add_argument("--repeats", type=int, default=4)
    a = ap.parse_args()
    torch.set_num_threads(1)  # one "GPU" = one process with one thread
    dist.init_process_group("gloo")
    try:
        result = measure(a.flavor, a.seq_len, sorted(int(b) for b in a.batch_sizes.split(",")), a.repeats)
        if dist.get_rank() == 0:
            with open(a.out, "w") as fh:
                json.dump(result, fh)
        dist.barrier()  # no rank tears gloo down while another is still in a collective
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
