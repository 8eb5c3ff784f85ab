"""The run configuration: composes the typed section each component declares beside
itself into one ``Config``, loads it from TOML with ``--section.key value`` overrides,
and validates it before any work starts.

Every field's ``help`` metadata is the CLI help (``trainforge train --help``).
Each component receives only its own section (``cfg.training``, ``cfg.data``...),
never the whole ``Config``. A new section is a dataclass beside its component (with a
``validate()``), one field here, and nothing else; only the CLI imports this module (the
components below it must not: ``[tool.importlinter]`` in pyproject.toml).

Where each section lives: ``[model]`` model/section.py; ``[data]`` data/section.py;
``[training]``, ``[optimizer]``, ``[checkpoint]`` train/section.py; ``[adaptive_lr]``,
``[early_stop]``, ``[bad_steps]`` train/control_section.py; ``[qat]`` train/qat_section.py; ``[parallel]``,
``[distributed]`` parallel/section.py; ``[sample]`` infer/section.py; ``[compression]``,
``[precision]``, ``[monitor]`` in their packages' section.py.
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
from trainforge.config_base import _require, config_to_dict, config_to_toml  # noqa: F401  (public names)
from trainforge.data.section import AugmentSection, CacheSection, DataSection, is_list_of_tables  # noqa: F401
from trainforge.errors import ConfigError
from trainforge.infer.section import SampleSection
from trainforge.model.section import ModelSection
from trainforge.monitor.section import MonitorSection
from trainforge.parallel.section import DistributedSection, ParallelSection
from trainforge.precision.section import PrecisionSection
from trainforge.train.control_section import AdaptiveLRSection, BadStepsSection, EarlyStopSection
from trainforge.train.qat_section import QATSection
from trainforge.train.section import CheckpointSection, OptimizerSection, TrainingSection

__all__ = ["AdaptiveLRSection", "AugmentSection", "BadStepsSection", "CacheSection", "CheckpointSection",
           "CompressionSection", "Config", "DataSection", "DistributedSection", "EarlyStopSection", "ModelSection",
           "MonitorSection", "OptimizerSection", "ParallelSection", "PrecisionSection", "QATSection",
           "SampleSection", "TrainingSection", "add_config_arguments", "config_from_dict", "config_help",
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
        return self


# ---------------------------------------------------------------------------
# Loading: TOML -> dict -> typed sections, with CLI overrides applied on top.

_TRUE = {"true", "1", "yes", "on"}
_FALSE = {"false", "0", "no", "off"}


def _coerce(key: str, value: Any, tp: Any, from_cli: bool) -> Any:
    """Check ``value`` against the annotated type ``tp``; CLI strings are parsed first."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if value is None or (from_cli and isinstance(value, str) and value.lower() in ("none", "null")):
            return None
        return _coerce(key, value, args[0], from_cli)
    if origin is Literal:
        choices = typing.get_args(tp)
        _require(value in choices, key, value, f"one of {list(choices)}")
        return value
    if tp is list or origin is list:
        # Lists of tables (data.augment.transforms). On the command line the value is TOML text.
        if from_cli and isinstance(value, str):
            try:
                value = tomllib.loads(f"v = {value}")["v"]
            except tomllib.TOMLDecodeError as e:
                raise ConfigError(f"config key '{key}' = {value!r} is not a TOML list ({e}); write e.g. "
                                  "'[{name = \"token_replace\", p = 0.1}]'") from None
        if is_list_of_tables(value):
            return [dict(v) for v in value]
        raise ConfigError(f"config key '{key}' = {value!r} has the wrong type: expected a list of tables, "
                          "e.g. [{name = \"token_replace\", p = 0.1}]")
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
    setattr(obj, parts[0], _coerce(name, value, tp, from_cli))


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
    parser = _OverrideParser(prog="overrides", add_help=False, allow_abbrev=False)
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
# The command line: one argparse option per key, generated from the typed sections. argparse only
# matches the option and collects its raw text; _coerce then checks it against the field's type, so a
# key set on the command line and in a TOML file gets the same checks and the same error message.
# Every option's default is SUPPRESS: an option not given leaves the lower layers (defaults, saved run
# config, --config file) alone, which keeps the precedence.

_OVERRIDES = "config_overrides"  # the namespace attribute: [(dotted key, raw text)] in command-line order


class _OverrideParser(argparse.ArgumentParser):
    def error(self, message: str):  # one line and exit 2 (ConfigError), not argparse's usage + SystemExit
        raise ConfigError(message)


def _record(ns: argparse.Namespace, key: str, raw: str) -> None:
    setattr(ns, _OVERRIDES, [*getattr(ns, _OVERRIDES, []), (key, raw)])


class _ValueOption(argparse.Action):
    """``--section.key VALUE`` or ``--section.key=VALUE``."""

    def __call__(self, parser, ns, value, option_string=None):
        _record(ns, self.dest, value)


class _BoolOption(argparse.Action):
    """``--section.key`` (true), ``--no-section.key`` (false), or ``--section.key true|false`` as before."""

    def __call__(self, parser, ns, value, option_string=None):
        if option_string.startswith("--no-"):
            if value is not None:
                raise ConfigError(f"{option_string} takes no value: write {option_string} alone, or "
                                  f"--{self.dest} {value}")
            value = "false"
        _record(ns, self.dest, "true" if value is None else value)


def _plain(tp: Any) -> tuple[Any, bool]:
    """(the type without ``| None``, whether None is allowed)."""
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        return args[0], True
    return tp, False


def _shown(value: Any) -> str:
    """A default as it is written on the command line."""
    if value is None:
        return "none"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, list):
        return repr(value) if value else "[]"
    return str(value)


@dataclass(frozen=True)
class _Key:
    key: str        # dotted: data.cache.dir
    tp: Any         # without | None
    optional: bool
    default: Any
    help: str


def _section_keys(prefix: str, cls: type, obj: Any) -> list[tuple[str, list[_Key]]]:
    """[(table, its keys)] for a section and, after it, each nested table ([data], [data.cache], ...)."""
    hints = typing.get_type_hints(cls)
    keys: list[_Key] = []
    tables: list[tuple[str, list[_Key]]] = []
    for f in dataclasses.fields(cls):
        value = getattr(obj, f.name)
        if dataclasses.is_dataclass(hints[f.name]):
            tables += _section_keys(f"{prefix}.{f.name}", hints[f.name], value)
            continue
        tp, optional = _plain(hints[f.name])
        keys.append(_Key(f"{prefix}.{f.name}", tp, optional, value, f.metadata.get("help", "")))
    return [(prefix, keys), *tables]


@functools.cache
def config_tables() -> tuple[tuple[str, tuple[_Key, ...]], ...]:
    """Every table of ``Config`` with its keys, in declaration order (what ``train --help`` lists)."""
    cfg = Config()
    out = []
    for f in dataclasses.fields(Config):
        out += [(t, tuple(k)) for t, k in _section_keys(f.name, type(getattr(cfg, f.name)), getattr(cfg, f.name))]
    return tuple(out)


def _describe(k: _Key) -> tuple[str | None, str]:
    """(metavar, the help text after the field's own): type, allowed values and default."""
    if typing.get_origin(k.tp) is Literal:
        choices = ", ".join(map(str, typing.get_args(k.tp)))
        return "CHOICE", f"one of: {choices}{', none' if k.optional else ''}; default: {_shown(k.default)}"
    if k.tp is bool:
        return None, f"bool{' or none' if k.optional else ''}; default: {_shown(k.default)}"
    if k.tp is list or typing.get_origin(k.tp) is list:
        return "TOML", f"a TOML list of tables; default: {_shown(k.default)}"
    name = getattr(k.tp, "__name__", str(k.tp))
    return name.upper(), f"{name}{' or none' if k.optional else ''}; default: {_shown(k.default)}"


def add_config_arguments(parser: argparse.ArgumentParser) -> None:
    """One argument group per table ([model], [data], [data.cache]...) and one option per key:
    ``--section.key VALUE``, and for a boolean ``--section.key`` / ``--no-section.key`` too."""
    for table, keys in config_tables():
        group = parser.add_argument_group(f"[{table}]")
        for k in keys:
            metavar, extra = _describe(k)
            text = f"{k.help} ({extra})" if k.help else f"({extra})"
            text = text.replace("%", "%%")  # argparse %-formats help
            if metavar is None:
                group.add_argument(f"--{k.key}", f"--no-{k.key}", dest=k.key, action=_BoolOption, nargs="?",
                                   metavar="BOOL", default=argparse.SUPPRESS, help=text)
            else:
                group.add_argument(f"--{k.key}", dest=k.key, action=_ValueOption, metavar=metavar,
                                   default=argparse.SUPPRESS, help=text)


@functools.cache
def _option_kinds() -> dict[str, bool]:
    """``--section.key`` -> whether it is a boolean."""
    return {f"--{k.key}": k.tp is bool for _, keys in config_tables() for k in keys}


def join_values(args: list[str]) -> list[str]:
    """``--key VALUE`` -> ``--key=VALUE`` for the config keys. argparse takes a value that starts with
    '-' for an option unless it looks like -1 or -.5; joined, -1e-3 and -x stay values as before. A
    boolean takes the next argument only when it is true/false (yes/no/on/off/1/0): ``--parallel.compile
    --model.flavor debug`` sets compile and flavor."""
    kinds, out, i = _option_kinds(), [], 0
    while i < len(args):
        arg = args[i]
        nxt = args[i + 1] if i + 1 < len(args) else None
        if kinds.get(arg) is False and (nxt is None or nxt.startswith("--")):
            raise ConfigError(f"override {arg} has no value: write {arg} VALUE (or {arg}=VALUE for a value "
                              "that starts with --)")
        if arg in kinds and nxt is not None and not nxt.startswith("--") \
                and (not kinds[arg] or nxt.lower() in _TRUE | _FALSE):
            out.append(f"{arg}={nxt}")
            i += 2
            continue
        out.append(arg)
        i += 1
    return out


def overrides_from(ns: argparse.Namespace) -> list[tuple[str, str]]:
    """The (dotted key, raw text) pairs a parser with ``add_config_arguments`` collected, in order."""
    return list(getattr(ns, _OVERRIDES, []))


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


def _help_rows(prefix: str, cls: type) -> list[str]:
    rows = []
    for f in dataclasses.fields(cls):
        if dataclasses.is_dataclass(f.default_factory):  # type: ignore[arg-type]
            rows += _help_rows(f"{prefix}.{f.name}", f.default_factory)  # type: ignore[arg-type]
            continue
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()  # type: ignore[misc]
        rows.append(f"  --{prefix}.{f.name} (default {default!r}): {f.metadata.get('help', '')}")
    return rows


def config_help() -> str:
    """One line per key, for ``trainforge train --help``."""
    rows = []
    for sec_field in dataclasses.fields(Config):
        rows += _help_rows(sec_field.name, sec_field.default_factory)  # type: ignore[arg-type]
    return "\n".join(rows)
