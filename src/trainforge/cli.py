"""``trainforge <command>``: prepare, train, generate, report.

User errors (config, data, checkpoints) print one line naming the key or file and
the fix, and exit with status 2; no traceback, nothing half-written.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from trainforge.errors import TrainforgeError


def _prepare(argv: list[str]) -> int:
    from trainforge.data.prepare import PrepareOptions, prepare

    p = argparse.ArgumentParser(prog="trainforge prepare",
                                description="Tokenise text into memory-mappable shards with a manifest.")
    p.add_argument("--input", nargs="+", default=None,
                   help="text files, directories, globs or .jsonl files; omit for the built-in corpus")
    p.add_argument("--output", required=True, help="new directory for manifest.json, tokenizer.json and shards")
    p.add_argument("--vocab_size", type=int, default=8192, help="BPE vocabulary size to train")
    p.add_argument("--tokenizer", default=None, help="reuse this tokenizer.json instead of training one")
    p.add_argument("--val_fraction", type=float, default=0.05, help="share of documents held out for validation")
    p.add_argument("--text_field", default="text", help="field holding the text in .jsonl records")
    p.add_argument("--shard_tokens", type=int, default=1 << 24, help="tokens per shard file")
    a = p.parse_args(argv)
    prepare(a.input, a.output, PrepareOptions(vocab_size=a.vocab_size, val_fraction=a.val_fraction,
                                              shard_tokens=a.shard_tokens, text_field=a.text_field,
                                              tokenizer=a.tokenizer))
    return 0


def _train(argv: list[str]) -> int:
    from trainforge.config import config_help, load_config
    from trainforge.errors import ConfigError

    p = argparse.ArgumentParser(
        prog="trainforge train", formatter_class=argparse.RawDescriptionHelpFormatter, allow_abbrev=False,
        description="Train a model. Any config key can be overridden as --section.key VALUE.",
        epilog="config keys:\n" + config_help())
    p.add_argument("--config", default=None, help="TOML config file")
    p.add_argument("--run_dir", default=None, help="directory for config, checkpoints and metrics "
                                                   "(default runs/YYYYmmdd-HHMMSS)")
    p.add_argument("--resume", default=None, metavar="RUN_DIR",
                   help="continue the run in RUN_DIR from its newest checkpoint")
    p.add_argument("--no_sample", action="store_true", help="do not print a text sample at the end")
    a, rest = p.parse_known_args(argv)
    if a.resume:
        run_dir = Path(a.resume)
        if a.run_dir and Path(a.run_dir) != run_dir:
            raise ConfigError("--run_dir and --resume name different directories; --resume DIR continues DIR")
        saved = run_dir / "config.toml"
        if not saved.is_file():
            raise ConfigError(f"--resume {run_dir}: no config.toml there; is it a trainforge run directory?")
        # The run's saved config is the base; an explicit --config and overrides apply on top.
        import tomllib

        cfg = load_config(a.config, rest, base=tomllib.loads(saved.read_text()))
    else:
        cfg = load_config(a.config, rest)
        run_dir = Path(a.run_dir) if a.run_dir else Path("runs") / time.strftime("%Y%m%d-%H%M%S")

    from trainforge.train.trainer import Trainer

    from trainforge.parallel.distributed import destroy_distributed

    trainer = Trainer(cfg, run_dir, resume=bool(a.resume))
    while True:
        try:
            summary = trainer.fit()
        finally:
            trainer.close()
        if not str(summary.get("stop_reason") or "").startswith("rebalance"):
            break
        # Pipeline re-balance: the checkpoint just written is reloaded into a fresh split
        # measured now (pp_split = auto); resume is exact, so training is unchanged.
        trainer = Trainer(cfg, run_dir, resume=True)
    # Only after success: a barrier after a failure would wait forever for the failed rank
    # (torchrun then stops the others).
    destroy_distributed()
    # Early stopping ends a run as complete as reaching training.steps.
    completed = summary.get("stop_reason") is None or summary.get("early_stopped", False)
    if not trainer.is_main:
        return 0 if completed else 130
    print(f"run directory: {run_dir}")
    if "checkpoint" in summary:
        print(f"checkpoint: {summary['checkpoint']}")
    if "first_val_loss" in summary and "final_val_loss" in summary:
        print(f"val_loss: {summary['first_val_loss']:.4f} -> {summary['final_val_loss']:.4f}")
    s = cfg.sample
    if summary.get("early_stopped"):
        print(f"stopped early at step {summary['step']}: {summary['stop_reason']}")
    if completed and s.max_new_tokens and not a.no_sample and trainer.dims.world_size == 1:
        from trainforge.infer.generate import SamplingOptions, generate_text

        opts = SamplingOptions(max_new_tokens=s.max_new_tokens, temperature=s.temperature, top_k=s.top_k,
                               seed=cfg.training.seed)
        from trainforge.data.tokenizer import load_tokenizer

        tok = load_tokenizer(trainer.data.tokenizer_path)
        with trainer.mp.autocast():  # low-precision weights need the run's autocast
            print("sample:\n" + generate_text(trainer.inference_model, tok, s.prompt, opts))
    return 0 if completed else 130


def _generate(argv: list[str]) -> int:
    from trainforge.infer.generate import SamplingOptions, generate_text, load_checkpoint_for_inference

    p = argparse.ArgumentParser(prog="trainforge generate", description="Sample text from a checkpoint.")
    p.add_argument("--checkpoint", required=True, help="checkpoint directory, or a run directory (newest checkpoint)")
    p.add_argument("--prompt", required=True, help="text to continue")
    p.add_argument("--max_new_tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.8, help="0 = greedy")
    p.add_argument("--top_k", type=int, default=0, help="0 = off")
    p.add_argument("--top_p", type=float, default=1.0, help="1 = off")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="cpu")
    a = p.parse_args(argv)
    opts = SamplingOptions(max_new_tokens=a.max_new_tokens, temperature=a.temperature, top_k=a.top_k,
                           top_p=a.top_p, seed=a.seed)
    try:
        opts.validate()
    except ValueError as e:
        raise TrainforgeError(str(e)) from None
    model, tok = load_checkpoint_for_inference(a.checkpoint, a.device)
    print(generate_text(model, tok, a.prompt, opts))
    return 0


def _report(argv: list[str]) -> int:
    from trainforge.monitor.report import write_report

    p = argparse.ArgumentParser(prog="trainforge report",
                                description="Write an HTML report of a run's metrics (plots embedded; no server needed).")
    p.add_argument("run_dir", metavar="RUN_DIR", help="a run directory (holds metrics.jsonl)")
    p.add_argument("--out", default=None, help="output file (default RUN_DIR/report.html)")
    a = p.parse_args(argv)
    print(f"report: {write_report(a.run_dir, a.out)}")
    return 0


COMMANDS = {"prepare": _prepare, "train": _train, "generate": _generate, "report": _report}


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in COMMANDS:
        print("usage: trainforge {" + ",".join(COMMANDS) + "} [options]   (trainforge COMMAND --help for more)",
              file=sys.stderr)
        return 0 if argv and argv[0] in ("-h", "--help") else 2
    try:
        return COMMANDS[argv[0]](argv[1:])
    except TrainforgeError as e:
        print(f"trainforge {argv[0]}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
