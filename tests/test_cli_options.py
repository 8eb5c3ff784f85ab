"""Every command's options come from typed sections: a fast --help without torch, did-you-mean for a
mistyped option, --config FILE / --print_config, `-` or `_` between words, the model as a
positional argument, flags as flags. Everything here parses arguments only: no model is loaded."""

import json
import subprocess
import sys
import tomllib

import pytest

from trainforge.cli import COMMANDS, main
from trainforge.cli.options import options_of

from tests.test_cli_help import run
from trainforge.cli import advise, export, generate, plan, prepare, quantize, report, serve

# The typed commands, each with the least it needs to resolve its options.
MINIMAL = {
    "prepare": ["--output", "shards"],
    "generate": ["ckpt", "--prompt", "hi"],
    "quantize": ["ckpt", "--output", "q", "--mode", "int8"],
    "serve": ["ckpt"],
    "export": ["ckpt", "--output", "hf"],
    "report": ["run1"],
    "plan": ["--model", "debug", "--gpus", "2"],
    "advise": ["run1"],
}
MODULES = {"prepare": prepare, "generate": generate, "quantize": quantize, "serve": serve, "export": export,
           "report": report, "plan": plan, "advise": advise}



def printed(capsys, command, *argv) -> dict:
    rc, out, err = run(capsys, command, *argv, "--print_config")
    assert rc == 0 and err == "", err
    return tomllib.loads(out)


def test_every_command_answers_help_fast_without_importing_torch():
    """In a fresh interpreter: `trainforge COMMAND --help` for every command imports no torch and
    takes well under a second (measured 0.09-0.14 s each on a 2-core machine, interpreter start
    excluded; the bound leaves room for a loaded machine)."""
    code = (
        "import contextlib, io, json, sys, time\n"
        "t0 = time.perf_counter()\n"
        "from trainforge.cli import COMMANDS, main\n"
        "out = {}\n"
        "for name in COMMANDS:\n"
        "    t = time.perf_counter()\n"
        "    with contextlib.redirect_stdout(io.StringIO()) as buf:\n"
        "        try:\n"
        "            main([name, '--help'])\n"
        "        except SystemExit:\n"
        "            pass\n"
        "    out[name] = [time.perf_counter() - t, 'torch' in sys.modules, len(buf.getvalue())]\n"
        "out['import'] = [t - t0, 'torch' in sys.modules, 0]\n"
        "print(json.dumps(out))\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    got = json.loads(r.stdout)
    assert set(got) == {*COMMANDS, "import"}
    for name, (seconds, torch_loaded, chars) in got.items():
        assert not torch_loaded, f"{name} --help imported torch"
        assert seconds < 1.0, f"{name} --help took {seconds:.2f} s"
        assert name == "import" or chars > 200, name


@pytest.mark.parametrize("argv, needle", [
    (["generate", "ckpt", "--max_new_tokns", "5"], "unknown option '--max_new_tokns'; did you mean '--max_new_tokens'?"),
    (["serve", "ckpt", "--max-batch-sise", "4"], "unknown option '--max_batch_sise'; did you mean '--max_batch_size'?"),
    (["export", "ckpt", "--outptu", "x"], "did you mean '--output'?"),
    (["quantize", "ckpt", "--mdoe", "int8"], "did you mean '--mode'?"),
    (["plan", "--modle", "debug"], "did you mean '--model'?"),
    (["advise", "run", "--jsno"], "did you mean '--json'?"),
    (["report", "run", "--smoth", "0.5"], "did you mean '--smooth'?"),
    (["prepare", "--vocab", "10"], "did you mean '--vocab_size'?"),
    (["generate", "ckpt", "--print_confg"], "did you mean '--print_config'?"),
    (["generate", "ckpt", "--prompt", "x", "--max_new_tokens", "many"], "--max_new_tokens: invalid int value: 'many'"),
    (["generate", "ckpt", "--prompt", "x", "--dtype", "fp8"], "argument --dtype: invalid choice: 'fp8'"),
    (["generate", "ckpt", "--prompt", "x", "--compile=maybe"], "--compile=maybe: a flag is true or false"),
    (["generate", "--prompt", "x"], "the following arguments are required: --checkpoint (or as the first argument)"),
    (["generate", "a", "--checkpoint", "b", "--prompt", "x"], "the model is given twice (a and --checkpoint b)"),
    (["generate", "ckpt"], "give one of --prompt TEXT or --prompt_ids IDS"),
    (["generate", "ckpt", "--prompt", "x", "--prompt_ids", "1"], "--prompt_ids: not allowed with argument --prompt"),
    (["quantize", "ckpt", "--output", "q"], "the following arguments are required: --mode"),
    (["generate", "ckpt", "stray", "--prompt", "x"], "unexpected argument 'stray'"),
])
def test_mistakes_get_one_line_naming_the_fix(capsys, tmp_path, monkeypatch, argv, needle):
    monkeypatch.chdir(tmp_path)
    rc, out, err = run(capsys, *argv)
    assert rc == 2 and out == ""
    assert len(err.strip().splitlines()) == 1, err
    assert needle in err
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("command", sorted(MINIMAL))
def test_print_config_round_trips_through_config_and_the_command_line_wins(capsys, tmp_path, command):
    """--print_config's TOML is what --config reads back (same options), and an option on the
    command line overrides the file's."""
    first = printed(capsys, command, *MINIMAL[command])
    path = tmp_path / f"{command}.toml"
    rc, out, _ = run(capsys, command, *MINIMAL[command], "--print_config")
    path.write_text(out)
    positional = MINIMAL[command][:1] if command not in ("prepare", "plan") else []
    again = printed(capsys, command, *positional, "--config", str(path))
    assert again == first
    options = {o.name: o for o in options_of(MODULES[command].SECTIONS)}
    for o in options.values():  # every key printed is an option of the command
        assert o.name in first or o.default in (None, (), []) or o.meta.get("env"), o.name
    # A number option given on the command line wins over the file.
    name = next(n for n, o in options.items() if o.tp in (int, float) and not o.meta.get("required"))
    assert printed(capsys, command, *positional, "--config", str(path), f"--{name}", "7")[name] == 7


def test_options_spelled_with_dashes_or_underscores_are_the_same(capsys):
    a = printed(capsys, "generate", "ckpt", "--prompt", "x", "--max-new-tokens", "5", "--top-p", "0.5", "--no-fuse",
                "--num-speculative-tokens", "3")
    b = printed(capsys, "generate", "ckpt", "--prompt", "x", "--max_new_tokens", "5", "--top_p", "0.5", "--no_fuse",
                "--num_speculative_tokens", "3")
    assert a == b and a["max_new_tokens"] == 5 and a["no_fuse"] is True and a["num_speculative_tokens"] == 3
    # train too: its own options and the config keys
    rc, out, err = run(capsys, "train", "--print-config", "--training.warmup-steps", "7", "--no-parallel.compile",
                       "--no-sample", "--run-dir", "somewhere")
    assert rc == 0, err
    assert tomllib.loads(out)["training"]["warmup_steps"] == 7


@pytest.mark.parametrize("argv, compile_", [
    (["--compile"], True), (["--compile", "true"], True), (["--compile=false"], False), (["--no-compile"], False),
    (["--no_compile"], False), (["--compile", "--no-compile"], False), ([], False),
])
def test_flags_and_a_positional_model_after_them(capsys, argv, compile_):
    """A bare flag never takes the next argument: `generate --compile CKPT` names the model."""
    got = printed(capsys, "generate", *argv, "ckpt", "--prompt", "x")
    assert got["checkpoint"] == "ckpt" and got.get("compile", False) is compile_


def test_the_model_as_positional_or_flag(capsys):
    for command, rest in (("generate", ["--prompt", "x"]), ("serve", []), ("export", ["--output", "o"]),
                          ("quantize", ["--output", "o", "--mode", "int4"])):
        assert printed(capsys, command, "m.gguf", *rest)["checkpoint"] == "m.gguf"
        assert printed(capsys, command, "--checkpoint", "m.gguf", *rest)["checkpoint"] == "m.gguf"
        assert printed(capsys, command, "m.gguf", "--checkpoint", "m.gguf", *rest)["checkpoint"] == "m.gguf"


def test_repeatable_and_list_options_keep_their_forms(capsys):
    assert printed(capsys, "generate", "c", "--prompt", "x", "--stop", "a", "--stop", "b")["stop"] == ["a", "b"]
    assert printed(capsys, "prepare", "--output", "o", "--input", "a.txt", "b.txt")["input"] == ["a.txt", "b.txt"]
    assert printed(capsys, "report", "r1", "r2", "--x", "time")["run_dirs"] == ["r1", "r2"]
    assert printed(capsys, "advise", "r", "--inference", "a.json", "b.prom")["inference"] == ["a.json", "b.prom"]


def test_a_config_file_is_checked_as_the_command_line_is(capsys, tmp_path):
    bad = tmp_path / "bad.toml"
    for text, needle in (('max_new_token = 5\n', "unknown key 'max_new_token'; did you mean 'max_new_tokens'?"),
                         ('max_new_tokens = "5"\n', "'max_new_tokens' = '5' is not allowed: an integer"),
                         ('dtype = "fp8"\n', "'dtype' = 'fp8' is not allowed: one of"),
                         ('compile = 1\n', "'compile' = 1 is not allowed: true or false"),
                         ('max_new_tokens = \n', "is not valid TOML")):
        bad.write_text(text)
        rc, out, err = run(capsys, "generate", "c", "--prompt", "x", "--config", str(bad))
        assert rc == 2 and out == "" and needle in err and len(err.strip().splitlines()) == 1, err
    rc, _, err = run(capsys, "generate", "c", "--prompt", "x", "--config", str(tmp_path / "none.toml"))
    assert rc == 2 and "no such file" in err
    # The file's values apply; dashes in its keys are read as underscores too.
    good = tmp_path / "good.toml"
    good.write_text('checkpoint = "from-file"\nmax-new-tokens = 9\ncompile = true\nstop = ["x"]\n')
    got = printed(capsys, "generate", "--config", str(good), "--prompt", "p")
    assert (got["checkpoint"], got["max_new_tokens"], got["compile"], got["stop"]) == ("from-file", 9, True, ["x"])
    assert printed(capsys, "generate", "--config", str(good), "--prompt", "p", "--no-compile").get("compile") is False


def test_serve_api_key_from_the_environment_is_never_printed(capsys, monkeypatch):
    monkeypatch.setenv("TRAINFORGE_API_KEY", "s3cret")
    rc, out, _ = run(capsys, "serve", "ckpt", "--print_config")
    assert rc == 0 and "s3cret" not in out and "api_key" not in out
    rc, out, _ = run(capsys, "serve", "ckpt", "--api_key", "k2", "--print_config")
    assert rc == 0 and "k2" not in out


def test_every_command_has_typed_options_but_train():
    """The parsers a reader meets: each typed command's options are its sections' fields, one for one."""
    for name, mod in MODULES.items():
        fields = {o.name for o in options_of(mod.SECTIONS)}
        parser = mod.COMMAND.parser()
        dests = {a.dest for a in parser._actions} - {"help", "config", "print_config", "MODEL"}
        assert dests == fields, name
    assert set(MODULES) | {"train"} == set(COMMANDS)


def test_choices_written_out_for_a_torch_free_help_match_their_modules():
    """export's --dtype, report's --x and advise's file name are spelled in cli/ so that --help
    imports no torch; they must stay the modules' own."""
    import typing

    from trainforge.infer.hf_export import DTYPES
    from trainforge.monitor.report import X_AXES
    from trainforge.plan.advise import ADVISED_FILE

    hints = {cls: typing.get_type_hints(cls) for cls in (export.ExportOptions, report.ReportOptions)}
    assert set(typing.get_args(hints[export.ExportOptions]["dtype"])) == set(DTYPES)
    assert typing.get_args(hints[report.ReportOptions]["x"]) == X_AXES
    assert advise.ADVISED_FILE == ADVISED_FILE
