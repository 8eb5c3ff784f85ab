"""docs/reference/config.md is generated from the typed config sections: the checked-in copy is
what the code generates, and it names every table and every key with its type and default."""

import dataclasses
import typing
from pathlib import Path

from trainforge.config import Config
from trainforge.config_reference import markdown, tables

REPO = Path(__file__).resolve().parents[1]


def test_checked_in_config_reference_is_current():
    assert (REPO / "docs" / "reference" / "config.md").read_text() == markdown(), \
        "regenerate: python -m trainforge.config_reference > docs/reference/config.md"


def _every_key(cls: type, prefix: str = "") -> list[str]:
    hints = typing.get_type_hints(cls)
    out = []
    for f in dataclasses.fields(cls):
        name = f"{prefix}.{f.name}" if prefix else f.name
        out += _every_key(hints[f.name], name) if dataclasses.is_dataclass(hints[f.name]) else [name]
    return out


def test_every_section_and_key_appears_with_its_default():
    page = markdown()
    keys = _every_key(Config)
    sections = {k.rsplit(".", 1)[0] for k in keys}
    assert {"model", "data", "data.cache", "data.augment", "training", "parallel", "monitor", "qat"} <= sections
    for section in sections:
        assert f"## [{section}]" in page, section
    documented = [k for _, ks in tables() for k in ks]
    assert sorted(k.key for k in documented) == sorted(keys)
    for k in documented:
        assert f"| `{k.key}` | {k.type} |" in page, k.key
        assert k.meaning, f"config key {k.key} has no help text: give its field a help string"


def test_a_choice_key_lists_its_values_and_default():
    row = next(line for line in markdown().splitlines() if line.startswith("| `training.lr_schedule` |"))
    assert "`cosine`, `wsd`, `linear`, `constant`" in row and '`"cosine"`' in row
