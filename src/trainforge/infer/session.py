"""An inference session: the model (and drafter) loaded, quantised and prepared for the engine,
as ``trainforge generate`` and ``serve`` run it. ``opts`` is a ``SessionOptions``
(``session_options.py``) or anything with its attributes. Errors a user can fix raise
``TrainforgeError`` in one line naming the option."""

from __future__ import annotations

from typing import Any, Callable

from trainforge.errors import TrainforgeError


def speculative_args(opts) -> tuple[str, str | None] | None:
    """``(mode, draft path)`` of --speculative, validated with --num_speculative_tokens before
    any weight is read; None without --speculative."""
    from trainforge.infer.speculative import check_num_speculative_tokens, parse_speculative

    if opts.speculative is None:
        return None
    try:
        check_num_speculative_tokens(opts.num_speculative_tokens)
        mode, path = parse_speculative(opts.speculative)
    except ValueError as e:
        raise TrainforgeError(str(e)) from None
    return mode, path


def trained_grid(checkpoint: str, requested: str, group_size: int | None, what: str = "--quantize"):
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


def load_for_engine(opts, kv_slots: Callable[[Any], int] | None = None):
    """The ``LoadedModel`` of ``opts.checkpoint``, quantised (``opts.quantize``, or the grid a
    QAT checkpoint trained for) and prepared (fusion, quantised kernels). ``kv_slots(cfg)``:
    the engine's KV pool in token slots, for the memory preflight before any weight is read."""
    from trainforge.infer.loading import load_model
    from trainforge.infer.malloc_release import map_large_blocks_for_load, release_freed_memory
    from trainforge.infer.prepare import prepare_model
    from trainforge.infer.quantize import quantize_model

    # A QAT checkpoint is served on the grid it was trained for (decided from meta.json, before any weight).
    mode, group_size, recorded = trained_grid(opts.checkpoint, opts.quantize, opts.group_size)
    # Quantising at load on CPU: the float weights are mapped from the file (read as each layer is
    # quantised, reclaimable after), so the fp32 model is never resident beside the quantised one.
    mapped = mode != "none" and opts.device == "cpu"
    map_large_blocks_for_load()  # until release_freed_memory below: freed load tensors leave at once
    loaded = load_model(opts.checkpoint, opts.device, opts.dtype, kv_slots=kv_slots, mapped=mapped,
                        quantize_to={"mode": mode, "group_size": group_size} if mode != "none" else None,
                        weights=getattr(opts, "weights", "final"))
    if mode != "none":
        if loaded.quantization:
            raise TrainforgeError(f"--quantize {mode}: {opts.checkpoint} is already quantised "
                                  f"({loaded.quantization['mode']})")
        quantize_model(loaded.model, mode, group_size, pack=False, fallback=recorded is None)
    # The inference swaps (fusion, quantised kernels) happen here, before the engine is built.
    prepare_model(loaded.model, fuse=not opts.no_fuse, quant_kernel=opts.quant_kernel)
    release_freed_memory()  # the load's freed copies and repacks leave the process
    return loaded


def load_drafter(opts, spec: tuple[str, str | None] | None, target):
    """The drafter for --speculative (``spec`` from ``speculative_args``): mtp (the target's own
    MTP module, mtp_drafter.py) or draft:CHECKPOINT, its tokenizer checked against the target's."""
    from trainforge.infer.loading import load_model
    from trainforge.infer.prepare import prepare_model
    from trainforge.infer.speculative import DraftModelDrafter

    if spec is None:
        return None
    if spec[0] == "mtp":
        from trainforge.infer.mtp_drafter import MTPDrafter, check_mtp_model

        check_mtp_model(target.model.cfg)
        return MTPDrafter()
    draft = load_model(spec[1], opts.device, opts.dtype)
    if draft.tokenizer is not None and target.tokenizer is not None \
            and draft.tokenizer.to_str() != target.tokenizer.to_str():
        raise TrainforgeError(f"--speculative {opts.speculative}: its tokenizer.json differs from "
                              f"{opts.checkpoint}'s; the draft must share the target's tokenizer")
    prepare_model(draft.model, fuse=not opts.no_fuse)
    return DraftModelDrafter(draft.model)


def engine_config(opts, **kw):
    """The ``EngineConfig`` of ``opts`` (compile, drafts per step) and ``kw`` (pool and batch sizes).
    ``--compile`` without a C++ compiler is refused here, in one line, not by inductor's traceback."""
    from trainforge.infer.engine import EngineConfig
    from trainforge.precision.hardware import cpu_compile_unavailable

    if opts.compile and opts.device == "cpu" and (why := cpu_compile_unavailable()):
        raise TrainforgeError(f"--compile: {why}; install g++ (Debian/Ubuntu: apt install g++) or leave out "
                              "--compile (the C++ decode kernels need no torch.compile)")
    return EngineConfig(compile=opts.compile, num_speculative_tokens=opts.num_speculative_tokens, **kw)


def freeze_long_lived() -> None:
    """Exempt every object made so far (torch's and the model's modules, the engine) from the
    cyclic garbage collector: they live as long as the process, and each full collection walked
    all of them, between decode steps: 3% of a 90m q4_0 decode on one thread (``perf``); 1000
    tokens 1.05x (1.04-1.09) faster with it, 4 interleaved pairs, none measurable at 256. No
    collection first: it would cost as much as one it saves (~0.1 s); a GGUF load has collected
    its reader's cycles already, and any other garbage of the load stays, once."""
    import gc

    gc.freeze()


def inference_mode():
    """The context a session loads the model and builds the engine in (its steps run in the same
    mode, ``Engine.step``): torch's inference mode. Besides skipping autograd's bookkeeping, ops
    then bypass the Autograd and ADInplaceOrView dispatch kernels, whose libtorch code pages each
    distinct op would otherwise map into the process: the 90m q4_0 GGUF's generate peaked 1.4 MiB
    lower (1.3-1.8 over 4 interleaved pairs). The model's tensors become inference tensors, which
    nothing outside inference mode may modify in place: the engine never does."""
    import torch

    return torch.inference_mode()
