"""``trainforge <command>``: one module per command (``cli/train.py``, ``cli/generate.py``...),
each of which parses its options and calls into the packages.

User errors (config, data, checkpoints) print one line naming the key or file and the fix,
and exit with status 2; no traceback, nothing half-written. Every outcome has its own exit
code: ``exit_codes.py``. Importing this package imports no torch: ``--help`` answers at once.
"""

from __future__ import annotations

import errno
import sys

from trainforge import exit_codes
from trainforge.cli import advise, export, generate, plan, prepare, quantize, report, serve, train
from trainforge.cli.help import package_version, top_level_help, unknown_command
from trainforge.errors import TrainforgeError

COMMANDS = {"prepare": prepare.run, "train": train.run, "generate": generate.run, "quantize": quantize.run,
            "serve": serve.run, "export": export.run, "report": report.run, "plan": plan.run,
            "advise": advise.run}
# One line each for `trainforge --help`.
SUMMARIES = {
    "prepare": "tokenise text into memory-mappable shards with a manifest",
    "train": "train a model (a TOML config + --section.key overrides)",
    "generate": "generate text from a checkpoint with the inference engine",
    "quantize": "write an int8 / int4 checkpoint that generate and serve load",
    "export": "write a checkpoint as a Hugging Face directory (for vLLM)",
    "serve": "OpenAI-compatible HTTP server with continuous batching",
    "report": "write an HTML report of one or several runs (overlaid, config diff)",
    "plan": "rank parallel layouts of a model on a cluster by predicted step time",
    "advise": "ranked suggestions from a run's measurements (--output: advised config; --apply: next run)",
}


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(top_level_help(SUMMARIES), end="")
        if not argv:
            print("trainforge: error: no command given; choose one of the commands above", file=sys.stderr)
        return 0 if argv else exit_codes.BAD_INPUT
    if argv[0] == "--version":
        print(f"trainforge {package_version()}")
        return 0
    if argv[0] not in COMMANDS:
        print(f"trainforge: error: {unknown_command(argv[0], list(COMMANDS))}", file=sys.stderr)
        return exit_codes.BAD_INPUT
    try:
        return COMMANDS[argv[0]](argv[1:])
    except TrainforgeError as e:
        print(f"trainforge {argv[0]}: error: {e}", file=sys.stderr)
        return getattr(e, "exit_code", exit_codes.BAD_INPUT)  # a diverged loss or a failed peer say so
    except OSError as e:
        # A full or read-only disk mid-run (checkpoint, metrics) is the user's to fix: one line naming the
        # path. Checkpoints are written to a hidden .tmp directory and renamed, so earlier ones stay intact.
        if e.errno not in (errno.ENOSPC, errno.EDQUOT, errno.EROFS):
            raise
        where = f" writing {e.filename}" if e.filename else ""
        fix = "mount is read-only" if e.errno == errno.EROFS else "disk is full: free space"
        print(f"trainforge {argv[0]}: error: {e.strerror}{where}; the {fix} (or choose another directory) "
              "and run again", file=sys.stderr)
        return exit_codes.BAD_INPUT
