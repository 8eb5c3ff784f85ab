"""docs/reference/cli.md is generated from the commands' parsers and names every option of every
command with its type, allowed values and default."""

import argparse
from pathlib import Path

from trainforge.cli import COMMANDS
from trainforge.cli.reference import command_rows, markdown, parser_of
from trainforge.config import config_tables

PAGE = Path(__file__).resolve().parents[1] / "docs" / "reference" / "cli.md"


def test_checked_in_page_is_the_generated_one():
    assert PAGE.read_text() == markdown(), "regenerate: python -m trainforge.cli.reference > docs/reference/cli.md"


def test_every_option_of_every_command_parser_is_on_the_page():
    page = markdown()
    config_keys = {f"--{k.key}" for _, keys in config_tables() for k in keys}
    for name in COMMANDS:
        assert f"## trainforge {name} " in page, name
        section = page.split(f"## trainforge {name} ", 1)[1].split("\n## ", 1)[0]
        for action in parser_of(name)._actions:
            if action.help == argparse.SUPPRESS or isinstance(action, argparse._HelpAction):
                continue
            if name == "train" and set(action.option_strings) & (config_keys | {f"--no-{k[2:]}" for k in config_keys}):
                continue  # the config keys: docs/reference/config.md
            strings = action.option_strings or [action.metavar]
            for s in strings:
                assert f"`{s}" in section, (name, s)


def test_rows_state_type_choices_and_default():
    rows = {r[0].split()[0].strip("`,"): r for _, group in command_rows("generate") for r in group}
    assert rows["--max_new_tokens"][1:4] == ("int", "", "64")
    assert rows["--dtype"][1:4] == ("choice", "float32, bfloat16, float16", "float32")
    assert rows["--compile"][1] == "flag" and rows["--compile"][3] == "false"
    assert rows["--checkpoint"][3] == "required"
    serve = {r[0].split()[0].strip("`,"): r for _, group in command_rows("serve") for r in group}
    assert serve["--port"][1:4] == ("int", "", "8000")
    assert serve["--api_key"][3] == "see meaning"  # read from $TRAINFORGE_API_KEY: never printed
