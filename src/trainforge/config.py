"""The run configuration: composes the typed section each component declares beside
itself into one ``Config``, loads it from TOML with ``--section.key value`` overrides,
and validates it before any work starts.

Every field's ``help`` metadata is the CLI help (``trainforge train --help``): each key
is an argparse option generated from its section (``config_args.py``), and a value from
the command line gets the same type checks and errors here as one from a TOML file.
Each component receives only its own section (``cfg.training``, ``cfg.data``...),
never the whole ``Config``. A new section is a dataclass beside its component (with a
``validate()``), one field here, and nothing else; only the CLI imports this module (the
components below it must not: ``[tool.importlinter]`` in pyproject.toml).

Where each section lives: ``[model]`` model/section.py; ``[data]`` data/section.py;
``[training]``, ``[optimizer]``, ``[checkpoint]`` train/section.py; ``[adaptive_lr]``,
``[early_stop]``, ``[bad_steps]`` train/control_section.py; ``[qat]`` train/qat_section.py; ``[parallel]``,
``[distributed]`` parallel/section.py; ``[sample]`` infer/section.py; ``[compression]``,
``[precision]``, ``[monitor]`` in their packages' section.py; ``[ema]`` train/ema_section.py.
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import functools
import tomllib
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from trainforge.compression.section import CompressionSection
from trainforge.config_args import ConfigKey, OverrideParser, add_key_arguments, overrides_from, section_keys
from trainforge.config_args import join_values as _join_values
from trainforge.config_base import _require, config_to_dict, config_to_toml  # noqa: F401  (public names)
from trainforge.data.section import AugmentSection, CacheSection, DataSection, is_list_of_tables  # noqa: F401
from trainforge.errors import ConfigError
from trainforge.infer.section import SampleSection
from trainforge.model.section import ModelSection
from trainforge.monitor.section import MonitorSection
from trainforge.parallel.section import DistributedSection, ParallelSection
from trainforge.precision.section import PrecisionSection
from trainforge.train.control_section import AdaptiveLRSection, BadStepsSection, EarlyStopSection
from trainforge.train.ema_section import EMASection
from trainforge.train.offload_section import OffloadSection, check_offload
from trainforge.train.qat_section import QATSection
from trainforge.train.section import CheckpointSection, OptimizerSection, TrainingSection

__all__ = ["AdaptiveLRSection", "AugmentSection", "BadStepsSection", "CacheSection", "CheckpointSection",
           "CompressionSection", "Config", "DataSection", "DistributedSection", "EarlyStopSection", "ModelSection",
           "MonitorSection", "OffloadSection", "OptimizerSection", "ParallelSection", "PrecisionSection", "QATSection",
           "SampleSection", "TrainingSection", "add_config_arguments", "config_from_dict",
           "config_tables", "config_to_dict", "config_to_toml", "join_values", "load_config", "overrides_from",
           "parse_overrides", "read_toml_file", "reject_unknown"]


@dataclass
class Config:
    model: ModelSection = field(default_factory=ModelSection)
    data: DataSection = field(default_factory=DataSection)
    training: TrainingSection = field(default_factory=TrainingSection)
    optimizer: OptimizerSection = field(default_factory=OptimizerSection)
    checkpoint: CheckpointSection = field(default_factory=CheckpointSection)
    parallel: ParallelSection = field(default_factory=ParallelSection)
    distributed: DistributedSection = field(default_factory=DistributedSection)
    sample: SampleSection = field(default_factory=SampleSection)
    compression: CompressionSection = field(default_factory=CompressionSection)
    precision: PrecisionSection = field(default_factory=PrecisionSection)
    adaptive_lr: AdaptiveLRSection = field(default_factory=AdaptiveLRSection)
    early_stop: EarlyStopSection = field(default_factory=EarlyStopSection)
    bad_steps: BadStepsSection = field(default_factory=BadStepsSection)
    monitor: MonitorSection = field(default_factory=MonitorSection)
    qat: QATSection = field(default_factory=QATSection)
    offload: OffloadSection = field(default_factory=OffloadSection)
    ema: EMASection = field(default_factory=EMASection)

    def validate(self) -> "Config":
        for f in dataclasses.fields(self):
            getattr(self, f.name).validate()
        if self.parallel.pp > 1 and any(t.get("name") == "seq_curriculum" for t in self.data.augment.transforms):
            raise ConfigError("config key 'data.augment.transforms': seq_curriculum changes the sequence length, "
                              "which pipeline parallelism (parallel.pp > 1) fixes; remove it or use pp = 1")
        if self.qat.enabled and self.qat.start_step >= self.training.steps:
            raise ConfigError(f"config key 'qat.start_step' = {self.qat.start_step} is not allowed: it must be "
                              f"below training.steps ({self.training.steps}), or no step trains with fake "
                              "quantisation; lower qat.start_step (e.g. to 70% of training.steps) or raise "
                              "training.steps")
        check_offload(self.offload, self.parallel, self.compression, self.precision)
        return self


# ---------------------------------------------------------------------------
# Loading: TOML -> dict -> typed sections, with CLI overrides applied on top.

_TRUE = {"true", "1", "yes", "on"}
_FALSE = {"false", "0", "no", "off"}


def _coerce(key: str, value: Any, tp: Any, from_cli: bool, meta: Any = None) -> Any:
    """Check ``value`` against the annotated type ``tp``; CLI strings are parsed first
    (``meta``: the field's metadata, see ``config_base._f``)."""
    meta = meta or {}
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if value is None or (from_cli and isinstance(value, str) and value.lower() in ("none", "null")):
            return None
        return _coerce(key, value, args[0], from_cli, meta)
    if origin is Literal:
        choices = typing.get_args(tp)
        _require(value in choices, key, value, f"one of {list(choices)}")
        return value
    if tp is list or origin is list:
        # Lists of tables (data.augment.transforms). On the command line the value is TOML text.
        example = meta.get("example", '[{name = "token_replace", p = 0.1}]')
        if from_cli and isinstance(value, str) and "from_text" in meta and not value.lstrip().startswith("["):
            value = meta["from_text"](value, key)
        elif from_cli and isinstance(value, str):
            try:
                value = tomllib.loads(f"v = {value}")["v"]
            except tomllib.TOMLDecodeError as e:
                raise ConfigError(f"config key '{key}' = {value!r} is not a TOML list ({e}); write e.g. "
                                  f"'{example}'") from None
        if is_list_of_tables(value):
            return [dict(v) for v in value]
        raise ConfigError(f"config key '{key}' = {value!r} has the wrong type: expected a list of tables, "
                          f"e.g. {example}")
    try:
        if tp is bool:
            if from_cli and isinstance(value, str) and value.lower() in _TRUE | _FALSE:
                return value.lower() in _TRUE
            if isinstance(value, bool):
                return value
        elif tp is int:
            if from_cli and isinstance(value, str):
                return int(value)
            if isinstance(value, int) and not isinstance(value, bool):
                return value
        elif tp is float:
            if from_cli and isinstance(value, str):
                return float(value)
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                return float(value)
        elif tp is str:
            if isinstance(value, str):
                return value
    except ValueError:
        pass
    raise ConfigError(f"config key '{key}' = {value!r} has the wrong type: expected {getattr(tp, '__name__', tp)}")


def _set(obj: Any, table: str, parts: list[str], value: Any, from_cli: bool) -> None:
    """Set ``table.<parts>`` on the section object ``obj``. A part naming a nested section
    (``data.cache``) descends; a dict value there sets that sub-table's keys."""
    hints = typing.get_type_hints(type(obj))
    name = f"{table}.{parts[0]}"
    if parts[0] not in hints:
        raise ConfigError(f"unknown config key '{name}'{_did_you_mean(parts[0], hints, f'{table}.')}: "
                          f"known keys in [{table}] are {sorted(hints)}")
    tp = hints[parts[0]]
    if dataclasses.is_dataclass(tp):
        sub = getattr(obj, parts[0])
        if len(parts) > 1:
            _set(sub, name, parts[1:], value, from_cli)
            return
        if not isinstance(value, dict):
            raise ConfigError(f"config key '{name}' = {value!r}: it is a table; write [{name}] with keys "
                              f"{sorted(typing.get_type_hints(tp))}, or --{name}.KEY VALUE")
        for key, v in value.items():
            _set(sub, name, [key], v, from_cli)
        return
    if len(parts) > 1:
        raise ConfigError(f"unknown config key '{name}.{'.'.join(parts[1:])}': '{name}' is a value, not a table")
    meta = {f.name: f.metadata for f in dataclasses.fields(obj)}.get(parts[0])
    setattr(obj, parts[0], _coerce(name, value, tp, from_cli, meta))


def _did_you_mean(word: str, known, prefix: str = "") -> str:
    """``" (did you mean 'training.steps'?)"`` for the closest known name, or nothing."""
    close = difflib.get_close_matches(word, list(known), n=1)
    return f" (did you mean '{prefix}{close[0]}'?)" if close else ""


def _apply(cfg: Config, section: str, key: str, value: Any, from_cli: bool) -> None:
    sections = {f.name: f for f in dataclasses.fields(Config)}
    if section not in sections:
        hint = _did_you_mean(section, sections)
        raise ConfigError(f"unknown config section '{section}' (in '{section}.{key}'){hint}: "
                          f"known sections are {sorted(sections)}")
    _set(getattr(cfg, section), section, key.split("."), value, from_cli)


def config_from_dict(data: dict[str, Any], source: str = "config") -> Config:
    """Build a Config from nested ``{section: {key: value}}`` (TOML or JSON shaped);
    a sub-table (``[data.cache]``) is a nested dict.

    Unknown sections/keys and wrong types raise ConfigError; ranges are checked by
    ``Config.validate``, which the caller runs after applying overrides."""
    cfg = Config()
    for section, values in data.items():
        if not isinstance(values, dict):
            raise ConfigError(f"{source}: '{section}' must be a [section] table, got {values!r}")
        for key, value in values.items():
            _apply(cfg, section, key, value, from_cli=False)
    return cfg


def _merge(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    """``over`` on top of ``base``, table by table (a file's [data.cache] keeps the base's other keys)."""
    out = dict(base)
    for key, value in over.items():
        out[key] = _merge(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out


def parse_overrides(args: list[str]) -> list[tuple[str, str, str]]:
    """``["--training.steps", "10", "--model.flavor=debug", "--no-parallel.compile"]`` -> [(section, key, raw)],
    in command-line order (the last of a repeated key wins). Parsed by the same argparse options as
    ``trainforge train`` (``add_config_arguments``), so its help and its parser cannot disagree."""
    parser = OverrideParser(prog="overrides", add_help=False, allow_abbrev=False)
    add_config_arguments(parser)
    ns, extra = parser.parse_known_args(join_values(args))
    reject_unknown(extra)
    return [(*key.split(".", 1), raw) for key, raw in overrides_from(ns)]  # type: ignore[misc]


def read_toml_file(path: Path, what: str) -> dict[str, Any]:
    """The TOML table in ``path``; ConfigError naming the file (and the byte offset of
    bytes that are not UTF-8: TOML is UTF-8 only) when it cannot be read or parsed."""
    try:
        raw = path.read_bytes()
    except OSError as e:
        raise ConfigError(f"{what} {path} could not be read ({e.strerror})") from None
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ConfigError(f"{what} {path} is not UTF-8 text (byte 0x{raw[e.start]:02x} at offset {e.start}); "
                          "save it as UTF-8") from None
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{what} {path} is not valid TOML: {' '.join(str(e).split())}") from None


def load_config(path: str | Path | None = None, overrides: list[str] | None = None,
                base: dict[str, Any] | None = None) -> Config:
    """Resolve a run's config: defaults <- ``base`` dict <- TOML file <- CLI overrides.

    Raises ConfigError naming the key and what is allowed; nothing is written."""
    data: dict[str, Any] = dict(base or {})
    source = "config"
    if path is not None:
        p = Path(path)
        source = str(p)
        if not p.is_file():
            raise ConfigError(f"config file {p} does not exist")
        file_data = read_toml_file(p, "config file")
        data = _merge(data, file_data)
    cfg = config_from_dict(data, source)
    for section, key, raw in parse_overrides(overrides or []):
        _apply(cfg, section, key, raw, from_cli=True)
    return cfg.validate()


# ---------------------------------------------------------------------------
# The command line: one argparse option per key (config_args.py builds them from the sections).


@functools.cache
def config_tables() -> tuple[tuple[str, tuple[ConfigKey, ...]], ...]:
    """Every table of ``Config`` with its keys, in declaration order (what ``train --help`` lists)."""
    cfg = Config()
    out = []
    for f in dataclasses.fields(Config):
        out += [(t, tuple(k)) for t, k in section_keys(f.name, type(getattr(cfg, f.name)), getattr(cfg, f.name))]
    return tuple(out)


def add_config_arguments(parser: argparse.ArgumentParser) -> None:
    """One argument group per table ([model], [data], [data.cache]...) and one option per key:
    ``--section.key VALUE``, and for a boolean ``--section.key`` / ``--no-section.key`` too."""
    add_key_arguments(parser, config_tables())


@functools.cache
def _option_kinds() -> dict[str, bool]:
    """``--section.key`` -> whether it is a boolean."""
    return {f"--{k.key}": k.tp is bool for _, keys in config_tables() for k in keys}


def join_values(args: list[str]) -> list[str]:
    """``config_args.join_values`` for the config keys."""
    return _join_values(args, _option_kinds())


def reject_unknown(extra: list[str], options: list[str] = ()) -> None:
    """ConfigError for the first argument argparse did not match, naming the closest known key
    (or one of ``options``, a command's own)."""
    if not extra:
        return
    arg = extra[0]
    if not arg.startswith("--"):
        raise ConfigError(f"unexpected argument {arg!r}: overrides look like --section.key VALUE")
    name = arg[2:].split("=", 1)[0]
    kinds = _option_kinds()
    if "." in name:
        bare = name[3:] if name.startswith("no-") else name
        section, _, key = bare.partition(".")
        if f"--{bare}" in kinds:  # --no-model.flavor
            raise ConfigError(f"--{name}: '{bare}' is not a boolean; write --{bare} VALUE")
        if key.startswith(("no-", "no_")) and kinds.get(f"--{section}.{key[3:]}"):
            raise ConfigError(f"unknown config key '{bare}': write --no-{section}.{key[3:]} to set "
                              f"'{section}.{key[3:]}' false")
        raw = arg.split("=", 1)[1] if "=" in arg else extra[1] if len(extra) > 1 else ""
        _apply(Config(), section, key, raw, from_cli=True)  # raises, naming the section or key and the closest one
    hint = _did_you_mean(f"--{name}", [*options, *kinds])
    raise ConfigError(f"unknown option '--{name}'{hint}; config overrides look like --section.key VALUE")
