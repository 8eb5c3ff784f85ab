"""The command-line reference (docs/reference/cli.md), generated from the commands' parsers: every
command and every option with its type, allowed values, default and meaning, the same text
``trainforge COMMAND --help`` prints, so the page, the help and the parser cannot disagree.

``python -m trainforge.cli.reference > docs/reference/cli.md`` regenerates it;
tests/test_cli_reference.py fails when the checked-in copy is stale. ``train``'s
``--SECTION.KEY`` options are the config keys, listed on the config-key page."""

from __future__ import annotations

import argparse
import typing

from trainforge.cli import COMMANDS, SUMMARIES, advise, export, generate, plan, prepare, quantize, report, serve, train
from trainforge.cli.options import Command, default_text, options_of, type_text

# The commands in `trainforge --help`'s order; train has its own parser (its keys are the config's).
MODULES = {"prepare": prepare, "train": train, "generate": generate, "quantize": quantize, "serve": serve,
           "export": export, "report": report, "plan": plan, "advise": advise}

_HEADER = [
    "# Command line",
    "",
    "Generated from the commands' parsers by "
    "`python -m trainforge.cli.reference > docs/reference/cli.md`; do not edit by hand.",
    "",
    "Every option is accepted with `_` or `-` between words (`--max_new_tokens` or `--max-new-tokens`); "
    "a flag is set by `--flag` alone, or `--flag true|false`, and one that is not named `no_...` also has "
    "`--no-flag`. Every command but `train` reads its options from a TOML file too (`--config FILE`: "
    "`key = value`, a key is an option's name, the command line overrides it) and prints the resolved "
    "options as that file with `--print_config`. A mistyped option is refused in one line naming the "
    "closest one (exit status 2). `train`'s options are the [config keys](config.md), "
    "`--table.key VALUE`.",
    "",
]


def parser_of(name: str) -> argparse.ArgumentParser:
    mod = MODULES[name]
    return mod.COMMAND.parser() if hasattr(mod, "COMMAND") else mod.parser()


def _cell(text: str) -> str:
    return " ".join(str(text).split()).replace("|", "\\|").replace("%%", "%") or "-"


def _invocation(action: argparse.Action) -> str:
    if not action.option_strings:
        return f"`{action.metavar}`"
    metavar = "" if action.nargs == 0 else f" {action.metavar or action.dest.upper()}"
    return ", ".join(f"`{s}{metavar if i == 0 else ''}`" for i, s in enumerate(action.option_strings))


def _plain_row(action: argparse.Action) -> tuple[str, str, str, str]:
    """(type, allowed values, default, meaning) of an option argparse alone describes."""
    if action.nargs == 0:
        tp = "flag"
    elif action.type is not None:
        tp = action.type.__name__
    else:
        tp = "str"
    default = "" if action.default in (None, False, argparse.SUPPRESS) else str(action.default)
    return tp, ", ".join(map(str, action.choices or [])), default, action.help or ""


def command_rows(name: str) -> list[tuple[str, list[tuple[str, str, str, str, str]]]]:
    """[(group title, [(invocation, type, allowed values, default, meaning)])] of a command's
    parser, the config-key groups of ``train`` left out."""
    mod = MODULES[name]
    command: Command | None = getattr(mod, "COMMAND", None)
    options = {o.name: o for o in options_of(command.sections)} if command else {}
    p = parser_of(name)
    out = []
    for group in p._action_groups:
        rows = []
        for action in group._group_actions:
            if action.help == argparse.SUPPRESS or isinstance(action, argparse._HelpAction):
                continue
            o = options.get(action.dest)
            if o is not None:
                allowed = ", ".join(map(str, typing.get_args(o.tp))) if typing.get_origin(o.tp) is typing.Literal else ""
                tp = "choice" if allowed else type_text(o)
                default = (default_text(o) or "see meaning").removeprefix("default: ")
                rows.append((_invocation(action), tp, allowed, default, o.help))
            else:
                rows.append((_invocation(action), *_plain_row(action)))
        if rows and not (group.title or "").startswith("["):
            out.append((group.title, rows))
    return out


def markdown() -> str:
    lines = list(_HEADER)
    lines.append("| command | what it does |")
    lines.append("|---|---|")
    lines += [f"| [`{n}`](#{n}) | {_cell(SUMMARIES[n])} |" for n in COMMANDS]
    for name in COMMANDS:
        p = parser_of(name)
        lines += ["", f"## trainforge {name} {{#{name}}}", "", _cell(p.description), "", "```text",
                  " ".join(p.format_usage().split()), "```"]
        for title, rows in command_rows(name):
            lines += ["", f"### {title}", "", "| option | type | allowed values | default | meaning |",
                      "|---|---|---|---|---|"]
            lines += ["| " + " | ".join(map(_cell, row)) + " |" for row in rows]
        if name == "train":
            lines += ["", "Every [config key](config.md) is an option too: `--table.key VALUE` "
                          "(`--training.steps 100`), a boolean also `--table.key` / `--no-table.key`."]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    print(markdown(), end="")
