"""``trainforge <command>``: prepare, train, generate, quantize, serve, report, plan.

User errors (config, data, checkpoints) print one line naming the key or file and
the fix, and exit with status 2; no traceback, nothing half-written. Every outcome
has its own exit code: ``exit_codes.py``.
"""

from __future__ import annotations

import argparse
import errno
import sys
import time
from pathlib import Path

from trainforge import exit_codes
from trainforge.cli_help import ArgumentParser, package_version, top_level_help, unknown_command
from trainforge.errors import TrainforgeError


def _prepare(argv: list[str]) -> int:
    from trainforge.data.prepare import PrepareOptions, prepare

    p = ArgumentParser(prog="trainforge prepare",
                       description="Tokenise text into memory-mappable shards with a manifest.")
    p.add_argument("--input", nargs="+", default=None,
                   help="text files, directories, globs, .jsonl or Parquet files (any of them .gz/.bz2/.xz/.zst), "
                        "Hugging Face dataset directories (save_to_disk) or hf:NAME[:CONFIG][@SPLIT] (load_dataset, "
                        "offline; the datasets extra); omit for the built-in corpus")
    p.add_argument("--output", required=True, help="new directory for manifest.json, tokenizer.json and shards")
    p.add_argument("--vocab_size", type=int, default=8192, help="BPE vocabulary size to train")
    p.add_argument("--tokenizer", default=None, help="reuse this tokenizer.json instead of training one")
    p.add_argument("--val_fraction", type=float, default=0.05, help="share of documents held out for validation")
    p.add_argument("--text_field", default="text", help="field holding the text in .jsonl records, or column in Parquet and datasets")
    p.add_argument("--shard_tokens", type=int, default=1 << 24, help="tokens per shard file")
    a = p.parse_args(argv)
    prepare(a.input, a.output, PrepareOptions(vocab_size=a.vocab_size, val_fraction=a.val_fraction,
                                              shard_tokens=a.shard_tokens, text_field=a.text_field,
                                              tokenizer=a.tokenizer))
    return 0


_TRAIN_HELP = ("Train a model. Config precedence, lowest first: the defaults below <- the saved run config "
               "(--resume) <- --config FILE <- --SECTION.KEY VALUE (or --SECTION.KEY=VALUE) on the command line. "
               "A boolean key is set true by --SECTION.KEY alone, false by --no-SECTION.KEY, or either by "
               "--SECTION.KEY true|false. An optional key takes 'none' to unset it; a list of tables "
               "(data.augment.transforms) takes TOML text. --print_config shows the result.")


def _train_parser() -> argparse.ArgumentParser:
    from trainforge.config import add_config_arguments

    p = ArgumentParser(prog="trainforge train", description=_TRAIN_HELP,
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


def _train(argv: list[str]) -> int:
    from trainforge.config import config_to_toml, join_values, load_config, overrides_from, read_toml_file, \
        reject_unknown
    from trainforge.errors import ConfigError

    p = _train_parser()
    a, extra = p.parse_known_args(join_values(argv))
    reject_unknown(extra, ["--help", "--config", "--run_dir", "--resume", "--from_step", "--no_sample",
                           "--print_config"])
    rest = [f"--{key}={raw}" for key, raw in overrides_from(a)]
    resume = bool(a.resume)
    if a.resume == "auto":
        if not a.run_dir:
            raise ConfigError("--resume auto needs --run_dir DIR (for a directory named auto, write --resume ./auto)")
        if a.from_step is not None:
            raise ConfigError("--from_step needs --resume RUN_DIR; --resume auto continues from the newest checkpoint")
        import os

        from trainforge.log import get_logger
        from trainforge.train.checkpoint import scan_checkpoints

        # Complete checkpoints only (valid meta.json): what every rank of a restarted job
        # sees alike, whatever the previous attempt was doing when it was killed.
        complete, incomplete = scan_checkpoints(Path(a.run_dir) / "checkpoints")
        resume = bool(complete)
        a.resume = a.run_dir if resume else None
        if incomplete and not resume and os.environ.get("RANK", "0") == "0":
            get_logger().warning(f"--resume auto: {a.run_dir} has no complete checkpoint ("
                                 + ", ".join(f"{d.name}: {why}" for d, why in incomplete) + "); starting fresh")
    elif a.from_step is not None and not a.resume:
        raise ConfigError("--from_step N needs --resume RUN_DIR")
    if resume:
        run_dir = Path(a.resume)
        if a.run_dir and Path(a.run_dir) != run_dir:
            raise ConfigError("--run_dir and --resume name different directories; --resume DIR continues DIR")
        saved = run_dir / "config.toml"
        if not saved.is_file():
            raise ConfigError(f"--resume {run_dir}: no config.toml there; is it a trainforge run directory?")
        # The run's saved config is the base; an explicit --config and overrides apply on top.
        cfg = load_config(a.config, rest, base=read_toml_file(saved, "saved run config"))
    else:
        cfg = load_config(a.config, rest)
        run_dir = Path(a.run_dir) if a.run_dir else Path("runs") / time.strftime("%Y%m%d-%H%M%S")
    if a.print_config:
        print(config_to_toml(cfg), end="")
        return 0

    from trainforge.parallel.distributed import launched_by_torchrun, peer_failure
    from trainforge.train.stop_signals import StartupInterrupted, StopSignals

    signals = StopSignals()
    # Handled for the whole command: a signal during start-up ends it at once (128 + N, nothing to
    # save yet: the handler says so); once the loop runs, it stops the run at a window, saved.
    with signals.installed(ignore_after_outcome=launched_by_torchrun()):
        try:
            trainer, summary = _fit(cfg, run_dir, resume, a.from_step, signals)
        except StartupInterrupted as e:
            signals.outcome = e.exit_code
            return e.exit_code
        except RuntimeError as e:  # a collective failed: a dead or hung peer is exit 4, anything else a bug
            failed = peer_failure(e, cfg.distributed.timeout_s) if launched_by_torchrun() else None
            if failed is None:
                raise
            signals.outcome = failed.exit_code
            raise failed from None
        signals.outcome = code = _exit_code(summary)
        if not trainer.is_main:
            return code
        print(f"run directory: {run_dir}")
        if "checkpoint" in summary:
            print(f"checkpoint: {summary['checkpoint']}")
        if "first_val_loss" in summary and "final_val_loss" in summary:
            print(f"val_loss: {summary['first_val_loss']:.4f} -> {summary['final_val_loss']:.4f}")
        if code == exit_codes.STOPPED:
            print(f"stopped at step {summary['step']}: {summary['stop_reason']}; continue with --resume {run_dir}")
    s = cfg.sample
    if summary.get("early_stopped"):
        print(f"stopped early at step {summary['step']}: {summary['stop_reason']}")
    sample = code == exit_codes.COMPLETED and s.max_new_tokens and not a.no_sample and trainer.dims.world_size == 1
    if sample:
        from trainforge.infer.generate import SamplingParams, generate_text

        opts = SamplingParams(max_new_tokens=s.max_new_tokens, temperature=s.temperature, top_k=s.top_k,
                              seed=cfg.training.seed)
        from trainforge.data.tokenizer import load_tokenizer

        tok = load_tokenizer(trainer.data.tokenizer_path)
        # The engine runs in the inference model's own dtype (generate turns autocast off).
        print("sample:\n" + generate_text(trainer.inference_model, tok, s.prompt, opts))
    return code


def _fit(cfg, run_dir: Path, resume: bool, from_step: int | None, signals) -> tuple:
    """Build the trainer and train, re-splitting the pipeline when it asks to. The process
    group is torn down (a barrier) when every rank ends at the same step: completed,
    stopped, or a non-finite loss; never after a peer failed (the barrier would wait on it)."""
    from trainforge.parallel.distributed import destroy_distributed
    from trainforge.train.component import StopKind
    from trainforge.train.stop_signals import NonFiniteLoss
    from trainforge.train.trainer import Trainer

    trainer = Trainer(cfg, run_dir, resume=resume, from_step=from_step)
    while True:
        failed = True
        try:
            summary = trainer.fit(signals)
            failed = False
        except NonFiniteLoss:
            destroy_distributed()  # every rank raised at the same step (all-reduced losses)
            signals.outcome = exit_codes.NONFINITE_LOSS
            raise
        finally:
            trainer.close(failed)
        if summary.get("stopped_by") is not StopKind.REBALANCE:
            break
        # Pipeline re-balance: the checkpoint just written is reloaded into a fresh split
        # measured now (pp_split = auto); resume is exact, so training is unchanged.
        trainer = Trainer(cfg, run_dir, resume=True)
    destroy_distributed()
    return trainer, summary


def _exit_code(summary: dict) -> int:
    """Early stopping ends a run as complete as reaching training.steps (0: torchrun restarts
    any other code); a [bad_steps] stop is a diverged run; any other stop saved a checkpoint."""
    from trainforge.train.component import StopKind

    if summary.get("stopped_by") is None or summary.get("stopped_by") is StopKind.EARLY_STOP:
        return exit_codes.COMPLETED
    if summary.get("stopped_by") is StopKind.BAD_STEPS:
        return exit_codes.NONFINITE_LOSS
    return exit_codes.STOPPED


def _add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--checkpoint", required=True,
                   help="trainforge checkpoint or run directory (newest checkpoint), or a Hugging Face Llama "
                        "directory (config.json + *.safetensors)")
    p.add_argument("--device", default="cpu", help="torch device: cpu, cuda, cuda:1, ...")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"],
                   help="parameter dtype (quantised layers keep their own)")
    p.add_argument("--quantize", default="auto", choices=["auto", "none", "int8", "int4", "q8_0", "q4_0"],
                   help="quantise a float checkpoint's linear layers (and MoE experts: int8 / int4) at load "
                        "time: int8 per channel, int4 per group, q8_0 / q4_0 in 32-value blocks on the C++ CPU "
                        "kernels (llama.cpp's formats) (see "
                        "`trainforge quantize` for the offline step); auto = the grid a QAT checkpoint was "
                        "trained for ([qat]), else none")
    p.add_argument("--group_size", type=int, default=None,
                   help="int4 group size (32, 64, 128 or 256 on CPU); default: a QAT checkpoint's, else 128. A layer "
                        "it does not divide takes the largest multiple of 32 below it that does, else stays float")
    p.add_argument("--quant_kernel", default=None,
                   help="kernel for quantised layers (fbgemm, int8pack, int4pack_cpu, torchao, blocks, dequant, reference), or "
                        "'measure' (time them here once, cached); default: the order measured for the device")
    p.add_argument("--no_fuse", action="store_true", help="skip the fusion pass (QKV, gate+up, add+RMSNorm)")
    p.add_argument("--compile", action="store_true", help="torch.compile the decode step (slow start on CPU)")
    p.add_argument("--speculative", default=None, metavar="draft:CHECKPOINT|mtp",
                   help="speculative decoding: draft:CHECKPOINT drafts with a smaller model sharing the tokenizer "
                        "(loaded with the same --device/--dtype, unquantised); mtp drafts with the model's own MTP module "
                        "(a model trained with model.mtp_depth >= 1; depth 1 drafts every token)")
    p.add_argument("--num_speculative_tokens", type=int, default=4,
                   help="tokens drafted per step with --speculative (>= 1)")


def _speculative_args(a) -> tuple[str, str | None] | None:
    """Validate --speculative / --num_speculative_tokens before any weight is read."""
    from trainforge.infer.speculative import check_num_speculative_tokens, parse_speculative

    if a.speculative is None:
        return None
    try:
        check_num_speculative_tokens(a.num_speculative_tokens)
        mode, path = parse_speculative(a.speculative)
    except ValueError as e:
        raise TrainforgeError(str(e)) from None
    return mode, path


def _load_drafter(a, spec, target):
    """The drafter for --speculative: mtp (the target's own MTP module, mtp_drafter.py) or
    draft:CHECKPOINT, its tokenizer checked against the target's."""
    from trainforge.infer.loading import load_model
    from trainforge.infer.prepare import prepare_model
    from trainforge.infer.speculative import DraftModelDrafter

    if spec is None:
        return None
    if spec[0] == "mtp":
        from trainforge.infer.mtp_drafter import MTPDrafter, check_mtp_model

        check_mtp_model(target.model.cfg)
        return MTPDrafter()
    draft = load_model(spec[1], a.device, a.dtype)
    if draft.tokenizer is not None and target.tokenizer is not None \
            and draft.tokenizer.to_str() != target.tokenizer.to_str():
        raise TrainforgeError(f"--speculative {a.speculative}: its tokenizer.json differs from {a.checkpoint}'s; "
                              "the draft must share the target's tokenizer")
    prepare_model(draft.model, fuse=not a.no_fuse)
    return DraftModelDrafter(draft.model)


def _trained_grid(checkpoint: str, requested: str, group_size: int | None, what: str = "--quantize"):
    """(mode, group_size, the QAT scheme recorded in ``checkpoint`` or None) for a quantisation
    request (``qat_meta.resolve_quantize``): a QAT checkpoint's grid wins, another grid is
    refused naming the fix, ``none`` on one is warned about."""
    from trainforge.infer.quantize.qat_meta import qat_scheme_of, resolve_quantize
    from trainforge.log import get_logger

    recorded = qat_scheme_of(checkpoint)
    try:
        mode, group_size, note = resolve_quantize(requested, group_size, recorded, what)
    except ValueError as e:
        raise TrainforgeError(str(e)) from None
    if note:
        get_logger().warning(note)
    return mode, group_size, recorded


def _load_for_engine(a, kv_slots=None):
    from trainforge.infer.loading import load_model
    from trainforge.infer.malloc_release import map_large_blocks_for_load, release_freed_memory
    from trainforge.infer.quantize import quantize_model

    # A QAT checkpoint is served on the grid it was trained for (decided from meta.json, before any weight).
    mode, group_size, recorded = _trained_grid(a.checkpoint, a.quantize, a.group_size)
    # kv_slots(cfg): the engine's KV pool in token slots, for the preflight before any weight is read.
    # Quantising at load on CPU: the float weights are mapped from the file (read as each layer is
    # quantised, reclaimable after), so the fp32 model is never resident beside the quantised one.
    mapped = mode != "none" and a.device == "cpu"
    map_large_blocks_for_load()  # until release_freed_memory below: freed load tensors leave at once
    loaded = load_model(a.checkpoint, a.device, a.dtype, kv_slots=kv_slots, mapped=mapped,
                        quantize_to={"mode": mode, "group_size": group_size} if mode != "none" else None)
    if mode != "none":
        if loaded.quantization:
            raise TrainforgeError(f"--quantize {mode}: {a.checkpoint} is already quantised "
                                  f"({loaded.quantization['mode']})")
        quantize_model(loaded.model, mode, group_size, pack=False, fallback=recorded is None)
    from trainforge.infer.prepare import prepare_model

    # The inference swaps (fusion, quantised kernels) happen here, before the engine is built.
    prepare_model(loaded.model, fuse=not a.no_fuse, quant_kernel=a.quant_kernel)
    release_freed_memory()  # the load's freed copies and repacks leave the process
    return loaded


def _freeze_long_lived() -> None:
    """Exempt every object made so far (torch's and the model's modules, the engine) from the
    cyclic garbage collector: they live as long as the process, and each full collection walked
    all of them, between decode steps: 3% of a 90m q4_0 decode on one thread (``perf``); 1000
    tokens 1.05x (1.04-1.09) faster with it, 4 interleaved pairs, none measurable at 256. No
    collection first: it would cost as much as one it saves (~0.1 s); a GGUF load has collected
    its reader's cycles already, and any other garbage of the load stays, once."""
    import gc

    gc.freeze()


def _inference():
    """The context ``generate`` and ``serve`` load the model and build the engine in (its steps run
    in the same mode, ``Engine.step``): torch's inference mode. Besides skipping autograd's
    bookkeeping, ops then bypass the Autograd and ADInplaceOrView dispatch kernels, whose libtorch
    code pages each distinct op would otherwise map into the process: the 90m q4_0 GGUF's
    generate peaked 1.4 MiB lower (1.3-1.8 over 4 interleaved pairs; docs/benchmarks-archive.md, issue 24).
    The model's tensors become inference tensors, which nothing outside inference mode may modify
    in place: the engine never does."""
    import torch

    return torch.inference_mode()


def _engine_config(a, **kw):
    from trainforge.infer.engine import EngineConfig
    from trainforge.precision.hardware import cpu_compile_unavailable

    if a.compile and a.device == "cpu" and (why := cpu_compile_unavailable()):  # one line, not inductor's traceback
        raise TrainforgeError(f"--compile: {why}; install g++ (Debian/Ubuntu: apt install g++) or leave out "
                              "--compile (the C++ decode kernels need no torch.compile)")
    return EngineConfig(compile=a.compile, num_speculative_tokens=a.num_speculative_tokens, **kw)


def _generate(argv: list[str]) -> int:
    from trainforge.infer.sampling import SamplingParams

    p = ArgumentParser(prog="trainforge generate", description="Generate from a checkpoint with the "
                       "inference engine.")
    _add_model_args(p)
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="text to continue (needs the checkpoint's tokenizer.json)")
    src.add_argument("--prompt_ids", help="token ids to continue, comma-separated: 1,2,3")
    p.add_argument("--print_ids", action="store_true", help="print the generated token ids instead of text")
    p.add_argument("--max_new_tokens", type=int, default=64, help="tokens to generate at most")
    p.add_argument("--temperature", type=float, default=0.8, help="0 = greedy")
    p.add_argument("--top_k", type=int, default=0, help="0 = off")
    p.add_argument("--top_p", type=float, default=1.0, help="1 = off")
    p.add_argument("--repetition_penalty", type=float, default=1.0, help="1 = off")
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    p.add_argument("--ignore_eos", action="store_true", help="do not stop at the end-of-text token")
    p.add_argument("--seed", type=int, default=0, help="sampling seed (same seed, same text)")
    p.add_argument("--stats", action="store_true", help="print engine statistics (tok/s, KV pool) to stderr")
    a = p.parse_args(argv)
    params = SamplingParams(max_new_tokens=a.max_new_tokens, temperature=a.temperature, top_k=a.top_k,
                            top_p=a.top_p, repetition_penalty=a.repetition_penalty, stop=tuple(a.stop),
                            ignore_eos=a.ignore_eos, seed=a.seed)
    try:
        params.validate()
        ids = [int(t) for t in a.prompt_ids.split(",") if t.strip()] if a.prompt_ids is not None else None
    except ValueError as e:
        raise TrainforgeError(f"--{str(e)}" if not str(e).startswith("invalid literal") else
                              f"--prompt_ids {a.prompt_ids!r}: give comma-separated integers") from None
    spec = _speculative_args(a)
    # The engine's pool (below) holds one context; a text prompt has at most one token per byte.
    prompt_len = len(ids) if ids is not None else len(a.prompt.encode())
    ahead = a.num_speculative_tokens if spec else 0
    with _inference():
        return _generate_with(a, params, ids, spec, prompt_len, ahead)


def _generate_with(a, params, ids: list[int] | None, spec, prompt_len: int, ahead: int) -> int:
    from trainforge.infer.engine import Engine
    from trainforge.infer.server_limits import TokenizerFailed, tokenizer_call

    loaded = _load_for_engine(a, kv_slots=lambda cfg: (-(-(min(cfg.max_seq_len, prompt_len + a.max_new_tokens)
                                                           + ahead) // 16) + 1) * 16)
    # Text in or out (a text prompt, printed text, stop strings) needs the tokenizer; ids in and
    # out do not, and a GGUF file's is then never built (``LoadedModel.tokenizer``).
    tok = loaded.tokenizer if a.prompt is not None or not a.print_ids or a.stop else None
    if ids is None:
        if tok is None:
            raise TrainforgeError(f"{a.checkpoint} has no tokenizer.json: use --prompt_ids")
        try:  # a tokenizer.json regex can panic on some text (Oniguruma's retry limit): one line, not a traceback
            ids = tokenizer_call(tok.encode, a.prompt).ids
        except TokenizerFailed as e:
            raise TrainforgeError(f"{a.checkpoint}: its tokenizer failed on --prompt ({e}); fix its tokenizer.json "
                                  "or give --prompt_ids") from None
    try:
        engine = Engine(loaded.model, _engine_config(a, max_batch_size=1, max_queue=1,
                                                     max_context=min(loaded.model.cfg.max_seq_len,
                                                                     len(ids) + a.max_new_tokens)),
                        tokenizer=tok, eos_ids=loaded.eos_ids, drafter=_load_drafter(a, spec, loaded))
        _freeze_long_lived()
        req = engine.generate([ids], params)[0]
    except ValueError as e:
        raise TrainforgeError(str(e)) from None
    if req.finish_reason == "error":  # the engine failed it (its detokenisation, say): Request.error says why
        raise TrainforgeError(f"{a.checkpoint}: {req.error}")
    if a.print_ids or tok is None:
        print(",".join(map(str, req.output_ids)))
    else:
        # decode(prompt + output) keeps characters split across the boundary intact; a stop
        # string cut the output's text, which then follows the prompt's.
        cut = req.finish_reason == "stop" and params.stop
        try:
            text = tokenizer_call(tok.decode, ids if cut else ids + req.output_ids) + (req.text if cut else "")
        except TokenizerFailed as e:
            raise TrainforgeError(f"{a.checkpoint}: its tokenizer failed to decode the output ({e}); fix its "
                                  "tokenizer.json or use --print_ids") from None
        print(text)
    if a.stats:
        import json

        print(json.dumps(engine.stats(), default=str), file=sys.stderr)
    return 0


def _quantize(argv: list[str]) -> int:
    import dataclasses

    from trainforge.infer.loading import load_model
    from trainforge.infer.quantize import expert_names, linear_names, quantize_state_dict, save_quantized

    p = ArgumentParser(prog="trainforge quantize",
                       description="Offline quantisation: write a checkpoint with int8 / int4 linear and "
                                   "MoE expert weights (scales beside them; routers stay fp32) that "
                                   "`generate` and `serve` load directly.")
    p.add_argument("--checkpoint", required=True,
                   help="float trainforge checkpoint / run directory, or a Hugging Face directory")
    p.add_argument("--output", required=True, help="new directory for the quantised checkpoint")
    p.add_argument("--mode", required=True, choices=["int8", "int4", "q8_0", "q4_0"],
                   help="int8 per output channel, int4 per group, or q8_0 / q4_0: 32-value blocks with one fp16 "
                        "scale (llama.cpp's formats, run by the C++ CPU kernels; routed experts stay float)")
    p.add_argument("--group_size", type=int, default=None,
                   help="int4 group size (32, 64, 128 or 256 on CPU); default: a QAT checkpoint's, else 128. A layer "
                        "it does not divide takes the largest multiple of 32 below it that does, else stays float")
    a = p.parse_args(argv)
    from trainforge.storage.output_paths import refuse_overlap

    refuse_overlap(a.output, "--output", [("--checkpoint", a.checkpoint)])
    if Path(a.output).exists():
        raise TrainforgeError(f"--output {a.output} exists; choose a new directory")
    a.mode, a.group_size, recorded = _trained_grid(a.checkpoint, a.mode, a.group_size, "--mode")  # a QAT run: its grid
    # Mapped: the float weights are views of the file's pages, read as each tensor is quantised and
    # reclaimable after, so the process never holds the fp32 model beside the quantised one.
    loaded = load_model(a.checkpoint, mapped=True)
    if loaded.quantization:
        raise TrainforgeError(f"{a.checkpoint} is already quantised ({loaded.quantization['mode']})")
    model = loaded.model
    sd = model.state_dict()
    before = sum(t.nbytes for t in sd.values())
    try:
        qsd, info = quantize_state_dict(sd, linear_names(model), a.mode, a.group_size, expert_names(model),
                                        embedding=not model.cfg.tie_embeddings, fallback=recorded is None)
    except ValueError as e:
        raise TrainforgeError(f"--{e}") from None
    if a.mode == "int4":  # the per-layer group sizes, in the words export uses (quantize/int4_groups.py)
        from trainforge.infer.quantize.int4_groups import fallback_lines

        dims = {n: (sd[f"{n}.weight"].shape[1],) for n in linear_names(model)}
        dims.update({n: (sd[f"{n}.w1"].shape[2],) for n in expert_names(model)})  # the hidden dim is padded
        for line in fallback_lines(a.group_size, info["group_sizes"], info["skipped"], dims, recorded is None):
            print(line)
        info_skipped = {k: v for k, v in info["skipped"].items() if k not in dims or not any(
            d % a.group_size for d in dims[k])}
    else:
        info_skipped = info["skipped"]
    tok_file = loaded.path / "tokenizer.json"
    out = save_quantized(a.output, qsd, info, dataclasses.asdict(model.cfg),
                         tok_file if tok_file.is_file() else None, {"path": str(loaded.path)})
    after = (out / "model.safetensors").stat().st_size
    print(f"quantised {len(info['layers'])} linear layers"
          + (f" and {len(info['experts'])} layers of routed experts" if info["experts"] else "") + f" to {a.mode}"
          + (f" (group_size {a.group_size})" if a.mode == "int4" else "")
          + (f" (skipped {len(info_skipped)}: {info_skipped})" if info_skipped else ""))
    print(f"weights: {before / 2**20:.1f} MiB -> {after / 2**20:.1f} MiB in {out}")
    return 0


def _export(argv: list[str]) -> int:
    from trainforge.infer.hf_export import DTYPES, export

    p = ArgumentParser(prog="trainforge export",
                       description="Write a checkpoint as a Hugging Face directory that transformers, vLLM "
                                   "and llm-compressor read: config.json, generation_config.json, "
                                   "model.safetensors (sharded with an index above --max_shard_gb), "
                                   "tokenizer.json + tokenizer_config.json. LlamaForCausalLM for dense "
                                   "models, DeepseekV3ForCausalLM (MTP layers included) for latent-attention "
                                   "MoE, Glm4MoeForCausalLM (sigmoid routing) or MixtralForCausalLM "
                                   "(softmax) for other MoE. --quantize writes int8/int4 linear weights in "
                                   "the compressed-tensors format.")
    p.add_argument("--checkpoint", required=True, help="float trainforge checkpoint or run directory")
    p.add_argument("--output", required=True, help="new directory for the Hugging Face files")
    p.add_argument("--dtype", default="fp32", choices=sorted(DTYPES), help="dtype of the float weights")
    p.add_argument("--quantize", default=None, choices=["none", "int8", "int4"],
                   help="int8 per output channel or int4 per group (compressed-tensors format); default: none, "
                        "or the scheme a quantisation-aware run was trained with")
    p.add_argument("--group_size", type=int, default=None,
                   help="int4 group size (default 128, or the QAT run's); a layer it does not divide takes the "
                        "largest multiple of 32 below it that does, else stays float (as trainforge quantize)")
    p.add_argument("--max_shard_gb", type=float, default=5.0, help="split the weights into files of at most this size")
    p.add_argument("--force", action="store_true", help="replace --output if it exists (only once the new one is "
                                                        "complete)")
    a = p.parse_args(argv)
    if a.max_shard_gb <= 0:
        raise TrainforgeError(f"--max_shard_gb {a.max_shard_gb}: must be > 0")
    from trainforge.storage.output_paths import refuse_overlap

    refuse_overlap(a.output, "--output", [("--checkpoint", a.checkpoint)], has_force=True)  # before any read
    # A QAT run exports on the grid it was trained for (its dequantised weights are then the
    # fake-quantised training weights, bit for bit).
    mode, group_size, recorded = _trained_grid(a.checkpoint, a.quantize or "auto", a.group_size)
    t0 = time.perf_counter()
    r = export(a.checkpoint, a.output, dtype=a.dtype, quantize=mode, group_size=group_size, force=a.force,
               max_shard_bytes=int(a.max_shard_gb * 2**30), skip_indivisible=recorded is not None)
    dt = time.perf_counter() - t0
    for line in r.notes:  # int4: the per-layer group sizes, in the words quantize uses
        print(line)
    what = f", {len(r.quantized)} layers {mode}" if r.quantized else ""
    print(f"wrote {r.path}: {r.tensors} tensors, {r.bytes / 2**20:.1f} MiB in {len(r.files)} file(s){what}; "
          f"{dt:.1f} s")
    return 0


def _serve(argv: list[str]) -> int:
    import os

    from trainforge.infer.listen import bind_socket

    p = ArgumentParser(prog="trainforge serve",
                       description="OpenAI-compatible HTTP server (/v1/completions, /v1/chat/completions, "
                                   "/v1/models, /tokenize, /detokenize, /health, /metrics) with continuous "
                                   "batching.")
    _add_model_args(p)
    p.add_argument("--host", default="127.0.0.1", help="address to bind (0.0.0.0 exposes the server to the network)")
    p.add_argument("--port", type=int, default=8000, help="TCP port to listen on")
    p.add_argument("--api_key", default=os.environ.get("TRAINFORGE_API_KEY"),
                   help="require 'Authorization: Bearer KEY' on all endpoints but /health "
                        "(default: $TRAINFORGE_API_KEY; unset = no key)")
    p.add_argument("--model_name", default=None, help="model id in the API (default: the checkpoint's name)")
    p.add_argument("--max_batch_size", type=int, default=8, help="sequences decoded together")
    p.add_argument("--max_queue", type=int, default=64, help="requests waiting while every batch row is busy")
    p.add_argument("--max_concurrent", type=int, default=0,
                   help="running + waiting requests before answering 429; 0 = max_batch_size + max_queue")
    p.add_argument("--block_size", type=int, default=16, help="tokens per KV-cache block")
    p.add_argument("--n_blocks", type=int, default=0, help="KV pool size in blocks; 0 = max_batch_size full contexts")
    p.add_argument("--max_context", type=int, default=0, help="tokens per sequence; 0 = the model's max_seq_len")
    p.add_argument("--max_prefill_tokens", type=int, default=512,
                   help="prompt tokens of requests admitted together that prefill in one forward (a longer "
                        "prompt prefills alone)")
    p.add_argument("--max_body_bytes", type=int, default=1 << 20, help="larger request bodies get 413")
    p.add_argument("--read_timeout_s", type=float, default=30.0,
                   help="a client must send a request's headers within this many seconds (else the connection "
                        "closes), then its body within as many again (else 408); slow clients hold no place")
    p.add_argument("--max_tokenize_concurrent", type=int, default=2,
                   help="/tokenize and /detokenize requests handled at once (each on its own thread); more get 429")
    p.add_argument("--no_access_log", action="store_true",
                   help="do not log a line per request (method, path, status, ms, tokens)")
    a = p.parse_args(argv)
    sock = bind_socket(a.host, a.port)  # before the model loads: a busy port fails at once, and stays ours
    from trainforge.infer.engine import Engine  # torch and FastAPI take seconds to import: after the bind

    try:
        from trainforge.infer.server import ServerConfig, serve
    except ImportError as e:
        raise TrainforgeError(f"trainforge serve needs the server packages ({e.name} is missing): "
                              "pip install 'trainforge[infer]'") from None
    server_config = ServerConfig(host=a.host, port=a.port, api_key=a.api_key, max_body_bytes=a.max_body_bytes,
                                 max_concurrent=a.max_concurrent, access_log=not a.no_access_log,
                                 read_timeout_s=a.read_timeout_s, max_tokenize_concurrent=a.max_tokenize_concurrent)
    server_config.validate()  # before any weight is read
    spec = _speculative_args(a)
    ahead = a.num_speculative_tokens if spec else 0
    config = _engine_config(a, max_batch_size=a.max_batch_size, max_queue=a.max_queue, block_size=a.block_size,
                            n_blocks=a.n_blocks, max_context=a.max_context, max_prefill_tokens=a.max_prefill_tokens)
    try:
        config.validate()  # before any weight is read: a bad flag costs no load
    except ValueError as e:
        raise TrainforgeError(f"--{e}") from None

    def kv_slots(cfg) -> int:  # EngineConfig's defaults: max_batch_size full contexts (+ the padding block)
        bs = max(a.block_size, 1)
        return (a.n_blocks or a.max_batch_size * -(-((a.max_context or cfg.max_seq_len) + ahead) // bs) + 1) * bs

    with _inference():
        loaded = _load_for_engine(a, kv_slots)
        if loaded.tokenizer is None:
            raise TrainforgeError(f"{a.checkpoint} has no tokenizer.json; the server needs one")
        try:
            engine = Engine(loaded.model, config,
                            tokenizer=loaded.tokenizer, eos_ids=loaded.eos_ids,
                            drafter=_load_drafter(a, spec, loaded))
        except ValueError as e:
            raise TrainforgeError(str(e)) from None
    _freeze_long_lived()
    server_config.model_name = a.model_name or loaded.name
    serve(engine, loaded.tokenizer, server_config, sock)
    return 0


def _report(argv: list[str]) -> int:
    from trainforge.monitor.report import COMPARE_FILE, X_AXES, write_report

    p = ArgumentParser(prog="trainforge report",
                       description="Write an HTML report of one or several runs' metrics, overlaid (plots "
                                   "embedded; no server needed), with the runs' config differences.")
    p.add_argument("run_dirs", metavar="RUN_DIR", nargs="+", help="run directories (each holds metrics.jsonl)")
    p.add_argument("--out", default=None,
                   help=f"output file (default RUN_DIR/report.html; several runs: FIRST_RUN_DIR/{COMPARE_FILE})")
    p.add_argument("--smooth", type=float, default=0.0, metavar="WEIGHT",
                   help="EMA smoothing weight in [0, 1), as TensorBoard's slider; raw values stay drawn faint "
                        "(default 0: off)")
    p.add_argument("--x", choices=X_AXES, default="step",
                   help="x axis: step, or time = wall-clock seconds since the run's first step (default step)")
    a = p.parse_args(argv)
    if a.out is not None:
        from trainforge.storage.output_paths import refuse_overlap

        # A new file beside a run's files is the default (RUN_DIR/report.html); one of the files read is not.
        refuse_overlap(a.out, "--out", [(what, Path(d) / f) for d in a.run_dirs
                                        for what, f in (("RUN_DIR", ""), ("RUN_DIR's", "metrics.jsonl"),
                                                        ("RUN_DIR's", "config.toml"))], allow_inside=True)
    print(f"report: {write_report(a.run_dirs, a.out, smooth=a.smooth, x=a.x)}")
    return 0


def _plan(argv: list[str]) -> int:
    from trainforge.model.config import FLAVORS

    p = ArgumentParser(prog="trainforge plan",
                       description="Rank parallel layouts of a model on a cluster by predicted step time (the cost "
                                   "model of plan/cost_model.py; shapes only, no weights are built).")
    p.add_argument("--model", required=True, choices=sorted(FLAVORS), metavar="FLAVOR", help="model flavor")
    p.add_argument("--gpus", type=int, required=True, help="number of GPUs")
    p.add_argument("--gpu", default=None, help="h100, h200, h800, a100-80g, mi300x, or measured (a probe of "
                                                 "this machine, where available) (default h100)")
    p.add_argument("--machine", choices=["measured"], default=None,
                   help="measured: this machine, probed (= --gpu measured; --gpus processes of one thread)")
    p.add_argument("--seq_len", type=int, default=4096, help="tokens per sequence (default 4096)")
    p.add_argument("--global_batch", type=int, default=None,
                   help="sequences per optimizer step (default 2 x --gpus)")
    p.add_argument("--precision", default="bf16-mixed",
                   help="[precision] policy (default bf16-mixed), or fp8: bf16-mixed with the blocks' linear GEMMs "
                        "at the board's FP8 peak (planning only: the trainer has no FP8 policy)")
    p.add_argument("--compression", default="none", help="[compression] codec on dp_replicate (default none)")
    p.add_argument("--compile", action="store_true",
                   help="predict for parallel.compile = true (torch.compile fuses the blocks' elementwise ops; "
                        "written into --output) (default: eager)")
    p.add_argument("--calibrate", action="store_true",
                   help="with --gpu measured: calibrate the probed machine to this model by short one-process "
                        "runs of it (plan/calibration.py: ~3 min for tiny; fp32, models that train here in "
                        "seconds) (default: the probe alone)")
    p.add_argument("--top", type=int, default=10, help="layouts to show (default 10)")
    p.add_argument("--json", action="store_true", help="print the ranked layouts as JSON instead of a table")
    p.add_argument("--output", default=None, metavar="FILE",
                   help="write the best layout as a TOML config that trainforge train --config reads")
    a = p.parse_args(argv)
    import dataclasses
    import json

    from trainforge.config import load_config
    from trainforge.errors import ConfigError
    from trainforge.plan.planner import config_toml, plan
    from trainforge.plan.spec import Workload

    if a.gpus < 1 or a.seq_len < 1 or a.top < 1:
        raise ConfigError("--gpus, --seq_len and --top must be >= 1")
    if a.machine and a.gpu not in (None, a.machine):
        raise ConfigError(f"--machine {a.machine} and --gpu {a.gpu} name two clusters: give one of them")
    a.gpu = a.machine or a.gpu or "h100"
    if a.calibrate and a.gpu != "measured":
        raise ConfigError(f"--calibrate measures this machine: use it with --gpu measured, not --gpu {a.gpu}")
    if a.calibrate and a.precision != "fp32":
        raise ConfigError(f"--calibrate runs the model in fp32: add --precision fp32 (not {a.precision})")
    if a.precision == "fp8":
        _check_fp8(a.gpu, a.output)
    cluster = _plan_cluster(a.gpu, a.gpus)
    batch = a.global_batch if a.global_batch is not None else 2 * a.gpus
    if batch < 1:
        raise ConfigError(f"--global_batch {batch}: must be >= 1")
    base = FLAVORS[a.model]
    cfg = dataclasses.replace(base, max_seq_len=max(base.max_seq_len, a.seq_len))
    workload = Workload(cfg, seq_len=a.seq_len, global_batch=batch, precision=a.precision,
                        compression=a.compression, flavor=a.model,
                        stack="trainforge-compile" if a.compile else "trainforge")
    if a.calibrate:
        from trainforge.plan.calibration import calibrate

        cluster = calibrate(cluster, workload)
    try:
        ranked = plan(workload, cluster)
    except ValueError as e:  # an unknown precision policy or codec
        raise ConfigError(str(e)) from None
    shown = ranked[:a.top]
    if a.json:
        print(json.dumps({"model": a.model, "gpu": cluster.name, "gpus": a.gpus, "seq_len": a.seq_len,
                          "global_batch": batch, "precision": a.precision, "compression": a.compression,
                          "stack": workload.stack, "layouts": [_estimate_json(e) for e in shown]}, indent=1))
    else:
        _print_plan(shown, cluster, workload, len(ranked))
    if a.output:
        best = ranked[0] if ranked else None
        if best is None or not best.feasible:
            raise ConfigError(f"--output {a.output}: no layout fits ({best.why if best else 'none found'}); "
                              "try more GPUs, a shorter --seq_len or a smaller --global_batch")
        out = Path(a.output)
        out.write_text(config_toml(workload, best, header=(
            f"trainforge plan --model {a.model} --gpus {a.gpus} --gpu {cluster.name} --seq_len {a.seq_len} "
            f"--global_batch {batch}{' --compile' if a.compile else ''}\npredicted {best.step_s:.3f} s/step, "
            f"{best.tokens_per_s_per_gpu:.0f} tokens/s/GPU, "
            f"MFU {best.mfu:.1%}, {best.memory_bytes_per_gpu / 2**30:.1f} GiB/GPU")))
        load_config(out)  # what train --config will do: fails here, not at launch, if a key is wrong
        if not a.json:
            print(f"best layout written to {out} (trainforge train --config {out}; add data.path and steps)")
    return 0


def _check_fp8(gpu: str, output: str | None) -> None:
    """``--precision fp8`` needs a board with FP8 tensor cores (before any probe is run) and
    no ``--output`` (the trainer has no FP8 policy to write)."""
    from trainforge.errors import ConfigError
    from trainforge.plan.hardware import GPUS, VARIANTS, has_fp8

    spec = GPUS.get(gpu.lower()) or VARIANTS.get(gpu.lower())
    if gpu == "measured" or (spec is not None and not has_fp8(spec.peak_flops)):
        with_fp8 = ", ".join(k for k, g in GPUS.items() if has_fp8(g.peak_flops))
        peaks = ("a CPU probe measures fp32 and bf16" if spec is None
                 else f"its peaks: {', '.join(sorted(spec.peak_flops))}")
        raise ConfigError(f"--precision fp8: {gpu} has no FP8 tensor cores ({peaks}); plan it with --precision "
                          f"bf16-mixed, or fp8 on {with_fp8}")
    if output:
        raise ConfigError(f"--output {output} with --precision fp8: the trainer has no FP8 policy to write; plan with "
                          "--precision bf16-mixed for a config to run")


def _plan_cluster(gpu: str, n: int):
    from trainforge.errors import ConfigError

    if gpu == "measured":
        try:
            from trainforge.plan.probe import measured_cluster  # the probe of this machine, when it exists
        except ImportError:
            raise ConfigError("--gpu measured: the machine probe (trainforge.plan.probe) is not available in this "
                              "version; name a GPU from the table (h100, h200, h800, a100-80g, mi300x)") from None
        return measured_cluster(n)
    from trainforge.plan.hardware import cluster

    try:
        return cluster(gpu, n)
    except ValueError as e:
        raise ConfigError(f"--gpu {gpu}: {e}") from None


def _layout_label(layout) -> str:
    parts = [f"{k}={getattr(layout, k)}" for k in ("dp_replicate", "dp_shard", "tp", "pp", "ep")
             if getattr(layout, k) > 1 or k == "dp_shard"]
    return " ".join(parts)


def _estimate_json(e) -> dict:
    import dataclasses
    import math

    def num(x: float):
        return x if math.isfinite(x) else None

    return {"layout": dataclasses.asdict(e.layout), "feasible": e.feasible, "why": e.why,
            "step_s": num(e.step_s), "memory_bytes_per_gpu": num(e.memory_bytes_per_gpu), "mfu": e.mfu,
            "comm_share": e.comm_share, "bubble_fraction": e.bubble_fraction,
            "tokens_per_s_per_gpu": e.tokens_per_s_per_gpu,
            "breakdown": {k: num(v) for k, v in e.breakdown.items()}}


def _print_plan(shown, cluster, workload, n_total: int) -> None:
    from rich.console import Console
    from rich.table import Table

    n_ok = sum(e.feasible for e in shown)
    table = Table(title=f"{workload.flavor} on {cluster.n_gpus} x {cluster.name}: seq_len {workload.seq_len}, "
                        f"global batch {workload.global_batch}, {workload.precision}, compression "
                        f"{workload.compression} ({n_total} layouts priced)")
    for col in ("#", "layout", "tp mode", "microbatches / schedule", "grad accum", "act. ckpt", "GiB/GPU", "step s",
                "tokens/s/GPU", "MFU", "comm", "bubble"):
        table.add_column(col, justify="left" if col in ("layout", "microbatches / schedule") else "right")
    for i, e in enumerate(shown, 1):
        L = e.layout
        sched = f"{L.microbatches} {L.pp_schedule}" if L.pp > 1 else "-"
        mem = f"{e.memory_bytes_per_gpu / 2**30:.1f}" if e.memory_bytes_per_gpu == e.memory_bytes_per_gpu else "-"
        if e.feasible:
            nums = [f"{e.step_s:.3f}", f"{e.tokens_per_s_per_gpu:,.0f}", f"{e.mfu:.1%}", f"{e.comm_share:.1%}",
                    f"{e.bubble_fraction:.1%}"]
        else:
            nums = ["-", "-", "-", "-", f"[red]{e.why}[/red]"]
        # tp_mode: 1d (Megatron) or 2d (SUMMA grid); the printed layout runs with --parallel.tp_mode <it>
        table.add_row(str(i), _layout_label(L), L.tp_mode if L.tp > 1 else "-", sched, str(L.grad_accum_steps),
                      "full" if L.activation_checkpoint else "none", mem, *nums)
    Console(width=max(160, Console().width)).print(table)
    if n_ok == 0:
        print("no layout fits: try more GPUs, a shorter --seq_len or a smaller --global_batch")


def _advise(argv: list[str]) -> int:
    import json
    import subprocess

    from trainforge.config import config_from_dict, config_to_toml
    from trainforge.errors import ConfigError
    from trainforge.plan.advice_rules import Context
    from trainforge.plan.advise import (ADVISED_FILE, advise, device_memory, hardware_capability, newest_checkpoint,
                                        next_run, prepare_next_run, render, to_json)
    from trainforge.plan.run_evidence import read_run
    from trainforge.storage.locks import RUN_LOCK_FILE, run_holder

    p = ArgumentParser(prog="trainforge advise",
                       description="Ranked suggestions from a run's measurements (step time split, pipeline "
                                   "stages and bubble, comm share, memory, MFU, data wait, profiler) and "
                                   "optional inference measurements, each with its evidence and predicted "
                                   "gain. Prints only: --output writes the advised config (the run's config with "
                                   "the training changes applied, for `trainforge train --config`), --apply "
                                   "writes it and starts the next run.")
    p.add_argument("run_dir", metavar="RUN_DIR", help="a run directory (config.toml + metrics.jsonl)")
    p.add_argument("--inference", nargs="+", default=[], metavar="FILE",
                   help="inference measurements: `trainforge generate --stats` JSON, a /metrics scrape of "
                        "`trainforge serve`, or bench/inference.py --json output (serving advice; KV pool and "
                        "batch-row advice needs the server's scrape)")
    p.add_argument("--output", default=None, metavar="FILE",
                   help="write the advised config (TOML) to FILE (default: write nothing)")
    p.add_argument("--apply", action="store_true",
                   help=f"write the advised config to RUN_DIR/{ADVISED_FILE} (or --output) and start the next run "
                        "from it in RUN_DIR-advised: resumed from the newest checkpoint when every change keeps "
                        "resume exact, else fresh (it says which). Refused while RUN_DIR is still training")
    p.add_argument("--json", action="store_true",
                   help="print the advice as JSON instead of a table, with every rule checked (pass / fail, "
                        "threshold, measured value)")
    p.add_argument("--memory_limit_gb", type=float, default=None,
                   help="device memory the peak is compared with (default: the GPU's, or this host's RAM)")
    p.add_argument("--no_hardware_probe", action="store_true",
                   help="skip the precision rule (it reads, or measures once, this CPU's bf16/fp16 probe)")
    a = p.parse_args(argv)
    run_dir = Path(a.run_dir)
    advised_file = Path(a.output) if a.output else (run_dir / ADVISED_FILE if a.apply else None)
    if advised_file is not None:
        # A live run keeps writing its directory and would be resumed from under itself: refuse
        # before anything is measured or written (the trainer holds RUN_DIR/.train.lock).
        holder = run_holder(run_dir)
        inside = advised_file.resolve().is_relative_to(run_dir.resolve())
        if holder is not None and (a.apply or inside):
            who = f"pid {holder}" if holder else "a trainer"
            raise TrainforgeError(
                f"{run_dir} is still training ({who} holds {run_dir / RUN_LOCK_FILE}): "
                + ("--apply starts the next run once it has finished or been stopped (SIGTERM saves a checkpoint)"
                   if a.apply else f"--output {advised_file} would write into it; write outside it or wait "
                                   "for the run to finish"))
    ev = read_run(run_dir)
    if a.memory_limit_gb is not None:
        if a.memory_limit_gb <= 0:
            raise TrainforgeError(f"--memory_limit_gb {a.memory_limit_gb}: must be > 0")
        limit, source = a.memory_limit_gb * 2**30, "--memory_limit_gb"
    else:
        limit, source = device_memory(ev)
    ctx = Context(limit, source, None if a.no_hardware_probe else hardware_capability(ev))
    advice = advise(run_dir, a.inference, ctx, ev)
    # The Config round trip: the advised config is what `trainforge train --config` reads back.
    try:
        text = config_to_toml(config_from_dict(advice.advised, f"{run_dir}/config.toml + advice").validate())
    except ConfigError as e:
        raise TrainforgeError(f"the advised config does not validate ({e}); report this with {run_dir}/config.toml "
                              "and drop the suggestion by hand") from None
    if a.apply and not advice.applied and not a.output:
        advised_file = None  # nothing to start from: --apply writes nothing either
    if advised_file is not None:
        advised_file.write_text(text, encoding="utf-8")
    if a.json:
        print(json.dumps(to_json(advice, advised_file), indent=1, default=str))
    else:
        render(advice, advised_file)
    if not a.apply:
        return 0
    if not advice.applied:
        print("--apply: no training change to apply; not starting a run", file=sys.stderr)
        return 0
    ckpt = newest_checkpoint(run_dir)
    nxt = next_run(advice, advised_file, ckpt)
    prepare_next_run(nxt, text, ckpt)
    print(f"next run: {nxt.run_dir} ({nxt.why})", file=sys.stderr)
    print("running: " + " ".join(nxt.argv), file=sys.stderr, flush=True)
    # With --json, stdout stays one JSON document: the run's own output goes to stderr.
    out = None
    if a.json:
        try:
            out = sys.stderr.fileno()
        except (AttributeError, OSError, ValueError):
            out = subprocess.DEVNULL
    return subprocess.run(nxt.argv, stdout=out).returncode


COMMANDS = {"prepare": _prepare, "train": _train, "generate": _generate, "quantize": _quantize,
            "serve": _serve, "export": _export, "report": _report, "plan": _plan, "advise": _advise}
# One line each for `trainforge --help`.
SUMMARIES = {
    "prepare": "tokenise text into memory-mappable shards with a manifest",
    "train": "train a model (a TOML config + --section.key overrides)",
    "generate": "generate text from a checkpoint with the inference engine",
    "quantize": "write an int8 / int4 checkpoint that generate and serve load",
    "export": "write a checkpoint as a Hugging Face directory (for vLLM)",
    "serve": "OpenAI-compatible HTTP server with continuous batching",
    "report": "write an HTML report of one or several runs (overlaid, config diff)",
    "plan": "rank parallel layouts of a model on a cluster by predicted step time",
    "advise": "ranked suggestions from a run's measurements (--output: advised config; --apply: next run)",
}


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(top_level_help(SUMMARIES), end="")
        if not argv:
            print("trainforge: error: no command given; choose one of the commands above", file=sys.stderr)
        return 0 if argv else exit_codes.BAD_INPUT
    if argv[0] == "--version":
        print(f"trainforge {package_version()}")
        return 0
    if argv[0] not in COMMANDS:
        print(f"trainforge: error: {unknown_command(argv[0], list(COMMANDS))}", file=sys.stderr)
        return exit_codes.BAD_INPUT
    try:
        return COMMANDS[argv[0]](argv[1:])
    except TrainforgeError as e:
        print(f"trainforge {argv[0]}: error: {e}", file=sys.stderr)
        return getattr(e, "exit_code", exit_codes.BAD_INPUT)  # a diverged loss or a failed peer say so
    except OSError as e:
        # A full or read-only disk mid-run (checkpoint, metrics) is the user's to fix: one line naming the
        # path. Checkpoints are written to a hidden .tmp directory and renamed, so earlier ones stay intact.
        if e.errno not in (errno.ENOSPC, errno.EDQUOT, errno.EROFS):
            raise
        where = f" writing {e.filename}" if e.filename else ""
        fix = "mount is read-only" if e.errno == errno.EROFS else "disk is full: free space"
        print(f"trainforge {argv[0]}: error: {e.strerror}{where}; the {fix} (or choose another directory) "
              "and run again", file=sys.stderr)
        return exit_codes.BAD_INPUT


if __name__ == "__main__":
    raise SystemExit(main())
