"""``trainforge train``: the run config resolved (``config.py``: defaults <- the saved run config
<- ``--config`` <- ``--section.key`` overrides) and the run started or resumed
(``train/resume.py``), under the stop signals' handlers."""

from __future__ import annotations

import argparse

from trainforge import exit_codes
from trainforge.cli.help import ArgumentParser

DESCRIPTION = ("Train a model. Config precedence, lowest first: the defaults below <- the saved run config "
               "(--resume) <- --config FILE <- --SECTION.KEY VALUE (or --SECTION.KEY=VALUE) on the command line. "
               "A boolean key is set true by --SECTION.KEY alone, false by --no-SECTION.KEY, or either by "
               "--SECTION.KEY true|false. An optional key takes 'none' to unset it; a list of tables "
               "(data.augment.transforms) takes TOML text. --print_config shows the result.")
OWN_OPTIONS = ["--help", "--config", "--run_dir", "--resume", "--from_step", "--no_sample", "--print_config"]


def parser() -> argparse.ArgumentParser:
    from trainforge.config import add_config_arguments

    p = ArgumentParser(prog="trainforge train", description=DESCRIPTION,
                       usage="trainforge train [options] [--SECTION.KEY VALUE ...]")
    p.add_argument("--config", default=None, metavar="FILE", help="TOML config file")
    p.add_argument("--run_dir", default=None, help="directory for config, checkpoints and metrics "
                                                   "(default runs/YYYYmmdd-HHMMSS)")
    p.add_argument("--resume", default=None, metavar="RUN_DIR|auto",
                   help="continue the run in RUN_DIR from its newest complete checkpoint; 'auto' with --run_dir DIR: "
                        "continue DIR if it has a checkpoint, else start it (one command line for torchrun "
                        "--max-restarts)")
    p.add_argument("--from_step", type=int, default=None, metavar="N",
                   help="with --resume RUN_DIR: continue from the checkpoint at step N instead of the newest "
                        "(later checkpoints move to checkpoints/superseded/)")
    p.add_argument("--no_sample", action="store_true", help="do not print a text sample at the end")
    p.add_argument("--print_config", action="store_true",
                   help="print the resolved config as TOML (what --config reads back) and exit; builds nothing")
    add_config_arguments(p)
    return p


def run(argv: list[str]) -> int:
    from trainforge.cli.options import dash_names
    from trainforge.config import config_to_toml, join_values, load_config, overrides_from, read_toml_file, \
        reject_unknown
    from trainforge.train.resume import resolve

    p = parser()
    a, extra = p.parse_known_args(join_values(dash_names(argv, OWN_OPTIONS)))
    reject_unknown(extra, OWN_OPTIONS)
    rest = [f"--{key}={raw}" for key, raw in overrides_from(a)]
    start = resolve(a.run_dir, a.resume, a.from_step)
    # The run's saved config is the base when resuming; an explicit --config and overrides apply on top.
    base = read_toml_file(start.saved_config, "saved run config") if start.saved_config else None
    cfg = load_config(a.config, rest, base=base)
    if a.print_config:
        print(config_to_toml(cfg), end="")
        return 0

    from trainforge.parallel.distributed import launched_by_torchrun, peer_failure
    from trainforge.train.resume import exit_code, fit
    from trainforge.train.stop_signals import StartupInterrupted, StopSignals

    run_dir = start.run_dir
    signals = StopSignals()
    # Handled for the whole command: a signal during start-up ends it at once (128 + N, nothing to
    # save yet: the handler says so); once the loop runs, it stops the run at a window, saved.
    with signals.installed(ignore_after_outcome=launched_by_torchrun()):
        try:
            trainer, summary = fit(cfg, run_dir, start.resume, start.from_step, signals)
        except StartupInterrupted as e:
            signals.outcome = e.exit_code
            return e.exit_code
        except RuntimeError as e:  # a collective failed: a dead or hung peer is exit 4, anything else a bug
            failed = peer_failure(e, cfg.distributed.timeout_s) if launched_by_torchrun() else None
            if failed is None:
                raise
            signals.outcome = failed.exit_code
            raise failed from None
        signals.outcome = code = exit_code(summary)
        if not trainer.is_main:
            return code
        print(f"run directory: {run_dir}")
        if "checkpoint" in summary:
            print(f"checkpoint: {summary['checkpoint']}")
        if "first_val_loss" in summary and "final_val_loss" in summary:
            print(f"val_loss: {summary['first_val_loss']:.4f} -> {summary['final_val_loss']:.4f}")
        if code == exit_codes.STOPPED:
            print(f"stopped at step {summary['step']}: {summary['stop_reason']}; continue with --resume {run_dir}")
    if summary.get("early_stopped"):
        print(f"stopped early at step {summary['step']}: {summary['stop_reason']}")
    if code == exit_codes.COMPLETED and cfg.sample.max_new_tokens and not a.no_sample \
            and trainer.dims.world_size == 1:
        _print_sample(trainer, cfg)
    return code


def _print_sample(trainer, cfg) -> None:
    """The text sample after training ([sample]), from the inference model in its own dtype."""
    from trainforge.data.tokenizer import load_tokenizer
    from trainforge.infer.generate import SamplingParams, generate_text

    s = cfg.sample
    opts = SamplingParams(max_new_tokens=s.max_new_tokens, temperature=s.temperature, top_k=s.top_k,
                          seed=cfg.training.seed)
    tok = load_tokenizer(trainer.data.tokenizer_path)
    print("sample:\n" + generate_text(trainer.inference_model, tok, s.prompt, opts))
