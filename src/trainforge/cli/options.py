"""A command's options from typed sections, as ``trainforge train``'s come from ``config.py``:
each field of a section dataclass (declared with ``config_base._f``: default and help) is one
``--name`` option whose help states its type, allowed values and default; ``--config FILE.toml``
reads the same keys from a file (one flat table: a key is its option's name) and
``--print_config`` prints the resolved options as that file. Precedence, lowest first: the
defaults <- ``--config FILE`` <- the command line.

Field metadata beyond ``help`` (all optional): ``required`` (needed from the command line or the
file), ``nargs="+"`` (a list option: ``--input A B``), ``append`` (repeatable: ``--stop A --stop
B``), ``positional`` (``"+"``: the command's positional arguments, e.g. ``report RUN_DIR...``),
``metavar``, ``env`` (the default is read from this environment variable and never printed) and
``secret`` (never printed by ``--print_config``).

Written for argparse as ``config_args.py`` is (README "Command line" says why not tyro). Imports
nothing heavy: ``trainforge COMMAND --help`` must answer without importing torch."""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import os
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from trainforge.cli.help import ArgumentParser
from trainforge.config_args import _plain  # the type without | None, as the config keys read it
from trainforge.errors import ConfigError

_MODEL = "MODEL"  # the positional's dest: a name no option has (plan has a --model)
_TRUE = {"true", "1", "yes", "on"}
_FALSE = {"false", "0", "no", "off"}


@dataclass(frozen=True)
class Option:
    name: str      # the field, the TOML key and the flag (--name; --na-me is accepted too)
    section: str   # the help group it is listed under
    tp: Any        # the type without | None
    optional: bool
    default: Any
    help: str
    meta: dict

    @property
    def flag(self) -> str:
        return self.name if self.meta.get("positional") else f"--{self.name}"

    @property
    def negatable(self) -> bool:  # --compile / --no-compile (a --no_fuse has no --no-no_fuse)
        return self.tp is bool and not self.name.startswith("no_")


def options_of(sections: dict[str, type]) -> list[Option]:
    """Every field of every section, in declaration order; ``sections``: help group title -> dataclass."""
    out = []
    for title, cls in sections.items():
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            tp, optional = _plain(hints[f.name])
            default = f.default_factory() if f.default is dataclasses.MISSING else f.default
            out.append(Option(f.name, title, tp, optional, default, f.metadata.get("help", ""), dict(f.metadata)))
    names = [o.name for o in out]
    assert len(names) == len(set(names)), f"an option is declared twice: {names}"
    return out


def _shown(value: Any) -> str:
    if value is None:
        return "none"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, (list, tuple)):
        return " ".join(map(str, value)) if value else "none"
    return str(value)


def type_text(o: Option) -> str:
    """The type and allowed values as ``--help`` and the CLI reference state them (a required
    option's None default only means "not given yet")."""
    optional = o.optional and not o.meta.get("required")
    if typing.get_origin(o.tp) is Literal:
        return "one of: " + ", ".join(map(str, typing.get_args(o.tp))) + (", none" if optional else "")
    if o.tp is bool:
        return "flag"
    if typing.get_origin(o.tp) is list:
        inner = typing.get_args(o.tp)[0].__name__
        return f"{inner}, repeatable" if o.meta.get("append") else f"one or more {inner}"
    return o.tp.__name__ + (" or none" if optional else "")


def default_text(o: Option) -> str | None:
    """``default: X`` unless the help already says what the default is (or it is a secret)."""
    if o.meta.get("required"):
        return "required"
    if "default" in o.help or o.meta.get("env"):
        return None
    return f"default: {_shown(o.default)}"


def help_text(o: Option) -> str:
    extra = "; ".join(t for t in (type_text(o), default_text(o)) if t)
    return (f"{o.help} ({extra})" if o.help else f"({extra})").replace("%", "%%")  # argparse %-formats help


def _convert(o: Option, tp: Any):
    def convert(text: str) -> Any:
        # --group_size none unsets a number; text stays text (--prompt none is the word "none")
        if o.optional and tp is not str and text.lower() in ("none", "null"):
            return None
        try:
            return tp(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"invalid {tp.__name__} value: {text!r}") from None
    convert.__name__ = tp.__name__
    return convert


class _Flag(argparse.Action):
    """``--flag`` sets true, ``--no-flag`` false (``normalise`` turns ``--flag=true|false`` into them)."""

    def __call__(self, parser, ns, value, option_string=None):
        setattr(ns, self.dest, not option_string.startswith("--no-"))


def build_parser(prog: str, description: str, options: list[Option], model: bool = False,
                 usage: str | None = None) -> argparse.ArgumentParser:
    """The command's parser: ``--config``, ``--print_config``, then one group per section. Every
    option's default is SUPPRESS (not given: the file's value or the field's default stays).
    ``model``: the checkpoint may be given as the first positional argument too."""
    p = ArgumentParser(prog=prog, description=description, usage=usage)
    if model:
        p.add_argument(_MODEL, nargs="?", default=argparse.SUPPRESS, metavar="MODEL",
                       help="the model: a trainforge checkpoint or run directory, a Hugging Face directory or a "
                            "GGUF file (the same as --checkpoint)")
    for o in options:
        if o.meta.get("positional"):
            nargs = None if o.meta["positional"] is True else o.meta["positional"]
            p.add_argument(o.name, nargs=nargs, metavar=o.meta.get("metavar", o.name.upper()),
                           default=argparse.SUPPRESS, help=help_text(o))
    p.add_argument("--config", default=None, metavar="FILE",
                   help="TOML file of these options (key = value, a key is an option's name); the command line "
                        "overrides it")
    p.add_argument("--print_config", action="store_true",
                   help="print the resolved options as TOML (what --config reads back) and exit")
    groups: dict[str, Any] = {}
    for o in options:
        if o.meta.get("positional"):
            continue
        g = groups.get(o.section) or groups.setdefault(o.section, p.add_argument_group(o.section))
        kw: dict[str, Any] = {"dest": o.name, "default": argparse.SUPPRESS, "help": help_text(o)}
        if o.tp is bool:
            if o.negatable:
                g.add_argument(o.flag, f"--no-{o.name}", action=_Flag, nargs=0, **kw)
            else:  # --no_fuse: its false form (what --no_fuse=false means) stays out of the help
                g.add_argument(o.flag, action=_Flag, nargs=0, **kw)
                g.add_argument(f"--no-{o.name}", action=_Flag, nargs=0, dest=o.name, default=argparse.SUPPRESS,
                               help=argparse.SUPPRESS)
            continue
        tp = o.tp
        if typing.get_origin(tp) is list:
            tp = typing.get_args(tp)[0]
            if o.meta.get("append"):
                kw["action"] = "append"  # --stop A --stop B
            else:
                kw["nargs"] = "+"  # --input A B
        if typing.get_origin(tp) is Literal:
            kw["choices"] = list(typing.get_args(tp))
            kw["metavar"] = o.meta.get("metavar", "{" + ",".join(kw["choices"]) + "}")
        else:
            kw["type"] = _convert(o, tp)
            kw["metavar"] = o.meta.get("metavar", tp.__name__.upper())
        g.add_argument(o.flag, **kw)
    return p


def dash_names(argv: list[str], known: typing.Container[str] = ()) -> list[str]:
    """``--max-new-tokens`` -> ``--max_new_tokens`` (vLLM's parser maps them alike). A leading
    ``no-`` stays the negation (``--no-parallel.compile``) unless ``known`` holds the underscored
    flag (``--no-fuse`` -> ``--no_fuse``). Values are left alone, and everything after ``--``."""
    out: list[str] = []
    for i, arg in enumerate(argv):
        if arg == "--":
            return out + argv[i:]
        if not arg.startswith("--") or len(arg) == 2:
            out.append(arg)
            continue
        name, eq, value = arg[2:].partition("=")
        flag = "--" + name.replace("-", "_")
        if name.startswith("no-") and flag not in known:
            flag = "--no-" + name[3:].replace("-", "_")
        out.append(flag + eq + value)
    return out


def normalise(argv: list[str], options: list[Option], extra_flags: typing.Iterable[str] = ()) -> list[str]:
    """``dash_names``, then a flag's value form: ``--compile=false`` / ``--compile false`` ->
    ``--no-compile`` and ``--no_compile`` -> ``--no-compile``, so a bare flag never takes the next
    argument (``generate --compile CHECKPOINT``) and a config file's true can be turned off."""
    by_flag = {o.flag: o for o in options if not o.meta.get("positional")}
    argv = dash_names(argv, set(by_flag) | set(extra_flags))
    out: list[str] = []
    i = 0
    while i < len(argv):
        arg = argv[i]
        if arg == "--":
            return out + argv[i:]
        name, eq, value = arg.partition("=")
        o = by_flag.get(name)
        if o is None and name.startswith("--no_") and (b := by_flag.get("--" + name[5:])) is not None \
                and b.negatable:
            out.append(f"--no-{b.name}")
            i += 1
            continue
        if o is not None and o.tp is bool:
            nxt = argv[i + 1] if i + 1 < len(argv) else ""
            if not eq and nxt.lower() in _TRUE | _FALSE:
                value, eq = nxt, "="
                i += 1
            if eq:
                if value.lower() not in _TRUE | _FALSE:
                    raise ConfigError(f"{name}={value}: a flag is true or false; write {name} alone, or "
                                      f"{name}=false")
                arg = name if value.lower() in _TRUE else f"--no-{o.name}"
        out.append(arg)
        i += 1
    return out


def _did_you_mean(word: str, known: typing.Iterable[str]) -> str:
    close = difflib.get_close_matches(word, list(known), n=1)
    return f"; did you mean '{close[0]}'?" if close else ""


def reject_unknown(extra: list[str], parser: argparse.ArgumentParser) -> None:
    """One line for the first argument the parser did not match, naming the closest option."""
    if not extra:
        return
    arg = extra[0]
    flags = [s for a in parser._actions if a.help != argparse.SUPPRESS for s in a.option_strings]
    if not arg.startswith("-"):
        raise ConfigError(f"unexpected argument {arg!r} (see {parser.prog} --help)")
    name = arg.split("=", 1)[0]
    raise ConfigError(f"unknown option '{name}'{_did_you_mean(name, flags)} (see {parser.prog} --help)")


def _coerce(o: Option, value: Any, source: str) -> Any:
    """A TOML value checked against the option's type, as the command line's would be."""
    tp = o.tp
    ok = False
    if typing.get_origin(tp) is Literal:
        ok = value in typing.get_args(tp)
        want = f"one of {list(typing.get_args(tp))}"
    elif typing.get_origin(tp) is list:
        ok = isinstance(value, list) and all(isinstance(v, str) for v in value)
        want = "a list of strings"
    elif tp is float:
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
        value = float(value) if ok else value
        want = "a number"
    else:
        ok = isinstance(value, tp) and (tp is bool or not isinstance(value, bool))
        want = {bool: "true or false", int: "an integer", str: "a string"}.get(tp, tp.__name__)
    if not ok:
        raise ConfigError(f"{source}: '{o.name}' = {value!r} is not allowed: {want} (as --{o.name})")
    return value


def read_options_file(path: str, options: list[Option]) -> dict[str, Any]:
    """``--config FILE``: its keys, type-checked; an unknown key is refused naming the closest."""
    from trainforge.config import read_toml_file

    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"--config {p}: no such file")
    by_name = {o.name: o for o in options}
    out = {}
    for key, value in read_toml_file(p, "--config file").items():
        key = key.replace("-", "_")
        if key not in by_name:
            raise ConfigError(f"--config {p}: unknown key '{key}'{_did_you_mean(key, by_name)} (its keys are the "
                              "command's option names)")
        out[key] = _coerce(by_name[key], value, f"--config {p}")
    return out


@dataclass
class Parsed:
    """The resolved options: ``values`` by name and one instance of each section dataclass
    (``section(cls)``)."""
    values: dict[str, Any]
    sections: dict[type, Any]
    print_config: bool

    def section(self, cls: type) -> Any:
        return self.sections[cls]


def parse(parser: argparse.ArgumentParser, sections: dict[str, type], argv: list[str],
          model: str | None = None) -> Parsed:
    """argv -> the options: defaults <- ``--config`` <- command line. ``model``: the option a
    positional MODEL stands for (``checkpoint``). Refuses an unknown option in one line."""
    options = options_of(sections)
    ns, extra = parser.parse_known_args(normalise(argv, options, ["--config", "--print_config", "--help"]))
    reject_unknown(extra, parser)
    given = {k: v for k, v in vars(ns).items() if k not in ("config", "print_config", _MODEL)}
    positional = getattr(ns, _MODEL, None)
    if model and positional is not None:
        if given.get(model) not in (None, positional):
            raise ConfigError(f"the model is given twice ({positional} and --{model} {given[model]}); give one")
        given[model] = positional
    values = {o.name: (os.environ.get(o.meta["env"], o.default) if o.meta.get("env") else o.default)
              for o in options}
    if ns.config:
        values.update(read_options_file(ns.config, options))
    values.update(given)
    for o in options:
        if typing.get_origin(o.tp) is list and isinstance(values[o.name], tuple):
            values[o.name] = list(values[o.name])
    missing = [o.flag for o in options if o.meta.get("required") and values[o.name] in (None, [])]
    if missing and not ns.print_config:
        also = " (or as the first argument)" if model in {m.lstrip("-") for m in missing} else ""
        raise ConfigError(f"the following arguments are required: {', '.join(missing)}{also}")
    built = {cls: cls(**{f.name: values[f.name] for f in dataclasses.fields(cls)}) for cls in sections.values()}
    return Parsed(values, built, ns.print_config)


def options_toml(parsed: Parsed, sections: dict[str, type], command: str) -> str:
    """``--print_config``: the resolved options as the TOML ``--config`` reads (unset and secret
    ones left out: TOML has no null, and a key must not be printed)."""
    import tomli_w

    lines = [f"# resolved options: `trainforge {command} --config FILE` reads this file\n"]
    for o in options_of(sections):
        value = parsed.values[o.name]
        if value is None or o.meta.get("secret") or o.meta.get("env") or value == []:
            continue
        lines.append(tomli_w.dumps({o.name: value}))
    return "".join(lines)


@dataclass(frozen=True)
class Command:
    """A command whose options are typed sections: ``sections`` (help group title -> dataclass),
    ``model``: the option a positional MODEL stands for (``checkpoint``), if any."""
    name: str
    description: str
    sections: dict[str, type]
    model: str | None = None

    def parser(self) -> argparse.ArgumentParser:
        return build_parser(f"trainforge {self.name}", self.description, options_of(self.sections),
                            model=self.model is not None)

    def parse(self, argv: list[str]) -> Parsed | None:
        """argv -> the options; ``None`` when ``--print_config`` printed them (the command then
        does nothing more)."""
        parsed = parse(self.parser(), self.sections, argv, self.model)
        if parsed.print_config:
            print(options_toml(parsed, self.sections, self.name), end="")
            return None
        return parsed
