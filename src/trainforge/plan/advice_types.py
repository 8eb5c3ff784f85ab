"""What the advisor's rules return: a ``Suggestion`` (a measurement crossed its threshold:
the change, its evidence and predicted gain) or a ``Check`` (no suggestion, and why: the
measurement stayed within its threshold, was not recorded, or the rule does not apply to
this run). ``advise --json`` lists both, so every rule that was checked shows its
threshold and the measured value.

    s = rule(ev, ctx)
    if s:            # a Suggestion; a Check is falsy
        ...
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

# A suggestion is "large" when it predicts at least this speedup (or is needed to fit in
# memory): 10% is beyond the 2-3% run-to-run spread of tokens/s measured on this machine
# (docs/benchmarks-archive.md "Monitoring overhead": IQR +-2-3%), so a large one is worth a new run.
LARGE_SPEEDUP = 1.10


@dataclass(frozen=True)
class Evidence:
    """One measurement behind a suggestion: ``metric`` crossed ``threshold`` (``op``)."""

    metric: str
    value: float
    threshold: float
    op: str = ">"  # ">" (above is bad) or "<"
    unit: str = ""

    def text(self) -> str:
        fmt = (lambda v: f"{v:.3g}") if self.unit != "bytes" else (lambda v: f"{v / 2**30:.2f} GiB")
        return f"{self.metric} = {fmt(self.value)} {self.op} {fmt(self.threshold)}"


@dataclass
class Suggestion:
    """One piece of advice. ``changes``: ``{"section.key": value}`` for the training config
    (``scope == "train"``) or ``{"--flag": value}`` for ``trainforge serve`` (``"serve"``).
    ``speedup``: predicted tokens/s after / before, None when the change is not about speed
    (memory); ``gain``: how that number was predicted. ``needed``: the run is at risk
    without it (memory). ``resume_exact``: resuming from the run's checkpoint with the
    change trains exactly what a fresh run with it would from that step (data pipeline,
    monitoring): nothing the model's numerics or the optimisation depends on."""

    rule: str
    title: str
    cause: str
    evidence: list[Evidence]
    changes: dict[str, Any]
    speedup: float | None
    gain: str
    resume_exact: bool = False
    scope: str = "train"
    needed: bool = False
    note: str = ""
    # False: a hyperparameter change (the global batch) that advise shows but never applies:
    # the optimisation is the user's to change, with the learning rate retuned (unless the
    # run's optimizer.lr_scaling retunes it: then the batch rule applies it).
    auto: bool = True

    @property
    def large(self) -> bool:
        return self.needed or (self.speedup is not None and self.speedup >= LARGE_SPEEDUP)

    def rank_key(self) -> tuple:
        return (not self.needed, -(self.speedup or 0.0), self.rule)


@dataclass
class Context:
    """What a rule may know beyond the run: the device memory (bytes) and the hardware
    probe (``trainforge.precision.hardware.Capability``), both optional."""

    memory_limit_bytes: float | None = None
    memory_limit_source: str = ""
    capability: Any = None
    link: Any = None  # comm_model.Link of this machine's collectives; None = predict.measured_link
    extra: dict[str, Any] = field(default_factory=dict)


# ------------------------------------------------------------------------ a rule that did not fire

PASSED, NO_GAIN, NOT_MEASURED, NOT_APPLICABLE, FIRED = "passed", "no gain", "not measured", "not applicable", "fired"


@dataclass(frozen=True)
class Check:
    """A rule's outcome without a suggestion. ``status``: ``passed`` (``metric`` =
    ``value`` within ``threshold``), ``no gain`` (it crossed the threshold, but no change the
    rule knows is predicted to pay: ``why``), ``not measured`` (the run did not record
    ``metric``) or ``not applicable`` (the rule is about something this run does not have:
    ``why``). Falsy, so ``if rule(ev, ctx):`` means "a suggestion"."""

    status: str
    why: str = ""
    metric: str = ""
    value: float | None = None
    threshold: float | None = None
    op: str = ">"  # as Evidence: ">" above the threshold is bad, "<" below it is

    def __bool__(self) -> bool:
        return False


def passed(metric: str, value: float, threshold: float, op: str = ">", why: str = "") -> Check:
    return Check(PASSED, why, metric, float(value), float(threshold), op)


def no_gain(metric: str, value: float, threshold: float, why: str, op: str = ">") -> Check:
    return Check(NO_GAIN, why, metric, float(value), float(threshold), op)


def not_measured(metric: str, threshold: float | None, why: str, op: str = ">") -> Check:
    return Check(NOT_MEASURED, why, metric, None, None if threshold is None else float(threshold), op)


def not_applicable(why: str) -> Check:
    return Check(NOT_APPLICABLE, why, op="")


def check_record(rule: str, outcome: "Suggestion | Check", source: str) -> dict[str, Any]:
    """One entry of ``advise --json``'s ``checks``: the rule (its function's name), what it
    read (the run or an inference file), pass / fail, its first measurement and threshold."""
    if isinstance(outcome, Suggestion):
        e = outcome.evidence[0] if outcome.evidence else None
        return {"rule": rule, "source": source, "status": FIRED, "passed": False, "suggestion": outcome.rule,
                "metric": e.metric if e else "", "value": e.value if e else None,
                "threshold": e.threshold if e else None, "op": e.op if e else "", "why": outcome.cause}
    ok = {PASSED: True, NO_GAIN: True}.get(outcome.status)
    return {"rule": rule, "source": source, "status": outcome.status, "passed": ok, "suggestion": None,
            "metric": outcome.metric, "value": outcome.value, "threshold": outcome.threshold, "op": outcome.op,
            "why": outcome.why}
