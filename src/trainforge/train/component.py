"""A training feature is a ``Component``: it owns its state (``state_dict`` /
``load_state_dict``: ``torch.distributed.checkpoint.stateful.Stateful``) and reacts to a
few named events of the loop. ``Components`` is the registry the trainer iterates; the
loop never names a feature, and the checkpoint saves every registered component by name.

Events, in the order one step meets them (every hook is a no-op unless overridden;
the registry calls only the overridden ones, so an unused hook costs nothing)::

    train_step:  on_step_start -> forward/backward, clip -> before_optimizer_step (-> bool:
                 apply the update?) -> optimizer/scheduler step -> after_optimizer_step
    fit:         on_step_end (may request a stop) -> [window end: on_log (adds metrics),
                 records written, after_log] -> after_step -> evaluation: on_evaluation
                 -> checkpoint: on_checkpoint (collective) ... load: on_load
    end:         on_fit_end (adds to the summary)

A component changes the run only through typed requests to the loop
(``loop.request(Stop(...))``, ``loop.request(Rollback(...))``) and its own objects
(an LR multiplier, a precision switch); it never calls another component.

Checkpoint layout: a component's state goes into ``train_state.pt`` under its ``name``;
a name ``"a/b"`` nests (``state["a"]["b"]``), which keeps the callback states of older
checkpoints (``callbacks/<state_key>``) where they were. An empty state is not written
(an fp32 run's checkpoint has no ``precision`` key). ``per_rank`` components (state that
differs per rank) write ``<name>/rank_NNNNN.pt`` in sharded checkpoints instead.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Protocol

import torch
import torch.distributed as dist

from trainforge.errors import CheckpointError


class StopKind(enum.StrEnum):
    """Who stopped the run (``summary["stopped_by"]``; a str, so JSON writes it as such)."""

    REQUEST = "request"        # request_stop: a callback, a test, a user hook
    SIGNAL = "signal"          # SIGINT/SIGTERM/SIGHUP, agreed by all ranks
    BAD_STEPS = "bad_steps"    # the bad-step guard gave up: a diverged run
    EARLY_STOP = "early_stop"  # the run is done: as complete as reaching training.steps
    REBALANCE = "rebalance"    # pipeline stages drifted from the plan: the CLI restarts with a new split


@dataclass(frozen=True)
class Stop:
    """Stop after the current step; the loop checkpoints first."""

    reason: str
    kind: StopKind = StopKind.REQUEST


@dataclass(frozen=True)
class Rollback:
    """Reload the newest checkpoint from before the last ``consecutive_bad`` steps."""

    consecutive_bad: int


LoopRequest = Stop | Rollback


@dataclass
class Window:
    """One logging window as the loop read it (host values, same on every rank):
    ``steps`` and their ``losses`` (mean over data-parallel ranks) and pre-clip
    ``norms``; ``stats`` is what the loop measured and ``on_log`` hooks add, merged
    into every training record of the window; ``per_step`` is what hooks measured per
    step: one value per entry of ``steps``, each merged into its step's record."""

    steps: list[int]
    losses: list[float]
    norms: list[float]
    stats: dict[str, Any] = field(default_factory=dict)
    per_step: dict[str, list[Any]] = field(default_factory=dict)


class Component:
    """Base of the loop's components; subclasses set ``name`` and override what they need.
    ``loop`` is the trainer (``step``, ``metrics``, ``request``, ``optimizers``,
    ``schedulers``, ``layout``, ``train_batches`` ...)."""

    name: str = ""
    per_rank: bool = False          # state differs per rank (sharded checkpoints: <name>/rank_NNNNN.pt)
    keep_on_rollback: bool = False  # a rollback keeps the live state (e.g. the rollback count)

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        pass

    def on_missing_state(self, loop: Any, path: Path) -> None:
        """Resumed from a checkpoint without this component's state: it starts fresh."""

    def on_step_start(self, loop: Any) -> None: ...
    def before_optimizer_step(self, loop: Any, loss: torch.Tensor, grad_norm: torch.Tensor) -> bool: ...
    def after_optimizer_step(self, loop: Any) -> None: ...
    def on_step_end(self, loop: Any, step: int) -> None: ...
    def on_log(self, loop: Any, window: Window) -> dict[str, Any] | None: ...
    def after_log(self, loop: Any, window: Window) -> None: ...
    def after_step(self, loop: Any, step: int) -> None: ...
    def on_evaluation(self, loop: Any, step: int, val_loss: float) -> dict[str, Any] | None: ...
    def on_checkpoint(self, loop: Any) -> None: ...
    def on_load(self, loop: Any) -> None: ...
    def on_fit_end(self, loop: Any, summary: dict[str, Any]) -> None: ...


HOOKS = ("on_step_start", "before_optimizer_step", "after_optimizer_step", "on_step_end", "on_log", "after_log",
         "after_step", "on_evaluation", "on_checkpoint", "on_load", "on_fit_end")


class Callback(Protocol):
    """Observes named training events; may only influence training via ``trainer.request_stop``.
    Registered as a component (``component.CallbackComponent``); a ``Component`` may be
    passed as a callback too.

    Events: ``on_step_end(trainer, step)`` after every step; optionally
    ``on_evaluation(trainer, step, val_loss) -> dict | None`` after every validation
    (step 0 included), whose returned record is merged into the ``val_loss`` metrics
    line. A stop requested in ``on_evaluation`` is rank 0's decision on every rank.
    A callback with ``state_dict``/``load_state_dict`` is checkpointed under its
    ``state_key`` (default: its class name)."""

    def on_step_end(self, trainer: Any, step: int) -> None: ...


class CallbackComponent(Component):
    """A ``trainer.Callback`` (``on_step_end``, optional ``on_evaluation``, optional
    ``state_dict`` under ``state_key``, default its class name) as a component."""

    def __init__(self, callback: Any):
        self.callback = callback
        key = getattr(callback, "state_key", type(callback).__name__)
        self.name = f"callbacks/{key}"  # where older checkpoints keep callback states
        self._stateful = hasattr(callback, "state_dict") and hasattr(callback, "load_state_dict")
        self.on_step_end = callback.on_step_end
        if hasattr(callback, "on_evaluation"):
            self.on_evaluation = callback.on_evaluation

    def state_dict(self) -> dict[str, Any]:
        return self.callback.state_dict() if self._stateful else {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if self._stateful:
            self.callback.load_state_dict(state)


def as_component(obj: Any) -> Component:
    return obj if isinstance(obj, Component) else CallbackComponent(obj)


def _overrides(c: Component, hook: str) -> bool:
    """Whether ``c`` reacts to ``hook`` (an instance may switch a hook off by setting it to None)."""
    if hook in vars(c):
        return callable(vars(c)[hook])
    return getattr(type(c), hook) is not getattr(Component, hook)


class _StopCollector:
    """Stands in for the loop while ``on_evaluation`` hooks run: every attribute reads
    through, but a stop is only collected, so the loop can make rank 0's decision everyone's."""

    def __init__(self, loop: Any):
        self._loop = loop
        self.reason: str | None = None

    def request_stop(self, reason: str, kind: Any = None) -> None:
        if self.reason is None:
            self.reason = reason

    def request(self, req: Any) -> None:
        if isinstance(req, Stop):
            self.request_stop(req.reason)
        else:
            self._loop.request(req)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._loop, name)


class Components:
    """The registry: components in registration order, each hook's overriding methods
    precomputed, and the checkpoint state of all of them."""

    def __init__(self, components: Iterable[Any] = ()):
        self._items: list[Component] = []
        for c in components:
            self.add(c)

    def add(self, component: Any) -> Component:
        c = as_component(component)
        if not c.name or any(o.name == c.name for o in self._items):
            raise ValueError(f"component {type(c).__name__} needs a unique name, got {c.name!r}")
        self._items.append(c)
        self._hooks = {h: [getattr(o, h) for o in self._items if _overrides(o, h)] for h in HOOKS}
        return c

    def __getitem__(self, name: str) -> Component:
        for c in self._items:
            if c.name == name:
                return c
        raise KeyError(name)

    def get(self, name: str) -> Component | None:
        return next((c for c in self._items if c.name == name), None)

    def __iter__(self) -> Iterator[Component]:
        return iter(self._items)

    # -- events --------------------------------------------------------------------------

    def on_step_start(self, loop: Any) -> None:
        for h in self._hooks["on_step_start"]:
            h(loop)

    def before_optimizer_step(self, loop: Any, loss: torch.Tensor, grad_norm: torch.Tensor) -> bool:
        """True unless some component rejects the update (every hook runs)."""
        verdicts = [h(loop, loss, grad_norm) for h in self._hooks["before_optimizer_step"]]
        return all(v is not False for v in verdicts)

    def after_optimizer_step(self, loop: Any) -> None:
        for h in self._hooks["after_optimizer_step"]:
            h(loop)

    def on_step_end(self, loop: Any, step: int) -> None:
        for h in self._hooks["on_step_end"]:
            h(loop, step)

    def on_log(self, loop: Any, window: Window) -> None:
        for h in self._hooks["on_log"]:
            window.stats.update(h(loop, window) or {})

    def after_log(self, loop: Any, window: Window) -> None:
        for h in self._hooks["after_log"]:
            h(loop, window)

    def after_step(self, loop: Any, step: int) -> None:
        for h in self._hooks["after_step"]:
            h(loop, step)

    def on_evaluation(self, loop: Any, step: int, val_loss: float, world_size: int
                      ) -> tuple[dict[str, Any], str | None]:
        """(the merged records the hooks returned, the stop reason one asked for). With
        several ranks the reason is rank 0's, broadcast (a collective, only when some
        component has the hook): components fitting curves on equal inputs should agree,
        but one differing floating-point path must not leave ranks waiting on each other."""
        hooks = self._hooks["on_evaluation"]
        if not hooks:
            return {}, None
        proxy = _StopCollector(loop)
        record: dict[str, Any] = {}
        for hook in hooks:
            record.update(hook(proxy, step, val_loss) or {})
        reason = proxy.reason
        if world_size > 1:
            box = [reason]
            dist.broadcast_object_list(box, src=0)
            reason = box[0]
        return record, reason

    def on_checkpoint(self, loop: Any) -> None:
        for h in self._hooks["on_checkpoint"]:
            h(loop)

    def on_load(self, loop: Any) -> None:
        for h in self._hooks["on_load"]:
            h(loop)

    def on_fit_end(self, loop: Any, summary: dict[str, Any]) -> None:
        for h in self._hooks["on_fit_end"]:
            h(loop, summary)

    # -- checkpoint ----------------------------------------------------------------------

    def state(self, include_per_rank: bool) -> dict[str, Any]:
        """``train_state.pt`` entries of every component (per-rank ones only when
        ``include_per_rank``: a single process has one rank, so no rank files)."""
        out: dict[str, Any] = {}
        for c in self._items:
            if c.per_rank and not include_per_rank:
                continue
            state = c.state_dict()
            if state:
                *parents, leaf = c.name.split("/")
                node = out
                for p in parents:
                    node = node.setdefault(p, {})
                node[leaf] = state
        return out

    def save_rank_files(self, ckpt_dir: Path, rank: int) -> None:
        """This rank's per-rank states under ``ckpt_dir/<name>/rank_NNNNN.pt``."""
        for c in self._items:
            if c.per_rank:
                (ckpt_dir / c.name).mkdir(exist_ok=True)
                torch.save(c.state_dict(), ckpt_dir / c.name / f"rank_{rank:05d}.pt")

    def load(self, loop: Any, path: Path, state: dict[str, Any], rank: int,
             read_file: Callable[[Path], dict[str, Any]], rollback: bool = False) -> None:
        """Restore every component from checkpoint ``path`` (its ``train_state`` is
        ``state``; ``read_file`` loads a rank file safely). A rollback keeps the live
        state of ``keep_on_rollback`` components."""
        for c in self._items:
            if rollback and c.keep_on_rollback:
                continue
            node: Any = state
            for part in c.name.split("/"):
                node = node.get(part) if isinstance(node, dict) else None
            source: Path = path
            if node is None and c.per_rank:
                f = path / c.name / f"rank_{rank:05d}.pt"
                if f.is_file():
                    try:
                        node, source = read_file(f), f
                    except (KeyError, RuntimeError, ValueError, TypeError, AttributeError, IndexError) as e:
                        raise CheckpointError(f"{f}: {c.name} state does not load ({e}); delete the {c.name}/ "
                                              "folder of that checkpoint to start it afresh") from None
            if node is None:
                c.on_missing_state(loop, path)
                continue
            try:
                c.load_state_dict(node)
            except (KeyError, RuntimeError, ValueError, TypeError, AttributeError, IndexError) as e:  # of a hostile file
                raise CheckpointError(f"{source}: {c.name} state does not fit this run ({e}); delete the "
                                      f"{c.name} state of that checkpoint to start it afresh") from None
