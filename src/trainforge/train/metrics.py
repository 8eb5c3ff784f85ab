"""Where training progress is shown: the console (a rich progress bar on a TTY, plain
log lines otherwise). The JSONL file and the other sinks live in ``trainforge.monitor``.

Both show step/total, the time left and the loss first: on a narrow terminal the bar
shrinks and the less important fields (grad norm, then LR, MFU, tokens/s) are left out,
so an 80-column terminal still shows the ETA."""

from __future__ import annotations

import sys
import time
from typing import Any

from trainforge.log import get_logger

BAR_MIN = 10  # columns of the bar before the status fields get dropped
ETA_COLUMNS = 7  # "1:23:45", what rich's TimeRemainingColumn renders


def status_fields(record: dict[str, Any]) -> list[tuple[int, str]]:
    """(drop order, text) of a train record's console fields, in display order: the
    highest drop order goes first when space runs out; the loss is never dropped."""
    return [(0, f"loss {record['loss']:.4f}"), (3, f"lr {record['lr']:.2e}"),
            (4, f"grad_norm {record['grad_norm']:.3f}"), (1, f"{record['tokens_per_s']:,.0f} tok/s"),
            (2, f"mfu {100 * record['mfu']:.1f}%")]


def fit_status(record: dict[str, Any], width: int) -> str:
    """The status fields that fit in ``width`` columns, dropping the least important first."""
    fields = status_fields(record)
    while len(fields) > 1 and len(" ".join(t for _, t in fields)) > width:
        fields.remove(max(fields))
    return " ".join(t for _, t in fields)


def format_eta(seconds: float) -> str:
    """H:MM:SS, as the progress bar prints it."""
    s = max(0, int(round(seconds)))
    return f"{s // 3600}:{s // 60 % 60:02d}:{s % 60:02d}"


class ConsoleReporter:
    """Progress bar when stderr is a terminal (or ``console``, a rich Console, is given),
    one log line per interval otherwise."""

    def __init__(self, total_steps: int, start_step: int, enabled: bool = True, console: Any = None):
        self.log = get_logger()
        self.total, self.start_step, self.t0 = total_steps, start_step, time.perf_counter()
        self.progress = None
        if enabled and (console is not None or sys.stderr.isatty()):
            from rich.console import Console
            from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn
            from rich.table import Column

            # The ETA before the status: the status is sized to fit (fit_status), but if the
            # terminal shrinks between updates it is the status that is cut, not the ETA.
            self.progress = Progress(
                TextColumn("step {task.completed}/{task.total}"), BarColumn(bar_width=None),
                TimeRemainingColumn(),
                TextColumn("{task.fields[status]}", table_column=Column(no_wrap=True, overflow="ellipsis")),
                console=console or Console(stderr=True), transient=False)
            self.task = self.progress.add_task("train", total=total_steps, completed=start_step, status="")
            self.progress.start()

    def _status_width(self, step: int) -> int:
        """Columns left for the status fields: the terminal's width minus the step text,
        the smallest bar, the ETA and the one-column gaps between the four columns."""
        step_text = len(f"step {step}/{self.total}")
        return self.progress.console.width - step_text - BAR_MIN - ETA_COLUMNS - 3

    def _eta(self, step: int) -> str | None:
        done = step - self.start_step
        if done <= 0 or step >= self.total:
            return None
        return format_eta((time.perf_counter() - self.t0) / done * (self.total - step))

    def step(self, step: int, record: dict[str, Any]) -> None:
        if self.progress is not None:
            status = fit_status(record, self._status_width(step))
            self.progress.update(self.task, completed=step, status=status)
            return
        eta = self._eta(step)
        head = f"step {step}/{self.total}" + (f" eta {eta}" if eta else "")
        self.log.info(f"{head} {' '.join(t for _, t in status_fields(record))}")

    def advance(self, step: int) -> None:
        if self.progress is not None:
            self.progress.update(self.task, completed=step)

    def message(self, text: str) -> None:
        if self.progress is not None:
            self.progress.console.print(text)
        else:
            self.log.info(text)

    def close(self) -> None:
        if self.progress is not None:
            self.progress.stop()


def validation_message(record: dict[str, Any]) -> str:
    """The console line of a validation record (with early stopping's prediction, if any)."""
    text = f"step {record['step']} val_loss {record['val_loss']:.4f}"
    if record.get("predicted_final_loss") is not None:
        text += (f" (predicted final {record['predicted_final_loss']:.4f} +- {record['predicted_final_loss_std']:.4f}"
                 f", improvement below min_delta from step {record['predicted_stop_step']})")
    return text
