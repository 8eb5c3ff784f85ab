"""Pipeline schedules replayed without running them: each schedule's own action list
(torch's ``pipeline_order``, every rank's) played with unit costs, giving the bubble
fraction and how many microbatches' activations each rank holds at its peak.

    order = action_order("interleaved-1f1b", pp=4, microbatches=8)
    simulated_bubble(order, v=2)          # 1 - busy / makespan, averaged over ranks
    peak_in_flight(order)                 # per rank: most stage-microbatches alive at once
    schedule_profile("1f1b", 4, 8)        # both, cached (the planner asks thousands of times)

Costs: F = I = W = 1 time unit per stage chunk (full backward B = I + W = 2), a rank's
chunks sharing its work (one unit = 1/v of it), communication free. For gpipe and 1f1b
the replay gives exactly (p-1)/(m+p-1); for interleaved-1f1b about (p-1)/(v·m+p-1);
zero-bubble schedules approach 0 under F = I = W.

The action lists come from torch's own schedule classes (their
``_calculate_single_rank_operations``, the function their ``__init__`` calls per rank),
called on an instance built without ``__init__`` because that needs live stages and a
process group; only the attributes those functions read are set. 1F1B is written out
here: torch 2.13's ``Schedule1F1B.pipeline_order`` numbers the last rank's forwards from
1, so it cannot be replayed. ``bench/pipeline_schedules.py`` compares these figures with
measured bubbles.
"""

from __future__ import annotations

import functools
import statistics
from dataclasses import dataclass

from torch.distributed.pipelining.schedules import _Action, _ComputationType

from trainforge.parallel.pipeline import SCHEDULES, V_SCHEDULES

_CT = _ComputationType
# Time units per action kind, for one stage chunk (F = I = W = 1).
_UNIT = {_CT.FORWARD: 1.0, _CT.BACKWARD_INPUT: 1.0, _CT.BACKWARD_WEIGHT: 1.0, _CT.FULL_BACKWARD: 2.0}


def _compute_actions(order: dict[int, list[_Action | None]]) -> dict[int, list[_Action]]:
    """Each rank's compute actions in order: idle slots (None) and communication dropped,
    overlapped F+B pairs (DualPipeV) expanded into their parts."""
    acts: dict[int, list[_Action]] = {}
    for rank, actions in order.items():
        flat: list[_Action] = []
        for a in actions:
            if a is None:
                continue
            flat.extend(a.sub_actions if a.sub_actions else [a])
        acts[rank] = [a for a in flat if a.computation_type in _UNIT]
    return acts


def simulated_bubble(order: dict[int, list[_Action | None]], v: int) -> float:
    """Replay every rank's compute actions with unit costs and zero-cost communication;
    returns 1 - busy / makespan averaged over ranks. ``v``: stages per rank."""
    acts = _compute_actions(order)
    num_stages = 1 + max(a.stage_index for a in sum(acts.values(), []))
    done: dict[tuple, float] = {}
    clock = {r: 0.0 for r in acts}
    busy = {r: 0.0 for r in acts}
    ptr = {r: 0 for r in acts}
    while any(ptr[r] < len(acts[r]) for r in acts):
        progressed = False
        for r in acts:
            while ptr[r] < len(acts[r]):
                s, kind, mb = acts[r][ptr[r]][:3]
                if kind == _CT.FORWARD:
                    deps, key = ([("F", s - 1, mb)] if s > 0 else []), ("F", s, mb)
                elif kind in (_CT.FULL_BACKWARD, _CT.BACKWARD_INPUT):
                    deps = [("F", s, mb)] + ([("G", s + 1, mb)] if s < num_stages - 1 else [])
                    key = ("G", s, mb)
                else:
                    deps, key = [("G", s, mb)], ("W", s, mb)
                if not all(d in done for d in deps):
                    break
                start = max([clock[r]] + [done[d] for d in deps])
                cost = _UNIT[kind] / v
                clock[r] = done[key] = start + cost
                busy[r] += cost
                ptr[r] += 1
                progressed = True
        if not progressed:
            raise RuntimeError("schedule replay deadlocked")
    makespan = max(clock.values())
    return statistics.fmean(1 - busy[r] / makespan for r in acts)


def peak_in_flight(order: dict[int, list[_Action | None]]) -> dict[int, int]:
    """Per rank, the most (stage, microbatch) activation sets alive at once. One is born
    at its forward and dies at its full backward, or, with the backward split, at the
    weight backward (the weight gradient still reads the layers' saved inputs; an upper
    bound, since the input backward frees part of them)."""
    out = {}
    for rank, acts in _compute_actions(order).items():
        alive = peak = 0
        split = any(a.computation_type == _CT.BACKWARD_WEIGHT for a in acts)
        for a in acts:
            if a.computation_type == _CT.FORWARD:
                alive += 1
                peak = max(peak, alive)
            elif a.computation_type == _CT.FULL_BACKWARD or (split and a.computation_type == _CT.BACKWARD_WEIGHT):
                alive -= 1
        out[rank] = peak
    return out


def one_f_one_b_order(p: int, m: int) -> dict[int, list[_Action]]:
    """1F1B's action order as ``Schedule1F1B._step_microbatches`` runs it: rank r does
    min(m, p - r) forwards, then alternates backward and forward, then drains."""
    order = {}
    for r in range(p):
        warm = min(m, p - r)
        acts = [_Action(r, _CT.FORWARD, i) for i in range(warm)]
        fwd, bwd = warm, 0
        while bwd < m:
            acts.append(_Action(r, _CT.FULL_BACKWARD, bwd))
            bwd += 1
            if fwd < m:
                acts.append(_Action(r, _CT.FORWARD, fwd))
                fwd += 1
        order[r] = acts
    return order


def gpipe_order(p: int, m: int) -> dict[int, list[_Action]]:
    """GPipe: every forward, then every backward, on each rank."""
    return {r: [_Action(r, _CT.FORWARD, i) for i in range(m)] + [_Action(r, _CT.FULL_BACKWARD, i) for i in range(m)]
            for r in range(p)}


def stages_per_rank(schedule: str) -> int:
    """v: 1 for gpipe/1f1b, 2 for the others (interleaved-1f1b as the trainer's default)."""
    return 1 if schedule in ("gpipe", "1f1b") else 2


def action_order(schedule: str, pp: int, microbatches: int) -> dict[int, list[_Action | None]]:
    """Every rank's action list for ``schedule`` over ``pp`` ranks and ``microbatches``
    microbatches (the multi-stage schedules with 2 stages per rank). ValueError for an
    unknown schedule name or a count the schedule rejects."""
    if schedule not in SCHEDULES:
        raise ValueError(f"unknown pipeline schedule {schedule!r}: choose one of {sorted(SCHEDULES)}")
    if schedule == "gpipe":
        return gpipe_order(pp, microbatches)
    if schedule == "1f1b":
        return one_f_one_b_order(pp, microbatches)
    from torch.distributed.pipelining import schedules as torch_schedules

    cls = getattr(torch_schedules, SCHEDULES[schedule])
    v = stages_per_rank(schedule)
    sched = object.__new__(cls)  # no __init__: it needs live stages (module docstring)
    sched.pp_group_size = pp
    sched._n_microbatches = microbatches
    sched.n_local_stages = v
    sched.num_stages = sched._num_stages = v * pp
    sched.number_of_rounds = max(1, microbatches // pp)
    sched.microbatches_per_round = microbatches // sched.number_of_rounds
    return {r: sched._calculate_single_rank_operations(r) for r in range(pp)}


@dataclass(frozen=True)
class ScheduleProfile:
    """What the cost model needs from a schedule: ``bubble_fraction`` (of a rank's step,
    averaged over ranks) and ``peak_in_flight``: the most stage-microbatch activation sets
    the most loaded rank holds at once (its stages hold about equal layers)."""

    schedule: str
    pp: int
    microbatches: int
    v: int
    bubble_fraction: float
    peak_in_flight: int


@functools.lru_cache(maxsize=4096)
def schedule_profile(schedule: str, pp: int, microbatches: int) -> ScheduleProfile:
    """``pp`` = 1 is no pipeline: no bubble, one microbatch alive."""
    if pp == 1:
        return ScheduleProfile(schedule, 1, microbatches, 1, 0.0, 1)
    order = action_order(schedule, pp, microbatches)
    v = stages_per_rank(schedule)
    return ScheduleProfile(schedule, pp, microbatches, v, simulated_bubble(order, v),
                           max(peak_in_flight(order).values()))


__all__ = ["SCHEDULES", "V_SCHEDULES", "ScheduleProfile", "action_order", "gpipe_order", "one_f_one_b_order",
           "peak_in_flight", "schedule_profile", "simulated_bubble", "stages_per_rank"]
