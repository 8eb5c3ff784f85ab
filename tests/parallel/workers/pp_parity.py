"""PP parity worker: every schedule in one torchrun launch, each against one
single-process reference (same seed, model, global batch, AdamW).

    torchrun --nproc_per_node=2 tests/parallel/workers/pp_parity.py --out RESULT.pt [--schedules a,b]

Rank 0 writes ``{"reference": {...}, "schedules": {name: {...}}}`` with per-step losses,
final weights gathered by FQN from all ranks, and each rank's last-step timings; the
test (tests/parallel/test_pipeline.py) does the comparisons.
"""

from __future__ import annotations

import argparse

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from trainforge.model.config import ModelConfig
from trainforge.model.llama import build_model
from trainforge.parallel.distributed import destroy_distributed, init_distributed
from trainforge.parallel.pipeline import SCHEDULES, build_pipeline, cross_entropy_loss, split_model

CFG = ModelConfig(dim=64, n_layers=4, n_heads=4, n_kv_heads=2, vocab_size=256, ffn_hidden_dim=128, max_seq_len=32)
SEED, BATCH, SEQ, MICROBATCHES, LR = 0, 8, 32, 4, 3e-3


def batches(steps: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(1234)
    out = []
    for _ in range(steps):
        tok = torch.randint(0, CFG.vocab_size, (BATCH, SEQ + 1), generator=gen)
        out.append((tok[:, :-1].contiguous(), tok[:, 1:].contiguous()))  # (B, T) each
    return out


def optimizer(params) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=LR, weight_decay=0.1, foreach=False)


def reference(data) -> dict:
    model = build_model(CFG, seed=SEED)
    opt = optimizer(model.parameters())
    losses, grads = [], {}
    for x, y in data:
        loss = cross_entropy_loss(model(x), y)
        loss.backward()
        if not grads:
            grads = {k: p.grad.clone() for k, p in model.named_parameters()}
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return {"losses": losses, "grads": grads, "state": {k: v.clone() for k, v in model.state_dict().items()}}


def run_schedule(name: str, data, mesh, rank: int, world: int) -> dict:
    model = build_model(CFG, seed=SEED)
    stages = split_model(model, rank, world, None, name)
    pipe = build_pipeline(stages, mesh, rank, world, name, MICROBATCHES, cross_entropy_loss, "cpu",
                          batch_size=BATCH)
    opt = optimizer(list(pipe.parameters()))
    losses, grads = [], {}
    for x, y in data:
        loss = pipe.step(x if pipe.has_first else None, y if pipe.has_last else None)
        if not grads:  # first step's gradients, by FQN
            grads = {k: p.grad.clone() for m in stages for k, p in m.named_parameters()}
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(None if loss is None else loss.item())
    stats = pipe.last_step_stats()
    state = {}
    for m in stages:
        for k, v in m.state_dict().items():
            assert k not in state, k
            state[k] = v.detach().clone()
    mine = {"losses": losses, "state": state, "grads": grads, "stage_ids": [s.stage_index for s in pipe.stages],
            "stats": {"step_s": stats.step_s, "compute_s": stats.compute_s,
                      "bubble_fraction": stats.bubble_fraction, "stage_compute_s": stats.stage_compute_s}}
    gathered = [None] * world if rank == 0 else None
    dist.gather_object(mine, gathered, dst=0)
    if rank != 0:
        return {}
    losses = [next(r["losses"][i] for r in gathered if r["losses"][i] is not None) for i in range(len(data))]
    merged: dict[str, dict[str, torch.Tensor]] = {"state": {}, "grads": {}}
    duplicated = []
    for r in gathered:
        for what in merged:
            for k, v in r[what].items():
                if k in merged[what]:
                    duplicated.append(k)
                merged[what][k] = v
    return {"losses": losses, **merged, "duplicated": duplicated,
            "stage_ids": [r["stage_ids"] for r in gathered], "stats": [r["stats"] for r in gathered]}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--schedules", default=",".join(SCHEDULES))
    ap.add_argument("--steps", type=int, default=5)
    args = ap.parse_args()
    torch.set_num_threads(1)
    info = init_distributed("cpu")
    data = batches(args.steps)
    mesh = init_device_mesh("cpu", (info.world_size,), mesh_dim_names=("pp",))  # the pp axis alone
    result = {"schedules": {}}
    if info.rank == 0:
        result["reference"] = reference(data)
    for name in args.schedules.split(","):
        result["schedules"][name] = run_schedule(name, data, mesh, info.rank, info.world_size)
    if info.rank == 0:
        torch.save(result, args.out)
    destroy_distributed()


if __name__ == "__main__":
    main()
