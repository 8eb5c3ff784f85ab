"""How ``trainforge`` explains itself: the top-level help, ``--version``, "did you mean" for a
mistyped command, and the help formatter every command's parser uses (wrapped to the terminal,
defaults shown). Built on stdlib argparse, not tyro: README "Command line" says why."""

from __future__ import annotations

import argparse
import difflib
import shutil
import textwrap
from importlib import metadata

from trainforge.errors import TrainforgeError


def package_version() -> str:
    """The installed distribution's version; the package's ``__version__`` when run from a source tree."""
    try:
        return metadata.version("trainforge")
    except metadata.PackageNotFoundError:
        from trainforge import __version__

        return __version__


class HelpFormatter(argparse.HelpFormatter):
    """argparse's formatter (it wraps to ``shutil.get_terminal_size()``, i.e. $COLUMNS) with
    "(default: X)" after an option's help. Left out where it says nothing (None, False, an empty
    list) or where the help already names its default (e.g. ``--api_key``'s, read from the
    environment: a secret must not be printed)."""

    def _get_help_string(self, action):
        text = action.help or ""
        default = action.default
        quiet = default is None or default is False or default == [] or default is argparse.SUPPRESS
        if "default" in text or quiet or not action.option_strings:
            return text
        return f"{text} (default: %(default)s)" if text else "(default: %(default)s)"

    # Wrapped at spaces only: a value (interleaved-1f1b) or key (--no-parallel.compile) stays whole.
    def _split_lines(self, text, width):
        return textwrap.wrap(" ".join(text.split()), width, break_on_hyphens=False)

    def _fill_text(self, text, width, indent):
        return textwrap.fill(" ".join(text.split()), width, initial_indent=indent, subsequent_indent=indent,
                             break_on_hyphens=False)

    def _get_default_metavar_for_optional(self, action):
        # The type says more than the name repeated: --max_new_tokens INT, not MAX_NEW_TOKENS.
        return {int: "INT", float: "FLOAT"}.get(action.type) or super()._get_default_metavar_for_optional(action)

    def _format_action_invocation(self, action):
        # A boolean config key: "--parallel.compile, --no-parallel.compile" without repeating [BOOL].
        if action.metavar == "BOOL" and any(o.startswith("--no-") for o in action.option_strings):
            return ", ".join(action.option_strings)
        return super()._format_action_invocation(action)


class ArgumentParser(argparse.ArgumentParser):
    """A command's parser: the help formatter above, no abbreviated options (``--train`` would
    otherwise match ``--training.*``), and a usage error as one line with exit status 2 (a
    ``TrainforgeError``, which ``main`` prints) instead of argparse's usage block."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("formatter_class", HelpFormatter)
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)

    def error(self, message: str):
        raise TrainforgeError(f"{message} (see {self.prog} --help)")


def top_level_help(summaries: dict[str, str]) -> str:
    """``trainforge --help``: each command with one line."""
    indent = max(map(len, summaries)) + 4
    width = max(shutil.get_terminal_size().columns - 2, indent + 20)  # as argparse's own help
    rows = "\n".join(textwrap.fill(line, width, initial_indent=f"  {name}".ljust(indent),
                                   subsequent_indent=" " * indent) for name, line in summaries.items())
    about = textwrap.fill(f"trainforge {package_version()}: PyTorch-native large-model training and inference.", width)
    more = textwrap.fill("`trainforge COMMAND --help` lists a command's options (with their defaults).", width)
    return (f"usage: trainforge [-h] [--version] COMMAND [options]\n\n{about}\n\ncommands:\n{rows}\n\n"
            "options:\n  -h, --help  show this message and exit\n  --version   print the version and exit\n\n"
            f"{more}\n")


def unknown_command(word: str, commands: list[str]) -> str:
    """The one-line error for ``trainforge WORD`` when WORD is no command (or option)."""
    known = ["--help", "--version"] if word.startswith("-") else commands
    close = difflib.get_close_matches(word, known, n=1)
    hint = f"; did you mean '{close[0]}'?" if close else ""
    what = "option" if word.startswith("-") else "command"
    return f"unknown {what} '{word}'{hint} (commands: {', '.join(commands)}; trainforge --help for more)"
