"""Where training progress is shown: the console (a rich progress bar on a TTY, plain
log lines otherwise). The JSONL file and the other sinks live in ``trainforge.monitor``."""

from __future__ import annotations

import sys
from typing import Any

from trainforge.log import get_logger


class ConsoleReporter:
    """Progress bar when stderr is a terminal, one log line per interval otherwise."""

    def __init__(self, total_steps: int, start_step: int, enabled: bool = True):
        self.log = get_logger()
        self.progress = None
        if enabled and sys.stderr.isatty():
            from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn

            self.progress = Progress(TextColumn("step {task.completed}/{task.total}"), BarColumn(),
                                     TextColumn("{task.fields[status]}"), TimeRemainingColumn(), transient=False)
            self.task = self.progress.add_task("train", total=total_steps, completed=start_step, status="")
            self.progress.start()

    def step(self, step: int, record: dict[str, Any]) -> None:
        line = (f"step {step} loss {record['loss']:.4f} lr {record['lr']:.2e} grad_norm {record['grad_norm']:.3f} "
                f"{record['tokens_per_s']:,.0f} tok/s mfu {100 * record['mfu']:.1f}%")
        if self.progress is not None:
            self.progress.update(self.task, completed=step, status=line.split(" ", 2)[2])
        else:
            self.log.info(line)

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
