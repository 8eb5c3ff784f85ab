"""Pipeline parallelism: cut the model into stages and run them with a
``torch.distributed.pipelining`` schedule.

    stages = split_model(model, pp_rank, pp_size, boundaries, "1f1b")   # this rank's stage modules
    pipe = build_pipeline(stages, mesh["pp"], pp_rank, pp_size, "1f1b", microbatches=8,
                          loss_fn=cross_entropy_loss, device=device, batch_size=32)
    loss = pipe.step(tokens, targets)     # mean loss on the rank holding the last stage, else None
    pipe.last_step_stats()                # step / compute seconds and bubble fraction of this rank

Stages. A stage is a deep copy of the model that keeps only its blocks (the others are
deleted from the ``layers`` ModuleDict, so FQNs such as ``layers.5.attention.wq.weight``
stay those of the full model and checkpoints need no renaming). The first stage keeps
``tok_embeddings``, the last keeps ``norm`` and ``output``; elsewhere they are None and the
model passes hidden states (B, T, dim) through. ``boundaries[i]`` is the first layer of
stage i (``boundaries[0] == 0``); None splits the layers evenly, and
``trainforge.parallel.stage_balance`` chooses them from measured layer costs.

Modules outside the blocks. Where the model's other modules go (an extra module on the last
stage, a copy of the embedding there, modules that belong with a block) is data the model
declares (``model/pipeline_plans.py``: ``stage_plan``), which ``split_model`` and
``build_pipeline`` apply: the last stage's module may take call arguments and return
(logits, extra), which ``loss_fn`` then receives; a module on two stages has its gradients
summed after each backward (``shared_embedding.py``). Every schedule's backward reaches the
parameters used only in the loss: they are the stage module's own, and for the split
backward (zbv, dualpipev) each of them must meet the stage's input on its way to the loss
(``model/pipeline_plans.split_backward_refusal`` says which models cannot).

Schedules and the stages each rank owns (S = total stages, p = pp_size):

=================  ===========================  ===================================
name               torch class                  stages of rank r
=================  ===========================  ===================================
gpipe              ScheduleGPipe                [r]                      (S = p)
1f1b               Schedule1F1B                 [r]                      (S = p)
interleaved-1f1b   ScheduleInterleaved1F1B      [r, r+p, r+2p, ...]      (loop, S = v*p, v >= 2)
zbv                ScheduleZBVZeroBubble        [r, 2p-1-r]              (V shape, S = 2p)
dualpipev          ScheduleDualPipeV            [r, 2p-1-r]              (V shape, S = 2p)
=================  ===========================  ===================================

Loss. Each microbatch's loss is a mean, divided here by the number of microbatches
before backward, so with equal microbatches the gradients and the returned sum equal
single-process mean cross-entropy over the batch. The schedule's own ``scale_grads`` is
off: it divides every ``.grad`` after each ``step``, which also shrinks what earlier steps
of a gradient accumulation left there (``training.grad_accum_steps`` > 1 gave ~20% wrong
gradients).

Measurement. Each stage's forward, backward and weight-backward calls (and the loss on
the last stage) are timed; ``bubble_fraction = 1 - compute_s / step_s`` per rank, so it
counts waiting for peers and the send/recv themselves as idle. On CUDA the timers are
events read only when ``last_step_stats()`` is called (no host sync in ``step``). The
first step also holds the schedule's one-off shape inference (an extra forward and
input-backward per stage, mostly counted as bubble), so leave it out of averages.

Hand-written here: only the stage cut, the rank-to-stage layout, config validation and
the timers; scheduling and point-to-point communication are torch's.
"""

from __future__ import annotations

import copy
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from trainforge.errors import ConfigError
from trainforge.model.pipeline_plans import StagePlan, split_backward_refusal, stage_plan

if TYPE_CHECKING:
    from trainforge.parallel.pipeline_stage import TimedStage

# Schedule name -> torch.distributed.pipelining class name. By name: importing pipelining
# imports torch._dynamo (~1 s per process), which runs without a pipeline never need.
SCHEDULES = {
    "gpipe": "ScheduleGPipe",
    "1f1b": "Schedule1F1B",
    "interleaved-1f1b": "ScheduleInterleaved1F1B",
    "zbv": "ScheduleZBVZeroBubble",
    "dualpipev": "ScheduleDualPipeV",
}
V_SCHEDULES = frozenset({"zbv", "dualpipev"})
MULTI_STAGE_SCHEDULES = frozenset({"interleaved-1f1b"}) | V_SCHEDULES


def cross_entropy_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean token cross-entropy. logits (B, T, V), targets (B, T) int64."""
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())


# ---------------------------------------------------------------- layout and validation


def stages_per_rank(schedule: str, pp_size: int, boundaries: Sequence[int] | None = None) -> int:
    """Stages each rank holds: 1 for gpipe/1f1b, 2 for zbv/dualpipev; for interleaved-1f1b
    ``len(boundaries) / pp_size`` when boundaries are given, else 2."""
    _check_schedule(schedule)
    if schedule not in MULTI_STAGE_SCHEDULES:
        return 1
    if schedule in V_SCHEDULES or boundaries is None:
        return 2
    return max(1, len(boundaries) // pp_size)


def stage_ids_for_rank(pp_rank: int, pp_size: int, schedule: str, num_stages: int) -> list[int]:
    """The (global) stage indices rank ``pp_rank`` owns, ascending: loop for interleaved,
    V for zbv/dualpipev (rank 0 holds the first and the last stage). Must match torch's
    ``generate_stage_to_rank_mapping`` for the schedule, which the schedule uses to route."""
    if schedule in V_SCHEDULES:
        return sorted({pp_rank, num_stages - 1 - pp_rank})
    return list(range(pp_rank, num_stages, pp_size))


def even_boundaries(n_layers: int, num_stages: int) -> list[int]:
    """First layer of each stage for an even split; the first ``n_layers % num_stages``
    stages take one extra layer. even_boundaries(10, 4) == [0, 3, 6, 8]."""
    base, extra = divmod(n_layers, num_stages)
    starts, at = [], 0
    for s in range(num_stages):
        starts.append(at)
        at += base + (s < extra)
    return starts


def _check_schedule(schedule: str) -> None:
    if schedule not in SCHEDULES:
        raise ConfigError(f"config key 'parallel.pp_schedule' = {schedule!r} is not a pipeline schedule; "
                          f"choose one of {sorted(SCHEDULES)}")


def check_pipeline_config(n_layers: int, pp_size: int, schedule: str, microbatches: int | None = None,
                          boundaries: Sequence[int] | None = None, batch_size: int | None = None,
                          tie_embeddings: bool = False, split_backward_refusal: str | None = None) -> int:
    """Validate a pipeline layout before any collective; returns the total number of
    stages. Every rank runs the same checks on the same config, so all fail alike.

    ``split_backward_refusal``: why the model cannot run a split-backward schedule over
    several stages (``model/pipeline_plans.split_backward_refusal``), or None.

    Raises ``ConfigError`` naming the key to change."""
    _check_schedule(schedule)
    if pp_size < 1:
        raise ConfigError(f"config key 'parallel.pp' = {pp_size}: must be >= 1")
    if pp_size > n_layers:
        raise ConfigError(f"config key 'parallel.pp' = {pp_size} exceeds model.n_layers = {n_layers}: "
                          "every stage needs at least one block")
    if tie_embeddings and pp_size > 1:
        raise ConfigError("config key 'model.tie_embeddings' = true cannot be pipelined: the embedding and the "
                          "output projection live on different stages; set it to false or parallel.pp = 1")
    if split_backward_refusal and schedule in V_SCHEDULES and pp_size > 1:
        raise ConfigError(f"config key 'parallel.pp_schedule' = {schedule!r} splits the backward into input and "
                          f"weight passes, which {split_backward_refusal}")
    v = stages_per_rank(schedule, pp_size, boundaries)
    num_stages = v * pp_size
    if boundaries is not None:
        b = list(boundaries)
        if len(b) != num_stages or (schedule == "interleaved-1f1b" and v < 2):
            want = (f"{num_stages}" if schedule != "interleaved-1f1b"
                    else f"a multiple of parallel.pp = {pp_size}, at least {2 * pp_size}")
            raise ConfigError(f"config key 'parallel.pp_split' has {len(b)} stage starts, but schedule "
                              f"{schedule!r} with parallel.pp = {pp_size} needs {want}")
        if b[0] != 0 or any(x >= y for x, y in zip(b, b[1:])) or b[-1] >= n_layers:
            raise ConfigError(f"config key 'parallel.pp_split' = {b}: stage starts must begin at 0, increase "
                              f"strictly and stay below model.n_layers = {n_layers}")
    if num_stages > n_layers:
        raise ConfigError(f"config key 'parallel.pp_schedule' = {schedule!r} runs {v} stages per rank, "
                          f"{num_stages} in all with parallel.pp = {pp_size}, but model.n_layers = {n_layers}: "
                          "every stage needs at least one block; use fewer stages or a single-stage schedule")
    if microbatches is not None:
        _check_microbatches(schedule, microbatches, pp_size, num_stages)
        if batch_size is not None and batch_size % microbatches:
            raise ConfigError(f"config key 'parallel.microbatches' = {microbatches} must divide "
                              f"training.batch_size = {batch_size} (equal microbatches keep the loss a plain mean)")
    return num_stages


def _check_microbatches(schedule: str, m: int, pp_size: int, num_stages: int) -> None:
    key = f"config key 'parallel.microbatches' = {m}"
    if m < 1:
        raise ConfigError(f"{key}: must be >= 1")
    # The floors are the schedules' own (torch 2.13): 1F1B needs a microbatch in flight
    # per stage, DualPipeV one per virtual stage; GPipe, interleaved 1F1B and ZBV run
    # with any count (interleaved only needs whole rounds, below).
    need = {"1f1b": num_stages, "dualpipev": num_stages}.get(schedule, 1)
    if m < need:
        raise ConfigError(f"{key}: schedule {schedule!r} with {num_stages} stages on {pp_size} ranks needs "
                          f">= {need} microbatches")
    if schedule == "interleaved-1f1b":
        rounds = max(1, m // pp_size)
        if m % rounds:
            raise ConfigError(f"{key}: interleaved-1f1b runs {rounds} rounds of microbatches here and needs "
                              f"whole rounds; use a multiple of parallel.pp = {pp_size}")


def check_stage_starts(model_config, starts: Sequence[int], pp_size: int) -> None:
    """Refuse stage starts inside a span of blocks the model needs on one stage
    (``model_config.pipeline_spans``: model/config.py says which and why). A
    stage may begin at a span's first block or right after its last."""
    spans = tuple(getattr(model_config, "pipeline_spans", ()))
    cut = [s for s in starts if any(a < s < b for a, b in spans)]
    if cut:
        allowed = [i for i in range(1, model_config.n_layers) if not any(a < i < b for a, b in spans)]
        raise ConfigError(f"config key 'parallel.pp_split' = {','.join(map(str, starts))} (parallel.pp = {pp_size}) "
                          f"starts a stage at block(s) {cut}, inside a span of blocks that must run on one stage, "
                          f"set by {model_config.pipeline_spans_source} (blocks [first, last): {list(spans)}): "
                          f"start stages only at 0 and {allowed or 'nowhere else (use parallel.pp = 1)'}")


# ---------------------------------------------------------------- splitting


def split_model(model: nn.Module, pp_rank: int, pp_size: int, boundaries: Sequence[int] | None,
                schedule: str) -> list[nn.Module]:
    """This rank's stage modules, in ascending stage order.

    ``model`` (a ``Transformer``, on any device including meta) is not mutated; each
    stage is a deep copy holding only its own blocks, so unowned parameters are never
    copied. Returns 1 module for gpipe/1f1b, 2 for zbv/dualpipev and
    ``len(boundaries) // pp_size`` (default 2) for interleaved-1f1b."""
    cfg = model.cfg
    num_stages = check_pipeline_config(cfg.n_layers, pp_size, schedule, boundaries=boundaries,
                                       tie_embeddings=cfg.tie_embeddings,
                                       split_backward_refusal=split_backward_refusal(cfg))
    if not 0 <= pp_rank < pp_size:
        raise ConfigError(f"pipeline rank {pp_rank} is outside parallel.pp = {pp_size}")
    starts = list(boundaries) if boundaries is not None else even_boundaries(cfg.n_layers, num_stages)
    check_stage_starts(cfg, starts, pp_size)
    ends = starts[1:] + [cfg.n_layers]
    return [_stage_module(model, starts[s], ends[s], s == 0, s == num_stages - 1)
            for s in stage_ids_for_rank(pp_rank, pp_size, schedule, num_stages)]


def _stage_module(model: nn.Module, start: int, end: int, first: bool, last: bool) -> nn.Module:
    # Seeding deepcopy's memo with None for every unowned submodule skips copying it
    # (and its parameters); the None placeholders are then removed or kept as "absent".
    plan = stage_plan(model.cfg)
    memo: dict[int, object] = {}
    drop = [m for k, m in model.layers.items() if not start <= int(k) < end]
    drop += [model.get_submodule(n) for n in plan.first if not (first or (last and n in plan.shared))]
    drop += [] if last else [model.get_submodule(n) for n in plan.last]
    foreign = [p for block, paths in plan.with_block if not start <= block < end for p in paths]
    drop += [model.get_submodule(p) for p in foreign]
    for m in drop:
        memo[id(m)] = None
    stage = copy.deepcopy(model, memo)
    for k in [k for k in stage.layers.keys() if not start <= int(k) < end]:
        del stage.layers[k]
    for path in foreign:  # a ModuleDict entry: removed, so its FQNs leave the stage's state dict
        parent, _, key = path.rpartition(".")
        del stage.get_submodule(parent)[key]
    for name in [] if last else plan.emptied:
        setattr(stage, name, nn.ModuleDict())  # held empty, as in a model without them
    return stage


# ---------------------------------------------------------------- timing


class _Timer:
    """Accumulates compute intervals. CPU: perf_counter. CUDA: events, read lazily."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.reset()

    def reset(self) -> None:
        self.seconds: dict[int, float] = {}
        self.cpu_seconds: dict[int, float] = {}
        self.events: dict[int, list[tuple[torch.cuda.Event, torch.cuda.Event]]] = {}

    def run(self, key: int, fn: Callable, *args, **kwargs):
        if self.cuda:
            begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            begin.record()
            out = fn(*args, **kwargs)
            end.record()
            self.events.setdefault(key, []).append((begin, end))
            return out
        t0, c0 = time.perf_counter(), time.thread_time()
        out = fn(*args, **kwargs)
        self.seconds[key] = self.seconds.get(key, 0.0) + time.perf_counter() - t0
        self.cpu_seconds[key] = self.cpu_seconds.get(key, 0.0) + time.thread_time() - c0
        return out

    def totals(self) -> dict[int, float]:
        if self.cuda:
            torch.cuda.synchronize()
            return {k: sum(b.elapsed_time(e) for b, e in v) / 1e3 for k, v in self.events.items()}
        return dict(self.seconds)

    def cpu_totals(self) -> dict[int, float]:
        return dict(self.cpu_seconds)


@dataclass(frozen=True)
class PipelineStepStats:
    """One rank's view of its last step. ``stage_compute_s`` maps stage index to the wall
    time its forward/backward (and, on the last stage, loss) calls took.

    ``stage_cpu_s`` (CPU devices only, else empty) is the CPU time of the calling thread
    in those same calls: the stage's own work, without the time spent waiting for a core
    that other processes hold (a VM's stolen time still counts). Exact with one intra-op
    thread; it undercounts with more."""

    step_s: float
    compute_s: float
    stage_compute_s: dict[int, float]
    stage_cpu_s: dict[int, float] = field(default_factory=dict)

    @property
    def bubble_fraction(self) -> float:
        return max(0.0, 1.0 - self.compute_s / self.step_s) if self.step_s > 0 else 0.0


# ---------------------------------------------------------------- running


class Pipeline:
    """Runs one training step through the pipeline schedule. Holds this rank's stage
    modules (give ``pipeline.stage_modules``' parameters to the optimizer)."""

    def __init__(self, schedule, stages: list[TimedStage], stage_modules: list[nn.Module],
                 timer: _Timer, schedule_name: str, microbatches: int, batch_size: int | None):
        self.schedule = schedule
        self.stages = stages
        self.stage_modules = stage_modules
        self.schedule_name = schedule_name
        self.microbatches = microbatches
        self.batch_size = batch_size
        self.has_first = any(s.is_first for s in stages)
        self.has_last = any(s.is_last for s in stages)
        # The last stage's module where this rank holds it (a loss may run its extra modules), else None.
        self.last_stage_module = next((m for s, m in zip(stages, stage_modules) if s.is_last), None)
        self._timer = timer
        self._step_timer = _Timer(stages[0].device)
        self._stepped = False

    def parameters(self):
        for m in self.stage_modules:
            yield from m.parameters()

    def step(self, inputs: torch.Tensor | None, targets: torch.Tensor | None) -> torch.Tensor | None:
        """One forward+backward over the global batch; gradients accumulate in the stage
        modules' ``.grad`` (call ``zero_grad`` between steps as usual).

        inputs: (B, T) token ids, needed where the first stage lives; targets: (B, T),
        needed where the last stage lives (other ranks may pass None). Returns the mean
        loss (a detached 0-d tensor) on the rank holding the last stage, else None."""
        for name, t, needed in (("inputs", inputs, self.has_first), ("targets", targets, self.has_last)):
            if needed and t is None:
                raise ValueError(f"pipeline step: this rank holds the {'first' if name == 'inputs' else 'last'} "
                                 f"stage and needs {name}")
            if needed and t.shape[0] % self.microbatches:
                raise ConfigError(f"config key 'parallel.microbatches' = {self.microbatches} must divide the "
                                  f"batch size {t.shape[0]} (training.batch_size)")
        self._timer.reset()
        self._step_timer.reset()
        losses: list[torch.Tensor] = []
        args = (inputs,) if self.has_first else ()
        kwargs = {"target": targets, "losses": losses} if self.has_last else {}
        self._step_timer.run(-1, self.schedule.step, *args, return_outputs=False, **kwargs)
        self._stepped = True
        if not self.has_last:
            return None
        return torch.stack([loss.detach() for loss in losses]).sum()  # each is a microbatch mean / microbatches

    def last_step_stats(self) -> PipelineStepStats:
        """Timings of the last ``step`` on this rank (syncs the device on CUDA)."""
        if not self._stepped:
            raise RuntimeError("last_step_stats() called before any step()")
        totals, cpu = self._timer.totals(), self._timer.cpu_totals()
        per_stage = {s.stage_index: totals.get(s.stage_index, 0.0) for s in self.stages}
        per_stage_cpu = {} if self._timer.cuda else {s.stage_index: cpu.get(s.stage_index, 0.0) for s in self.stages}
        return PipelineStepStats(step_s=self._step_timer.totals()[-1], compute_s=sum(per_stage.values()),
                                 stage_compute_s=per_stage, stage_cpu_s=per_stage_cpu)


def build_pipeline(stage_modules: list[nn.Module], pp_mesh_or_group, pp_rank: int, pp_size: int, schedule: str,
                   microbatches: int, loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
                   device: torch.device | str, batch_size: int | None = None) -> Pipeline:
    """Wrap this rank's ``stage_modules`` (from ``split_model``, moved to ``device``) in
    ``PipelineStage``s and the named schedule.

    ``pp_mesh_or_group``: the 1-D ``pp`` DeviceMesh, a ProcessGroup, or None for the
    default group. ``loss_fn(logits, targets)`` must return a mean over its microbatch;
    where the model's stage plan says so the last stage returns ``(logits, extra)`` instead
    (module docstring) and ``loss_fn`` receives that pair.
    ``batch_size``, when given, is checked against ``microbatches`` here, before any
    collective. Validation raises ``ConfigError`` naming the config key."""
    _check_schedule(schedule)
    v = len(stage_modules)
    expected_v = 1 if schedule not in MULTI_STAGE_SCHEDULES else (2 if schedule in V_SCHEDULES else None)
    if (expected_v is not None and v != expected_v) or (expected_v is None and v < 2):
        raise ConfigError(f"config key 'parallel.pp_schedule' = {schedule!r} needs "
                          f"{expected_v or '>= 2'} stage modules per rank, got {v}; build them with split_model "
                          "for the same schedule")
    num_stages = v * pp_size
    _check_microbatches(schedule, microbatches, pp_size, num_stages)
    if batch_size is not None and batch_size % microbatches:
        raise ConfigError(f"config key 'parallel.microbatches' = {microbatches} must divide "
                          f"training.batch_size = {batch_size} (equal microbatches keep the loss a plain mean)")
    if not 0 <= pp_rank < pp_size:
        raise ConfigError(f"pipeline rank {pp_rank} is outside parallel.pp = {pp_size}")

    group = pp_mesh_or_group.get_group() if hasattr(pp_mesh_or_group, "get_group") else pp_mesh_or_group
    if dist.get_world_size(group) != pp_size or dist.get_rank(group) != pp_rank:
        raise ConfigError(f"pipeline group has {dist.get_world_size(group)} ranks (this is rank "
                          f"{dist.get_rank(group)}), but parallel.pp = {pp_size} and pp_rank = {pp_rank}")
    device = torch.device(device)
    timer = _Timer(device)
    stage_ids = stage_ids_for_rank(pp_rank, pp_size, schedule, num_stages)
    import torch.distributed.pipelining as pipelining

    from trainforge.parallel.pipeline_stage import TimedStage

    stages = [TimedStage(m, sid, num_stages, device, group=group, timer=timer,
                          **(_last_stage_call(stage_plan(m.cfg)) if sid == num_stages - 1 else {}))
              for m, sid in zip(stage_modules, stage_ids)]

    def timed_loss(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return timer.run(num_stages - 1, loss_fn, output, target) / microbatches

    cls = getattr(pipelining, SCHEDULES[schedule])
    sched = cls(stages[0] if v == 1 else stages, microbatches, loss_fn=timed_loss, scale_grads=False)
    return Pipeline(sched, stages, list(stage_modules), timer, schedule, microbatches, batch_size)


def _last_stage_call(plan: StagePlan) -> dict:
    """How the last stage is run: its module's call arguments, and where it returns
    (logits, extra), the loss shape inference runs: the main cross-entropy alone, which
    gives the input gradient's shape without the side effects of the whole loss (metrics it
    records, router counters it moves)."""
    if not plan.last_returns_pair:
        return {"call_kwargs": plan.last_call_kwargs}
    return {"call_kwargs": plan.last_call_kwargs,
            "probe_loss": lambda output, target: cross_entropy_loss(output[0], target)}


@torch.no_grad()
def forward_only_loss(pipeline: Pipeline, inputs: torch.Tensor, targets: torch.Tensor, pp_group,
                      pp_rank: int, pp_size: int, act_shape: tuple[int, ...],
                      loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
                      act_dtype: torch.dtype = torch.float32) -> torch.Tensor | None:
    """Validation: run the whole batch through the stages in order, forward only.

    Written out with point-to-point sends because ``schedule.eval`` fails for the
    runtime (V-shaped) schedules in torch 2.13. ``act_shape`` is the activation passed
    between stages, (B, T, dim) or (B, T/tp, dim) under sequence parallelism. Every rank
    passes the same ``inputs``/``targets``; returns the loss on the last stage's rank
    (``loss_fn`` gets the last stage's output as in training: logits, or (logits, h)).
    ``act_dtype``: the activations' dtype (bf16 where FSDP2 gathers bf16 weights)."""
    num_stages = len(pipeline.stages) * pp_size
    owner = {}
    for r in range(pp_size):
        for sid in stage_ids_for_rank(r, pp_size, pipeline.schedule_name, num_stages):
            owner[sid] = r
    mine = {stage.stage_index: (stage, module) for stage, module in zip(pipeline.stages, pipeline.stage_modules)}
    device = pipeline.stages[0].device
    h = None
    loss = None
    for sid in range(num_stages):
        if owner[sid] != pp_rank:
            continue
        if sid == 0:
            x = inputs.to(device)
        elif owner[sid - 1] == pp_rank:
            x = h
        else:
            x = torch.empty(act_shape, device=device, dtype=act_dtype)
            dist.recv(x, group=pp_group, group_src=owner[sid - 1])
        stage, module = mine[sid]
        h = module(x, **stage.call_kwargs)
        if sid == num_stages - 1:
            loss = loss_fn(h, targets.to(device))
        elif owner[sid + 1] != pp_rank:
            dist.send(h.contiguous(), group=pp_group, group_dst=owner[sid + 1])
    return loss
