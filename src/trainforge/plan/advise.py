"""``trainforge advise``: a finished run's measurements (and optionally inference ones) ->
ranked suggestions -> (on request) an advised config -> the next run.

    advice = advise(Path("runs/x"), [Path("stats.json")], Context(memory_limit_bytes=...))
    advised = advice.advised            # the run's config dict with the applied changes
    nxt = next_run(advice, newest_checkpoint=(path, step))   # fresh or resumed, and why

Order: read evidence (``run_evidence``), run every rule (``advice_rules``, ``serve_rules``),
keep every rule's outcome (``Advice.checks``: fired, passed, not measured, not applicable,
with threshold and measured value), rank (needed first, then predicted speedup), apply the
training suggestions to the run's
config in rank order (one whose keys an earlier one already set is shown, not applied; so
is one predicting under ``APPLY_MIN_SPEEDUP``, 1.10x; nothing grows the batch once memory
is short). The CLI turns ``advised`` into a validated
``Config`` and writes it only when asked (``--output``, ``--apply``; only the CLI imports
``trainforge.config``).

Resume or fresh: the next run resumes from the run's newest checkpoint only when every
applied change leaves the trained numbers as they would be (data pipeline, monitoring) and
the run has steps left; anything that changes numerics or the optimisation (precision,
compression, batch, layout) starts fresh, and ``NextRun.why`` says which."""

from __future__ import annotations

import copy
import os
import shutil
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from trainforge.plan.advice_rules import APPLY_MIN_SPEEDUP, TRAIN_RULES, Context, Suggestion
from trainforge.plan.advice_types import check_record
from trainforge.plan.run_evidence import RunEvidence, ServeEvidence, read_inference, read_run
from trainforge.plan.serve_rules import SERVE_RULES

ADVISED_FILE = "advised.toml"
ADVISED_SUFFIX = "-advised"


@dataclass
class Advice:
    run: RunEvidence
    serve: list[ServeEvidence]
    suggestions: list[Suggestion]  # ranked, shown
    applied: list[Suggestion]  # whose changes are in ``advised``
    advised: dict[str, Any]
    not_applied: dict[str, str] = field(default_factory=dict)  # rule -> why
    checks: list[dict[str, Any]] = field(default_factory=list)  # every rule run (advice_types.check_record)

    @property
    def changes(self) -> dict[str, Any]:
        return {k: v for s in self.applied for k, v in s.changes.items()}

    @property
    def resume_exact(self) -> bool:
        return bool(self.applied) and all(s.resume_exact for s in self.applied)


def advise(run_dir: str | Path, inference: list[str | Path] = (), ctx: Context | None = None,
           ev: RunEvidence | None = None) -> Advice:
    """Read ``run_dir`` (unless ``ev`` is its evidence already) and the inference files, run
    the rules, rank and apply."""
    ctx = ctx or Context()
    ev = ev or read_run(run_dir)
    serve = [read_inference(p) for p in inference]
    outcomes = [(rule, rule(ev, ctx), str(ev.run_dir)) for rule in TRAIN_RULES]
    outcomes += [(rule, rule(sv), sv.source) for sv in serve for rule in SERVE_RULES]
    found = sorted((o for _, o, _ in outcomes if isinstance(o, Suggestion)), key=Suggestion.rank_key)
    checks = [check_record(rule.__name__.replace("_", "-"), o, src) for rule, o, src in outcomes]
    advised, applied, skipped = apply_changes(ev.config, found)
    return Advice(ev, serve, found, applied, advised, skipped, checks)


def apply_changes(config: dict[str, Any], suggestions: list[Suggestion]) -> tuple[dict, list[Suggestion], dict]:
    """(config with the changes, applied suggestions, {rule: why not}) in rank order."""
    out = copy.deepcopy(config)
    applied: list[Suggestion] = []
    skipped: dict[str, str] = {}
    taken: dict[str, str] = {}
    for s in suggestions:
        if s.scope != "train" or not s.changes:
            continue
        if not s.auto:
            skipped[s.rule] = "changes the optimisation (global batch): apply by hand"
            continue
        clash = [k for k in s.changes if k in taken]
        if clash:
            skipped[s.rule] = f"{clash[0]} already set by {taken[clash[0]]}"
            continue
        if s.rule == "batch" and any(a.rule.startswith("memory") for a in applied):
            skipped[s.rule] = "memory is short: the batch stays"
            continue
        if not s.needed and s.speedup is not None and s.speedup < APPLY_MIN_SPEEDUP:
            skipped[s.rule] = f"predicted {s.speedup:.2f}x, under the {APPLY_MIN_SPEEDUP:.2f}x a new run needs"
            continue
        for key, value in s.changes.items():
            set_dotted(out, key, value)
            taken[key] = s.rule
        applied.append(s)
    return out, applied, skipped


def set_dotted(config: dict[str, Any], key: str, value: Any) -> None:
    """``set_dotted(cfg, "data.cache.dir", x)``: nested tables are created as needed."""
    *tables, last = key.split(".")
    node = config
    for t in tables:
        node = node.setdefault(t, {})
    node[last] = value


def get_dotted(config: dict[str, Any], key: str) -> Any:
    node: Any = config
    for part in key.split("."):
        if not isinstance(node, dict) or part not in node:
            return None
        node = node[part]
    return node


# ------------------------------------------------------------------------ context


def device_memory(ev: RunEvidence) -> tuple[float | None, str]:
    """(bytes, source) of the memory the run's peak is measured against: the CUDA device's
    when the run recorded CUDA allocator figures and a GPU is visible, else this host's RAM
    for a CPU run (peak RSS is what the trainer records there); (None, why) otherwise."""
    if ev.device == "cuda":
        try:
            import torch

            if torch.cuda.is_available():
                props = torch.cuda.get_device_properties(0)
                return float(props.total_memory), f"{props.name} memory"
        except (ImportError, RuntimeError):
            pass
        return None, "a CUDA run and no GPU here: pass --memory_limit_gb"
    try:
        return float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")), "this host's RAM"
    except (ValueError, OSError, AttributeError):
        return None, "host memory unknown: pass --memory_limit_gb"


def hardware_capability(ev: RunEvidence) -> Any:
    """The precision probe's verdict for a CPU run on this machine (cached per CPU model;
    the first call measures for a second or two); None for other devices."""
    device = str(ev.cfg("training.device", "auto"))
    if ev.device == "cuda" or device.startswith("cuda"):
        return None
    from trainforge.precision.hardware import cpu_capability

    return cpu_capability()


# ------------------------------------------------------------------------ the next run


@dataclass
class NextRun:
    run_dir: Path
    resume: bool
    why: str
    argv: list[str]  # the command line to run (python -m trainforge train ..., under torchrun when multi-process)


def newest_checkpoint(run_dir: Path) -> tuple[Path, int] | None:
    """(directory, step) of the run's newest complete checkpoint, or None."""
    from trainforge.storage.checkpoint_dirs import scan_checkpoints

    complete, _ = scan_checkpoints(run_dir / "checkpoints")
    if not complete:
        return None
    d = complete[-1]
    return d, int(d.name.rsplit("_", 1)[-1])


def next_run_dir(run_dir: Path) -> Path:
    """``RUN_DIR-advised``, or ``RUN_DIR-advised-2``... when it exists."""
    base = run_dir.parent / f"{run_dir.name}{ADVISED_SUFFIX}"
    cand, n = base, 2
    while cand.exists():
        cand, n = run_dir.parent / f"{base.name}-{n}", n + 1
    return cand


def next_run(advice: Advice, advised_file: Path, newest_checkpoint: tuple[Path, int] | None,
             new_dir: Path | None = None) -> NextRun:
    """Decide resume vs fresh and build the command; nothing is written (``prepare_next_run``)."""
    ev = advice.run
    new_dir = new_dir or next_run_dir(ev.run_dir)
    total = int(ev.cfg("training.steps", 0))
    if not advice.resume_exact:
        inexact = [s.rule for s in advice.applied if not s.resume_exact]
        verb = "changes" if len(inexact) == 1 else "change"
        resume, why = False, f"fresh: {', '.join(inexact)} {verb} what is trained"
    elif newest_checkpoint is None:
        resume, why = False, f"fresh: {ev.run_dir} has no complete checkpoint"
    elif newest_checkpoint[1] >= total:
        resume, why = False, f"fresh: the run finished all {total} steps (resuming would train none)"
    else:
        rules = ", ".join(s.rule for s in advice.applied)
        verb = "leaves" if len(advice.applied) == 1 else "leave"
        resume, why = True, (f"resumed from {newest_checkpoint[0]} (step {newest_checkpoint[1]}): {rules} {verb} "
                             "the trained numbers unchanged")
    world = ev.world_size
    launcher = [sys.executable, "-m", "trainforge", "train"] if world == 1 else \
        [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={world}",
         "-m", "trainforge", "train"]
    args = ["--resume", str(new_dir)] if resume else ["--config", str(advised_file), "--run_dir", str(new_dir)]
    return NextRun(new_dir, resume, why, [*launcher, *args, "--no_sample"])


def prepare_next_run(nxt: NextRun, advised_text: str, newest_checkpoint: tuple[Path, int] | None) -> None:
    """For a resume: the new directory gets the advised config as its config.toml and the
    checkpoint, hard-linked (checkpoint files are written once and renamed, never changed
    in place), copied where links are not possible."""
    if not nxt.resume or newest_checkpoint is None:
        return
    ckpt = newest_checkpoint[0]
    dest = nxt.run_dir / "checkpoints" / ckpt.name
    dest.parent.mkdir(parents=True, exist_ok=False)

    def link(src: str, dst: str) -> None:
        try:
            os.link(src, dst)
        except OSError:
            shutil.copy2(src, dst)

    shutil.copytree(ckpt, dest, copy_function=link)
    (nxt.run_dir / "config.toml").write_text(advised_text, encoding="utf-8")


# ------------------------------------------------------------------------ output


def to_json(advice: Advice, advised_file: Path | None = None) -> dict[str, Any]:
    ev = advice.run
    return {
        "run_dir": str(ev.run_dir), "tokens_per_s": ev.tokens_per_s, "step_s": ev.median("step_s"),
        "steady_steps": len(ev.records),
        "inference": [{"source": s.source, "kind": s.kind} for s in advice.serve],
        "suggestions": [{
            "rule": s.rule, "title": s.title, "cause": s.cause, "scope": s.scope, "large": s.large,
            "needed": s.needed, "auto": s.auto, "predicted_speedup": s.speedup, "gain": s.gain, "changes": s.changes,
            "resume_exact": s.resume_exact, "applied": s in advice.applied, "note": s.note,
            "not_applied": advice.not_applied.get(s.rule),
            "evidence": [{"metric": e.metric, "value": e.value, "threshold": e.threshold, "op": e.op}
                         for e in s.evidence]} for s in advice.suggestions],
        "advised_config": str(advised_file) if advised_file else None, "changes": advice.changes,
        "checks": advice.checks,
    }


def render(advice: Advice, advised_file: Path | None, console=None) -> None:
    """The ranked suggestions as a rich table, then where the advised config was written
    (``advised_file``; None: nothing was written, and how to write it)."""
    from rich.console import Console
    from rich.table import Table

    console = console or Console()
    ev = advice.run
    tps = ev.tokens_per_s
    head = f"{ev.run_dir}: {tps:,.0f} tokens/s" if tps else f"{ev.run_dir}"
    step = ev.median("step_s")
    if step:
        head += f", step {1e3 * step:.1f} ms (median of {len(ev.records)} steady steps)"
    console.print(head)
    fired = sum(c["status"] == "fired" for c in advice.checks)
    console.print(f"{len(advice.checks)} rule checks, {fired} fired (--json lists each with its threshold and "
                  "measured value)")
    if not advice.suggestions:
        console.print("no suggestion: no measurement crossed its threshold")
        return
    table = Table(show_lines=True)
    for col in ("#", "suggestion", "evidence", "predicted", "changes"):
        table.add_column(col, overflow="fold")
    for i, s in enumerate(advice.suggestions, 1):
        pred = "needed" if s.needed else ""
        if s.speedup is not None:
            pred = (pred + ", " if pred else "") + f"{s.speedup:.2f}x tokens/s"
        pred += f"\n[dim]{s.gain}[/dim]"
        changes = "\n".join(f"{k} = {v!r}" for k, v in s.changes.items())
        if s in advice.applied:
            changes += "\n[green]applied[/green]" + (" (resume-exact)" if s.resume_exact else "")
        elif s.scope == "serve":
            changes += "\n[dim]serve flag[/dim]"
        elif s.rule in advice.not_applied:
            changes += f"\n[yellow]not applied: {advice.not_applied[s.rule]}[/yellow]"
        title = f"[bold]{s.title}[/bold]\n{s.cause}" + (f"\n[yellow]{s.note}[/yellow]" if s.note else "")
        table.add_row(str(i) + ("" if s.large else " (small)"), title,
                      "\n".join(e.text() for e in s.evidence), pred, changes)
    console.print(table)
    if advised_file is not None:
        console.print(f"advised config: {advised_file} ({len(advice.changes)} key"
                      f"{'' if len(advice.changes) == 1 else 's'} changed)")
    elif advice.changes:
        console.print(f"{len(advice.changes)} key{'' if len(advice.changes) == 1 else 's'} would change; nothing "
                      "written: --output FILE writes the advised config, --apply also starts the next run")
