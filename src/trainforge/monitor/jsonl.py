"""The run directory's ``metrics.jsonl``: one JSON record per line (one per optimizer step
at the logging interval, plus validation and checkpoint records), the file every other
view of a run (``trainforge report``, the tests, the benchmarks) reads."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from trainforge.storage.atomic import atomic_write_text


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
        """Keep the records of steps <= ``step`` (call before a sink opens ``path``). The file
        is replaced atomically: a kill midway leaves the old file, never a truncated one."""
        if not path.exists():
            return
        kept = []
        for line in path.read_text().splitlines():
            try:
                if json.loads(line).get("step", 0) <= step:
                    kept.append(line)
            except json.JSONDecodeError:
                continue  # a line torn by a crash mid-write
        atomic_write_text(path, "".join(line + "\n" for line in kept))


def is_number(v: Any) -> bool:
    """A value a record can plot: an int or float, finite, not a bool (a non-finite value
    is written as null, and JSON's true/false are not measurements)."""
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def read_jsonl(path: str | Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]
