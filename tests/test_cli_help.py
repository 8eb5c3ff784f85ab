"""The CLI explains itself: top-level help, --version, "did you mean", train --help by section
with types, defaults and choices, --flag / --no-flag booleans, --print_config, defaults in every
command's help. Everything here parses arguments only: no model is built, nothing is trained."""

import subprocess
import sys
import tomllib
import typing
from importlib import metadata

import pytest

from trainforge.cli import COMMANDS, SUMMARIES, main
from trainforge.config import Config, config_tables, config_to_toml, load_config


def run(capsys, *argv) -> tuple[int, str, str]:
    capsys.readouterr()
    try:
        rc = main(list(argv))
    except SystemExit as e:  # argparse's --help
        rc = e.code
    got = capsys.readouterr()
    return rc, got.out, got.err


def test_top_level_help_lists_every_command_on_stdout(capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "60")
    rc, out, err = run(capsys, "--help")
    assert rc == 0 and err == ""
    assert max(map(len, out.splitlines())) <= 60  # wrapped to the terminal
    for name in COMMANDS:
        assert any(line.split()[:1] == [name] for line in out.splitlines()), name
    assert SUMMARIES.keys() == COMMANDS.keys()
    # No command: the same help, and a line saying one is needed (exit 2).
    rc, out2, err = run(capsys)
    assert rc == 2 and out2 == out and "no command given" in err


def test_python_m_trainforge_help():
    r = subprocess.run([sys.executable, "-m", "trainforge", "--help"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert "commands:" in r.stdout and "generate" in r.stdout and "--version" in r.stdout


def test_version(capsys):
    rc, out, _ = run(capsys, "--version")
    assert rc == 0 and out == f"trainforge {metadata.version('trainforge')}\n"


@pytest.mark.parametrize("argv, needles", [
    (["trian"], ["unknown command 'trian'", "did you mean 'train'"]),
    (["--verison"], ["did you mean '--version'"]),
    (["train", "--training.step", "5"], ["unknown config key 'training.step'", "did you mean 'training.steps'"]),
    (["train", "--training.step=5"], ["unknown config key 'training.step'", "did you mean 'training.steps'"]),
    (["train", "--data.cache.memroy_mb", "1"], ["'data.cache.memroy_mb'", "did you mean 'data.cache.memory_mb'"]),
    (["train", "--trainig.steps", "5"], ["unknown config section 'trainig'", "did you mean 'training'"]),
    (["train", "--print_confg"], ["unknown option '--print_confg'", "did you mean '--print_config'"]),
    (["train", "--parallel.no-compile"], ["--no-parallel.compile"]),
    (["train", "--no-model.flavor"], ["'model.flavor' is not a boolean"]),
    (["train", "--training.steps"], ["override --training.steps has no value"]),
    (["train", "--training.steps", "--model.flavor", "debug"], ["override --training.steps has no value"]),
    (["train", "stray"], ["unexpected argument 'stray'"]),
    (["train", "--config"], ["--config: expected one argument"]),
])
def test_mistakes_get_one_line_naming_the_fix(capsys, tmp_path, monkeypatch, argv, needles):
    monkeypatch.chdir(tmp_path)
    rc, out, err = run(capsys, *argv)
    assert rc == 2 and out == ""
    assert len(err.strip().splitlines()) == 1, err
    for needle in needles:
        assert needle in err
    assert list(tmp_path.iterdir()) == []  # no runs/ directory


def _blocks(help_text: str) -> dict[str, str]:
    """``--section.key`` -> its help, whitespace collapsed (argparse wraps it over lines)."""
    out, key = {}, None
    for line in help_text.splitlines():
        if line.startswith("  --"):
            key = line.split()[0].rstrip(",")
            out[key] = " ".join(line.split()[1:])
        elif line.startswith("      ") and key:
            out[key] += " " + " ".join(line.split())
        else:
            key = None
    return out


def test_train_help_has_every_key_by_section_with_type_default_choices_and_meaning(capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "80")
    rc, out, _ = run(capsys, "train", "--help")
    assert rc == 0
    assert max(map(len, out.splitlines())) <= 80
    blocks = _blocks(out)
    at = -1
    for table, keys in config_tables():
        assert f"\n[{table}]:\n" in out
        assert out.index(f"\n[{table}]:\n") > at, f"[{table}] out of order"
        at = out.index(f"\n[{table}]:\n")
        for k in keys:
            text = blocks[f"--{k.key}"]
            assert " ".join(k.help.split()) in text, k.key  # the field's meaning
            if typing.get_origin(k.tp) is typing.Literal:
                assert "one of: " + ", ".join(typing.get_args(k.tp)) in text, k.key
            shown = "none" if k.default is None else str(k.default).lower() if k.tp is bool else k.default
            if not isinstance(shown, list):  # (a default longer than a line is cut: compare without spaces)
                assert f"default:{shown})".replace(" ", "") in text.replace(" ", ""), k.key
    assert blocks["--training.steps"].startswith("INT ") and "(int; default: 300)" in blocks["--training.steps"]
    assert blocks["--model.dim"].startswith("INT ") and "int or none" in blocks["--model.dim"]
    assert "--parallel.compile, --no-parallel.compile" in out
    assert "(bool; default: false)" in blocks["--parallel.compile"]
    assert "one of: gpipe, 1f1b, interleaved-1f1b, zbv, dualpipev; default: 1f1b" in blocks["--parallel.pp_schedule"]


def printed(capsys, tmp_path, *argv) -> Config:
    """``train --print_config ...`` -> the Config its TOML output loads back to (nothing else written)."""
    rc, out, err = run(capsys, "train", "--print_config", *argv)
    assert rc == 0, err
    assert tomllib.loads(out)  # TOML text, nothing else on stdout
    path = tmp_path / f"printed{len(list(tmp_path.glob('printed*')))}.toml"
    path.write_text(out)
    return load_config(path)


def test_print_config_round_trips_and_builds_nothing(capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    over = ["--training.steps", "9", "--model.flavor=debug", "--parallel.dp_shard", "-1", "--sample.prompt", "-x",
            "--data.augment.transforms", '[{name = "token_replace", p = 0.1}]', "--bad_steps.enabled", "true"]
    cfg = printed(capsys, tmp_path, *over)
    assert cfg == load_config(None, over)
    assert cfg.training.steps == 9 and cfg.sample.prompt == "-x" and cfg.parallel.dp_shard == -1
    assert cfg.data.augment.transforms == [{"name": "token_replace", "p": 0.1}] and cfg.bad_steps.enabled is True
    assert printed(capsys, tmp_path) == Config()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["printed0.toml", "printed1.toml"]  # no runs/


def test_precedence_defaults_saved_run_config_file_cli(capsys, tmp_path):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    saved = load_config(None, ["--training.steps", "11", "--training.lr", "0.002", "--optimizer.beta2", "0.9"])
    (run_dir / "config.toml").write_text(config_to_toml(saved))
    file = tmp_path / "over.toml"
    file.write_text("[training]\nlr = 0.005\nseed = 4\n")
    cfg = printed(capsys, tmp_path, "--resume", str(run_dir), "--config", str(file), "--training.seed", "5")
    # saved run config over the defaults, the file over it, the command line over the file;
    # keys the command line does not name keep the lower layer's value.
    assert (cfg.training.steps, cfg.training.lr, cfg.training.seed, cfg.optimizer.beta2) == (11, 0.005, 5, 0.9)
    assert cfg.training.batch_size == Config().training.batch_size


@pytest.mark.parametrize("argv, compile_", [
    (["--parallel.compile"], True),
    (["--parallel.compile", "--model.flavor", "debug"], True),
    (["--parallel.compile", "false"], False),       # the --key true/false form still works
    (["--parallel.compile=true"], True),
    (["--parallel.compile", "--no-parallel.compile"], False),  # the last one wins
    ([], True),                                      # the file's value (below) stays
    (["--no-parallel.compile"], False),
])
def test_boolean_flags(capsys, tmp_path, argv, compile_):
    file = tmp_path / "c.toml"
    file.write_text("[parallel]\ncompile = true\n")
    cfg = printed(capsys, tmp_path, "--config", str(file), *argv)
    assert cfg.parallel.compile is compile_
    assert load_config(file, argv).parallel.compile is compile_  # load_config reads the same forms
    if "--model.flavor" in argv:
        assert cfg.model.flavor == "debug"


def test_bare_boolean_does_not_swallow_the_next_override(capsys):
    rc, _, err = run(capsys, "train", "--parallel.compile", "--model.flavor", "nope")
    assert rc == 2 and "config key 'model.flavor' = 'nope' is not allowed" in err


@pytest.mark.parametrize("command, option, needle", [
    ("generate", "--max_new_tokens", "(int; default: 64)"),
    ("generate", "--device", "(str; default: cpu)"),
    ("generate", "--dtype", "(one of: float32, bfloat16, float16; default: float32)"),
    ("serve", "--port", "(int; default: 8000)"),
    ("serve", "--max_batch_size", "(int; default: 8)"),
    ("prepare", "--vocab_size", "(int; default: 8192)"),
    ("quantize", "--group_size", "default: a QAT checkpoint's, else 128"),  # the help's own words, not "None"
    ("quantize", "--mode", "(one of: int8, int4, q8_0, q4_0; required)"),
    ("export", "--max_shard_gb", "(float; default: 5.0)"),
    ("plan", "--top", "(int; default: 10)"),
    ("advise", "--memory_limit_gb", "default: the GPU's, or this host's RAM"),
    ("report", "--out", "(default RUN_DIR/report.html; several runs"),
    ("report", "--x", "(default step)"),
])
def test_every_command_help_shows_defaults(capsys, monkeypatch, command, option, needle):
    monkeypatch.setenv("COLUMNS", "100")
    monkeypatch.setenv("TRAINFORGE_API_KEY", "s3cret")
    rc, out, _ = run(capsys, command, "--help")
    assert rc == 0
    assert needle in _blocks(out)[option]
    assert "default: None" not in out and "default: False" not in out and "default: ()" not in out
    assert "s3cret" not in out  # serve's --api_key default comes from the environment: never printed
