"""Automatic pipeline stage balancing: measure what each layer costs, then choose the
contiguous stage boundaries that minimise the slowest stage under a memory limit.

    costs = profile_layer_costs(model, tokens, targets)          # one process, one microbatch
    plan = plan_stages(costs, num_stages=4, memory_limit_bytes=40e9)
    stages = split_model(model, pp_rank, pp_size, plan.boundaries, schedule)

Measurement. One training step is run layer by layer: the embedding, each block, and the
head (final norm + output projection + loss) run as separate autograd pieces joined by
detached leaves, so each piece's forward and backward can be timed on its own while
the gradients are those of the real step. Over ``steps`` steps the median per piece is
kept. The embedding is then counted with block 0 and the head with the last block
(that is where ``split_model`` puts them), so a huge vocabulary shows up as a heavy last
layer. Memory per layer is its parameter bytes and the activation bytes autograd saves
for backward (seen through ``saved_tensors_hooks``, parameters excluded).

Choice. ``choose_boundaries`` is an exact dynamic programme over contiguous partitions
(O(S·N²), trivial for N in the hundreds): first the smallest achievable slowest-stage
time, then, among partitions within that bound, the one with the smallest sum of squared
stage times, so stages that do not hold the bottleneck are balanced too.

Distributed jobs: every rank must use the same boundaries; ranks that measured
separately would disagree on the split and hang. Either measure on all ranks and
``average_layer_costs`` (identical numbers everywhere, measured under the contention
training sees), or measure on one rank and ``broadcast_boundaries``.

Torchtitan and Megatron take the split by hand; this file is hand-written because no
library chooses it.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from trainforge.errors import ConfigError
from trainforge.log import get_logger
from trainforge.parallel.pipeline import cross_entropy_loss, even_boundaries


@dataclass(frozen=True)
class LayerCost:
    """One block's cost, with the embedding folded into block 0 and the head into the last."""

    time_s: float           # median forward + backward seconds for the profiled batch
    param_bytes: int
    activation_bytes: int   # saved for backward, for the profiled batch


def _sync(device: torch.device) -> None:
    if device.type != "cpu":
        torch.accelerator.synchronize(device)


def _saved_bytes_hooks(params: set[int], seen: set[int], total: list[int]):
    """Pack hook counting bytes autograd saves, once per storage, parameters excluded."""

    def pack(t: torch.Tensor):
        key = t.untyped_storage().data_ptr()
        if key not in params and key not in seen:
            seen.add(key)
            total[0] += t.untyped_storage().nbytes()
        return t

    return torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t)


def profile_layer_costs(model: nn.Module, tokens: torch.Tensor, targets: torch.Tensor,
                        loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = cross_entropy_loss,
                        steps: int = 5, warmup_steps: int = 1,
                        clock: Callable[[], float] = time.perf_counter) -> list[LayerCost]:
    """Measure each block's forward+backward time and memory on the model's device.

    tokens/targets: (B, T), one microbatch as the pipeline will see it. Runs
    ``warmup_steps + steps`` steps; gradients are left zeroed (set to None), weights
    untouched. ``clock``: wall time by default (the device is synchronised around each
    piece); ``time.thread_time`` counts only this thread's CPU work, steadier on a
    shared CPU machine when torch runs one intra-op thread."""
    device = next(model.parameters()).device
    tokens, targets = tokens.to(device), targets.to(device)
    T = tokens.shape[1]
    cos, sin = model.rope_cos[:T], model.rope_sin[:T]
    blocks = list(model.layers.values())
    pieces: list[Callable[[torch.Tensor], torch.Tensor]] = [model.tok_embeddings]
    pieces += [lambda h, b=b: b(h, cos, sin) for b in blocks]
    pieces.append(lambda h: loss_fn(model.output(model.norm(h)), targets))
    param_ptrs = {p.untyped_storage().data_ptr() for p in model.parameters()}
    samples: list[list[float]] = [[] for _ in pieces]
    act_bytes = [0] * len(pieces)
    for step in range(warmup_steps + steps):
        inputs, outputs, fwd_s = [], [], []
        h = tokens
        for i, piece in enumerate(pieces):
            x = h if i == 0 else h.detach().requires_grad_(True)
            seen, total = set(), [0]
            _sync(device)
            t0 = clock()
            with _saved_bytes_hooks(param_ptrs, seen, total):
                h = piece(x)
            _sync(device)
            fwd_s.append(clock() - t0)
            act_bytes[i] = total[0]
            inputs.append(x)
            outputs.append(h)
        grad = None
        bwd_s = [0.0] * len(pieces)
        for i in reversed(range(len(pieces))):
            _sync(device)
            t0 = clock()
            outputs[i].backward(grad)
            _sync(device)
            bwd_s[i] = clock() - t0
            grad = inputs[i].grad if i > 0 else None
        if step >= warmup_steps:
            for i in range(len(pieces)):
                samples[i].append(fwd_s[i] + bwd_s[i])
    model.zero_grad(set_to_none=True)

    times = [statistics.median(s) for s in samples]
    modules: list[list[nn.Module]] = [[model.tok_embeddings]] + [[b] for b in blocks] + [[model.norm, model.output]]
    pbytes = [sum(p.numel() * p.element_size() for m in ms for p in m.parameters()) for ms in modules]
    # Fold: embedding into block 0, head into the last block.
    costs = [LayerCost(times[i + 1], pbytes[i + 1], act_bytes[i + 1]) for i in range(len(blocks))]
    first = costs[0]
    costs[0] = LayerCost(first.time_s + times[0], first.param_bytes + pbytes[0], first.activation_bytes + act_bytes[0])
    last = costs[-1]  # re-read: with one block it is the folded costs[0]
    costs[-1] = LayerCost(last.time_s + times[-1], last.param_bytes + pbytes[-1], last.activation_bytes + act_bytes[-1])
    return costs


def stage_sums(values: Sequence[float], boundaries: Sequence[int]) -> list[float]:
    """Sum of ``values`` over each stage; boundaries[i] is stage i's first layer."""
    ends = list(boundaries[1:]) + [len(values)]
    return [float(sum(values[a:b])) for a, b in zip(boundaries, ends)]


def choose_boundaries(layer_times: Sequence[float], num_stages: int,
                      layer_memory: Sequence[float] | None = None,
                      memory_limit: float | None = None,
                      stage_memory_extra: Callable[[int, int, int], float] | None = None) -> list[int]:
    """Contiguous split of N layers into ``num_stages`` non-empty stages minimising the
    slowest stage's summed time; ties go to the smallest sum of squared stage times.

    Memory: a stage s holding layers [i, j) uses ``sum(layer_memory[i:j])`` plus
    ``stage_memory_extra(s, i, j)`` when given; every stage must stay <= ``memory_limit``.
    Returns each stage's first layer. Raises ``ConfigError`` when no split fits."""
    n = len(layer_times)
    if not 1 <= num_stages <= n:
        raise ConfigError(f"cannot split {n} layers into {num_stages} stages: every stage needs a layer "
                          "(parallel.pp x stages per rank <= model.n_layers)")
    tpre = [0.0]
    for t in layer_times:
        tpre.append(tpre[-1] + float(t))
    mpre = [0.0]
    for m in (layer_memory or [0.0] * n):
        mpre.append(mpre[-1] + float(m))

    def fits(s: int, i: int, j: int) -> bool:
        if memory_limit is None:
            return True
        extra = stage_memory_extra(s, i, j) if stage_memory_extra else 0.0
        return mpre[j] - mpre[i] + extra <= memory_limit

    def solve(score: Callable[[float, float], float], bound: float) -> tuple[float, list[int]]:
        # best[s][j]: best score for layers [0, j) in stages 0..s-1; arg keeps the cut.
        inf = math.inf
        best = [[inf] * (n + 1) for _ in range(num_stages + 1)]
        arg = [[-1] * (n + 1) for _ in range(num_stages + 1)]
        best[0][0] = 0.0
        for s in range(1, num_stages + 1):
            # Stage s-1 covers [i, j); the stages after it need >= 1 layer each.
            for j in range(s, n - (num_stages - s) + 1):
                for i in range(s - 1, j):
                    if best[s - 1][i] == inf:
                        continue
                    t = tpre[j] - tpre[i]
                    if t > bound or not fits(s - 1, i, j):
                        continue
                    v = score(best[s - 1][i], t)
                    if v < best[s][j]:
                        best[s][j], arg[s][j] = v, i
        if best[num_stages][n] == inf:
            return inf, []
        starts, j = [], n
        for s in range(num_stages, 0, -1):
            j = arg[s][j]
            starts.append(j)
        return best[num_stages][n], starts[::-1]

    slowest, _ = solve(max, math.inf)
    if slowest == math.inf:
        raise ConfigError(f"no split of {n} layers into {num_stages} stages fits the per-stage memory limit of "
                          f"{memory_limit / 2**30:.2f} GiB; raise the limit, use more stages or shard the model")
    _, starts = solve(lambda acc, t: acc + t * t, slowest * (1 + 1e-9) + 1e-12)
    return starts


@dataclass(frozen=True)
class BalancePlan:
    """Predicted per-stage seconds for the chosen split and for the even split."""

    boundaries: list[int]
    stage_times_s: list[float]
    stage_memory_bytes: list[float]
    even_boundaries: list[int]
    even_stage_times_s: list[float]

    @property
    def predicted_speedup(self) -> float:
        """Slowest even stage / slowest chosen stage (the pipeline runs at its slowest stage)."""
        return max(self.even_stage_times_s) / max(self.stage_times_s)


def plan_stages(costs: Sequence[LayerCost], num_stages: int, memory_limit_bytes: float | None = None,
                in_flight_microbatches: int | Sequence[int] = 1, param_state_factor: float = 4.0,
                log: bool = True) -> BalancePlan:
    """Choose boundaries from measured ``costs``.

    A stage's memory is ``param_state_factor`` x its parameter bytes (4: fp32 weights,
    grads and AdamW's two moments) plus its activation bytes x the microbatches it holds
    in flight (per stage, or one number for all; with 1F1B stage s holds S - s)."""
    inflight = ([int(in_flight_microbatches)] * num_stages if isinstance(in_flight_microbatches, int)
                else list(in_flight_microbatches))
    if len(inflight) != num_stages:
        raise ValueError(f"in_flight_microbatches has {len(inflight)} entries for {num_stages} stages")
    times = [c.time_s for c in costs]
    pmem = [c.param_bytes * param_state_factor for c in costs]
    act = [0.0]
    for c in costs:
        act.append(act[-1] + c.activation_bytes)

    def extra(s: int, i: int, j: int) -> float:
        return (act[j] - act[i]) * inflight[s]

    starts = choose_boundaries(times, num_stages, pmem, memory_limit_bytes, extra)
    ends = starts[1:] + [len(costs)]
    memory = [sum(pmem[i:j]) + extra(s, i, j) for s, (i, j) in enumerate(zip(starts, ends))]
    even = even_boundaries(len(costs), num_stages)
    plan = BalancePlan(starts, stage_sums(times, starts), memory, even, stage_sums(times, even))
    if log:
        ms = lambda xs: "[" + ", ".join(f"{1e3 * x:.2f}" for x in xs) + "]"  # noqa: E731
        get_logger().info("pp split even %s: predicted stage ms %s (slowest %.2f); auto %s: %s (slowest %.2f, "
                          "%.2fx)", plan.even_boundaries, ms(plan.even_stage_times_s),
                          1e3 * max(plan.even_stage_times_s), plan.boundaries, ms(plan.stage_times_s),
                          1e3 * max(plan.stage_times_s), plan.predicted_speedup)
    return plan


def should_rebalance(measured_stage_times: Sequence[float], fraction: float,
                     predicted_stage_times: Sequence[float] | None = None) -> bool:
    """True when the slowest stage has drifted more than ``fraction`` from the plan.

    Imbalance is slowest / mean stage time. Without a prediction the reference is a
    perfect balance (1.0); with one, it is the predicted imbalance, so a split that was
    never perfectly even does not trigger forever."""
    if not measured_stage_times:
        raise ValueError("should_rebalance needs at least one stage time")
    imbalance = max(measured_stage_times) / statistics.fmean(measured_stage_times)
    baseline = 1.0
    if predicted_stage_times is not None:
        if len(predicted_stage_times) != len(measured_stage_times):
            raise ValueError("measured and predicted stage times differ in length")
        baseline = max(predicted_stage_times) / statistics.fmean(predicted_stage_times)
    return imbalance > baseline * (1.0 + fraction)


def average_layer_costs(costs: Sequence[LayerCost], group: dist.ProcessGroup | None = None) -> list[LayerCost]:
    """Mean of each layer's time over the ranks of ``group`` (a collective: every rank
    calls it with its own ``costs``). Profiling on every rank at once measures under the
    contention training will see and averages out one rank's noise; every rank then
    holds identical numbers and so chooses the same split."""
    t = torch.tensor([c.time_s for c in costs], dtype=torch.float64)
    dist.all_reduce(t, group=group)
    n = dist.get_world_size(group)
    return [LayerCost(float(v) / n, c.param_bytes, c.activation_bytes) for v, c in zip(t.tolist(), costs)]


def broadcast_boundaries(boundaries: list[int] | None, group: dist.ProcessGroup | None = None,
                         src: int = 0) -> list[int]:
    """Every rank gets ``src``'s boundaries (others may pass None)."""
    box = [boundaries]
    dist.broadcast_object_list(box, src=src, group=group)
    return list(box[0])
