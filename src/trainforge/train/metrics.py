"""Where training metrics go: a JSONL file in the run directory (one record per
optimizer step, plus validation records) and the console (a rich progress bar on
a TTY, plain log lines otherwise). Later sinks (Prometheus, TensorBoard) plug in
beside these."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path
from typing import Any

from trainforge.log import get_logger


class JsonlSink:
    """Append-only JSONL. ``truncate_after(step)`` drops records past a resumed
    checkpoint so the file reads as one uninterrupted run."""

    def __init__(self, path: Path):
        self.path = path
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._fh = open(self.path, "a", buffering=1)

    def write(self, record: dict[str, Any]) -> None:
        clean = {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in record.items()}
        self._fh.write(json.dumps(clean) + "\n")

    def flush(self) -> None:
        self._fh.flush()

    def close(self) -> None:
        self._fh.close()

    @staticmethod
    def truncate_after(path: Path, step: int) -> None:
        if not path.exists():
            return
        kept = []
        for line in path.read_text().splitlines():
            try:
                if json.loads(line).get("step", 0) <= step:
                    kept.append(line)
            except json.JSONDecodeError:
                continue  # a line torn by a crash mid-write
        path.write_text("".join(line + "\n" for line in kept))


def read_jsonl(path: str | Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


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
