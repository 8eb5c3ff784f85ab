"""``trainforge report``: an HTML report of one or several runs (``monitor/report.py``)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from trainforge.cli.options import Command
from trainforge.config_base import _f
from trainforge.monitor.report import COMPARE_FILE

DESCRIPTION = ("Write an HTML report of one or several runs' metrics, overlaid (plots embedded; no server needed), "
               "with the runs' config differences.")


@dataclass
class ReportOptions:
    run_dirs: list[str] = _f((), "run directories (each holds metrics.jsonl)", positional="+", metavar="RUN_DIR")
    out: str | None = _f(None, f"output file (default RUN_DIR/report.html; several runs: "
                               f"FIRST_RUN_DIR/{COMPARE_FILE})", metavar="FILE")
    smooth: float = _f(0.0, "EMA smoothing weight in [0, 1), as TensorBoard's slider; raw values stay drawn faint "
                            "(default 0: off)", metavar="WEIGHT")
    x: Literal["step", "time"] = _f("step", "x axis: step, or time = wall-clock seconds since the run's first "
                                            "step (default step)")  # monitor/report.X_AXES


SECTIONS = {"report": ReportOptions}
COMMAND = Command("report", DESCRIPTION, SECTIONS)


def run(argv: list[str]) -> int:
    parsed = COMMAND.parse(argv)
    if parsed is None:
        return 0
    a = parsed.section(ReportOptions)
    from trainforge.monitor.report import write_report

    if a.out is not None:
        from trainforge.storage.output_paths import refuse_overlap

        # A new file beside a run's files is the default (RUN_DIR/report.html); one of the files read is not.
        refuse_overlap(a.out, "--out", [(what, Path(d) / f) for d in a.run_dirs
                                        for what, f in (("RUN_DIR", ""), ("RUN_DIR's", "metrics.jsonl"),
                                                        ("RUN_DIR's", "config.toml"))], allow_inside=True)
    print(f"report: {write_report(a.run_dirs, a.out, smooth=a.smooth, x=a.x)}")
    return 0
