"""Worker (torchrun, 2 ranks, gloo): ``compression.host_reduce`` under DDP against its
plain references, on a small embedding + MLP model with several DDP buckets.

Rank 0 prints one JSON line: for each comparison the largest absolute weight
difference after ``STEPS`` steps, plus the bucket count and whether the replicas agree.

- ``delay0_int4`` vs ``device_int4``: the host thread runs the same compressed all-reduce
  on the same buckets as the on-device hook (expected: identical);
- ``delay1_fp32`` vs ``literal_lag``: a loop that applies, at step t, the fp32 mean
  gradient of step t-1 and no update at step 0, per parameter with ``all_reduce``;
- ``delay1_accum2`` vs ``literal_lag_accum2``: the same with 2 micro-batches per step;
- ``delay1_int4_resumed`` vs ``delay1_int4``: state saved after step 3 into fresh objects;
- ``delay1_fp32`` vs ``plain``: the control (an undelayed run must differ).
"""

from __future__ import annotations

import json

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from trainforge.compression.hooks import attach_to_ddp, build_compressor
from trainforge.compression.section import CompressionSection
from trainforge.parallel.dims import ParallelDims

STEPS, VOCAB, LR = 6, 32, 1e-2
DIMS = ParallelDims(pp=1, dp_replicate=2, dp_shard=1, tp=1, world_size=2)
CPU = torch.device("cpu")


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Embedding(VOCAB, 16), nn.Linear(16, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh(),
                         nn.Linear(64, VOCAB))


def batch(step: int, micro: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + 10 * micro + dist.get_rank())
    x = torch.randint(0, VOCAB, (4, 8), generator=g)
    return x, torch.roll(x, 1, dims=1)


def loss_of(model: nn.Module, step: int, micro: int) -> torch.Tensor:
    x, y = batch(step, micro)
    return nn.functional.cross_entropy(model(x).reshape(-1, VOCAB), y.reshape(-1))


def section(codec: str, host: bool, delay: int = 1) -> CompressionSection:
    return CompressionSection(codec=codec, warmup_steps=0, host_reduce=host, host_reduce_delay=delay)


def wrapped(sec: CompressionSection | None, micro: int = 1):
    """(DDP model with several buckets, its compressor or None)."""
    model = make_model()
    ddp = DistributedDataParallel(model, bucket_cap_mb=0.005)
    comp = None
    if sec is not None:
        comp = build_compressor(sec, DIMS, dist.group.WORLD, CPU, seed=0, micro_batches=micro)
        attach_to_ddp(ddp, comp, CPU)
    return ddp, comp


def train(ddp, comp, opt, steps: range, micro: int = 1) -> None:
    for t in steps:
        for m in range(micro):
            loss_of(ddp, t, m).backward()
        if comp is None or getattr(comp, "update_ready", lambda: True)():
            opt.step()
        opt.zero_grad(set_to_none=True)
        if comp is not None:
            comp.end_step()


def run(sec: CompressionSection | None, micro: int = 1) -> tuple[list[torch.Tensor], object]:
    ddp, comp = wrapped(sec, micro)
    opt = torch.optim.AdamW(ddp.parameters(), lr=LR)
    train(ddp, comp, opt, range(STEPS), micro)
    return [p.detach().clone() for p in ddp.parameters()], comp


def literal_lag(micro: int = 1) -> list[torch.Tensor]:
    """No DDP: per parameter, the fp32 mean gradient of step t-1 applied at step t."""
    model = make_model()
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    previous = None
    for t in range(STEPS):
        for m in range(micro):
            loss_of(model, t, m).backward()
        mean = []
        for p in model.parameters():
            g = p.grad.detach().clone()
            dist.all_reduce(g)
            mean.append(g / dist.get_world_size())
        if previous is not None:
            for p, g in zip(model.parameters(), previous):
                p.grad = g
            opt.step()
        opt.zero_grad(set_to_none=True)
        previous = mean
    return [p.detach().clone() for p in model.parameters()]


def resumed_int4() -> list[torch.Tensor]:
    ddp, comp = wrapped(section("int4", True))
    opt = torch.optim.AdamW(ddp.parameters(), lr=LR)
    train(ddp, comp, opt, range(3))
    weights = {k: v.clone() for k, v in ddp.module.state_dict().items()}
    opt_state, comp_state = opt.state_dict(), comp.state_dict()
    comp.close()
    ddp2, comp2 = wrapped(section("int4", True))  # fresh objects, as after a restart
    ddp2.module.load_state_dict(weights)
    opt2 = torch.optim.AdamW(ddp2.parameters(), lr=LR)
    opt2.load_state_dict(opt_state)
    assert comp2.load_state_dict(comp_state) is None
    train(ddp2, comp2, opt2, range(3, STEPS))
    return [p.detach().clone() for p in ddp2.parameters()]


def max_diff(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    return max(float((x - y).abs().max()) for x, y in zip(a, b))


def replicas_agree(ws: list[torch.Tensor]) -> bool:
    flat = torch.cat([w.reshape(-1) for w in ws])
    other = flat.clone()
    dist.broadcast(other, src=0)
    ok = torch.tensor([float(torch.equal(flat, other))])
    dist.all_reduce(ok, op=dist.ReduceOp.MIN)
    return bool(ok.item())


def main() -> None:
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    device_int4, _ = run(section("int4", False))
    delay0_int4, comp0 = run(section("int4", True, delay=0))
    delay1_fp32, comp1 = run(section("none", True))
    delay1_accum2, _ = run(section("none", True), micro=2)
    delay1_int4, _ = run(section("int4", True))
    plain, _ = run(None)
    out = {
        "buckets": len(comp1._inflight),
        "delay0_int4_vs_device_int4": max_diff(delay0_int4, device_int4),
        "delay1_fp32_vs_literal_lag": max_diff(delay1_fp32, literal_lag()),
        "delay1_accum2_vs_literal_lag_accum2": max_diff(delay1_accum2, literal_lag(micro=2)),
        "delay1_int4_resumed_vs_straight": max_diff(resumed_int4(), delay1_int4),
        "delay1_fp32_vs_plain": max_diff(delay1_fp32, plain),
        "replicas_agree": replicas_agree(delay1_int4) and replicas_agree(delay0_int4),
    }
    if dist.get_rank() == 0:
        print(json.dumps(out), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
