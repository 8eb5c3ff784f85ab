"""``trainforge advise``: ranked suggestions from a run's measurements (``plan/advise.py``), the
advised config written (``--output``) and the next run started (``--apply``,
``plan/advise_apply.py``)."""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path

from trainforge.cli.options import Command
from trainforge.config_base import _f
from trainforge.errors import TrainforgeError

ADVISED_FILE = "advised.toml"  # plan/advise.ADVISED_FILE (that module imports torch; --help must not)
DESCRIPTION = ("Ranked suggestions from a run's measurements (step time split, pipeline stages and bubble, comm "
               "share, memory, MFU, data wait, profiler) and optional inference measurements, each with its "
               "evidence and predicted gain. Prints only: --output writes the advised config (the run's config "
               "with the training changes applied, for `trainforge train --config`), --apply writes it and starts "
               "the next run.")


@dataclass
class AdviseOptions:
    run_dir: str = _f("", "a run directory (config.toml + metrics.jsonl)", positional=True, metavar="RUN_DIR")
    inference: list[str] = _f((), "inference measurements: `trainforge generate --stats` JSON, a /metrics scrape of "
                                  "`trainforge serve`, or bench/inference.py --json output (serving advice; KV pool "
                                  "and batch-row advice needs the server's scrape)", nargs="+", metavar="FILE")
    output: str | None = _f(None, "write the advised config (TOML) to FILE (default: write nothing)", metavar="FILE")
    apply: bool = _f(False, f"write the advised config to RUN_DIR/{ADVISED_FILE} (or --output) and start the next "
                            "run from it in RUN_DIR-advised: resumed from the newest checkpoint when every change "
                            "keeps resume exact, else fresh (it says which). Refused while RUN_DIR is still "
                            "training")
    json: bool = _f(False, "print the advice as JSON instead of a table, with every rule checked (pass / fail, "
                           "threshold, measured value)")
    memory_limit_gb: float | None = _f(None, "device memory the peak is compared with (default: the GPU's, or "
                                             "this host's RAM)")
    no_hardware_probe: bool = _f(False, "skip the precision rule (it reads, or measures once, this CPU's "
                                        "bf16/fp16 probe)")


SECTIONS = {"advise": AdviseOptions}
COMMAND = Command("advise", DESCRIPTION, SECTIONS)


def run(argv: list[str]) -> int:
    parsed = COMMAND.parse(argv)
    if parsed is None:
        return 0
    a = parsed.section(AdviseOptions)
    import json

    from trainforge.config import config_from_dict, config_to_toml
    from trainforge.errors import ConfigError
    from trainforge.plan.advice_rules import Context
    from trainforge.plan.advise import advise, device_memory, hardware_capability, render, to_json
    from trainforge.plan.advise_apply import refuse_live_run, start_next_run
    from trainforge.plan.run_evidence import read_run

    run_dir = Path(a.run_dir)
    advised_file = Path(a.output) if a.output else (run_dir / ADVISED_FILE if a.apply else None)
    if advised_file is not None:
        refuse_live_run(run_dir, advised_file, a.apply)
    ev = read_run(run_dir)
    if a.memory_limit_gb is not None:
        if a.memory_limit_gb <= 0:
            raise TrainforgeError(f"--memory_limit_gb {a.memory_limit_gb}: must be > 0")
        limit, source = a.memory_limit_gb * 2**30, "--memory_limit_gb"
    else:
        limit, source = device_memory(ev)
    ctx = Context(limit, source, None if a.no_hardware_probe else hardware_capability(ev))
    advice = advise(run_dir, a.inference, ctx, ev)
    # The Config round trip: the advised config is what `trainforge train --config` reads back.
    try:
        text = config_to_toml(config_from_dict(advice.advised, f"{run_dir}/config.toml + advice").validate())
    except ConfigError as e:
        raise TrainforgeError(f"the advised config does not validate ({e}); report this with {run_dir}/config.toml "
                              "and drop the suggestion by hand") from None
    if a.apply and not advice.applied and not a.output:
        advised_file = None  # nothing to start from: --apply writes nothing either
    if advised_file is not None:
        advised_file.write_text(text, encoding="utf-8")
    if a.json:
        print(json.dumps(to_json(advice, advised_file), indent=1, default=str))
    else:
        render(advice, advised_file)
    if not a.apply:
        return 0
    if not advice.applied:
        print("--apply: no training change to apply; not starting a run", file=sys.stderr)
        return 0
    return start_next_run(advice, run_dir, advised_file, text, json_stdout=a.json)
