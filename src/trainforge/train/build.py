"""What a ``Trainer`` is built from, before its loop runs: the device, the seeded RNGs,
the checks that refuse a run before anything is allocated, and the model stack (the
full model, precision applied first, then the parallel layout from outside, and the
step mechanics of that layout: ``step_layout.py``)."""

from __future__ import annotations

import dataclasses
import logging
import math
import random
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from trainforge.compression.hooks import check_compression
from trainforge.errors import ConfigError
from trainforge.model import build_model
from trainforge.model.preflight import check_training
from trainforge.parallel.apply import (
    build_pipeline_parts,
    check_pipeline_layout,
    expert_grad_reducer,
    parallelize_module_stack,
)
from trainforge.parallel.data_parallel import data_parallel_kind
from trainforge.parallel.partial_grads import partial_grad_reducer
from trainforge.parallel.shared_embedding import shared_embedding_grads
from trainforge.parallel.tensor_parallel import cross_entropy_loss
from trainforge.precision.casting import apply_precision
from trainforge.precision.policy import PrecisionPolicy, build_policy
from trainforge.train.chunked_loss import check_chunked_loss
from trainforge.train.mixed_precision import TrainerPrecision, check_precision_layout, compile_note
from trainforge.train.mtp_loss import check_mtp_layout
from trainforge.train.offload_section import check_offload_layout
from trainforge.train.qat import check_qat
from trainforge.train.seq_len_ladder import check_schedule_layout
from trainforge.train.step_layout import LocalStep, LossFn, PipelineStep, StepLayout, pipeline_loss


def pick_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"config key 'training.device' = {name!r}: CUDA is not available here; use auto or cpu")
    return device


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def check_run(cfg: Any, model_config: Any, dims: Any, device: torch.device, log: logging.Logger | None
              ) -> tuple[PrecisionPolicy, Any]:
    """Refuse, naming the key, a run this machine or layout cannot hold: before anything is
    allocated and before the first collective, identically on every rank. Returns the
    resolved precision policy and the pipeline layout (None unpipelined). ``log``: rank 0's."""
    tcfg = cfg.training
    check_training(model_config, cfg.model.flavor, tcfg.batch_size, tcfg.seq_len, device,
                   state_shards=dims.dp_shard * dims.tp * dims.pp, layer_shards=dims.pp,
                   tp=dims.tp, activation_checkpointing=cfg.parallel.activation_checkpointing == "full",
                   loss_chunk_tokens=tcfg.loss_chunk_tokens)
    pp_layout = None
    if dims.pp > 1:
        pp_layout = check_pipeline_layout(model_config, dims, cfg.parallel, tcfg.batch_size)
    if cfg.parallel.tp_mode == "2d" and dims.tp > 1:
        from trainforge.parallel.tp2d.apply import check_tp2d

        check_tp2d(model_config, dims.tp, batch_size=tcfg.batch_size, pp=dims.pp,
                   microbatches=pp_layout[1] if pp_layout else 1, compile=cfg.parallel.compile,
                   loss_chunk_tokens=tcfg.loss_chunk_tokens)
        # 2-D splits heads and widths q = sqrt(tp) ways (checked above), not tp: the other axes' checks only.
        dataclasses.replace(dims, tp=1).check_model(model_config)
    else:
        dims.check_model(model_config)
    check_chunked_loss(tcfg.loss_chunk_tokens, dims)
    check_mtp_layout(tcfg, model_config, dims)
    check_qat(cfg.qat, dims, model_config, compile=cfg.parallel.compile)
    check_offload_layout(cfg.offload, data_parallel_kind(dims))
    note = check_schedule_layout(tcfg, cfg.parallel, cfg.data.augment.transforms)  # training.seq_len_schedule
    if note and log is not None:
        log.info(note)
    warning = check_compression(cfg.compression, dims, data_parallel_kind(dims), cfg.precision.policy)
    if warning and log is not None:
        log.warning(warning)
    # Resolved identically on every rank (a hardware probe, agreed by one all-reduce
    # unless compute is fp32), so a refused combination fails everywhere before the mesh.
    policy = build_policy(cfg.precision, device, log=log)
    note = check_precision_layout(policy, dims, data_parallel_kind(dims))
    if note and log is not None:
        log.info(f"precision: {note}")
    return policy, pp_layout


@dataclass
class ModelStack:
    """``model``: the wrapped model (None when pipelined); ``model_parts``: this rank's
    unwrapped modules (pipeline stages, or the one model), FQNs unchanged; ``opt_parts``:
    what optimizers step, clipping measures and checkpoints hold (the fp32 master copy
    when parameters are stored low, else ``model_parts``)."""

    mp: TrainerPrecision
    model: torch.nn.Module | None
    model_parts: list[torch.nn.Module]
    opt_parts: list[torch.nn.Module]
    pipeline: Any | None
    pp_predicted: list[float] | None  # the split's planned per-stage seconds
    layout: StepLayout


def build_model_stack(cfg: Any, model_config: Any, dims: Any, mesh: Any, device: torch.device,
                      policy: PrecisionPolicy, compressor: Any, pp_layout: Any, loss_fn: LossFn,
                      log: logging.Logger | None, model_loss: Any = None,
                      init_weights: dict[str, torch.Tensor] | None = None) -> ModelStack:
    """Every rank builds the full model from the same seed, then keeps its part, so
    sharded/split results equal the single-process model's. ``loss_fn``: the mean loss of
    the unpipelined model (the trainer's ``_loss``); ``model_loss``: the loss component of a
    model with extra training heads (``MTPLoss``; None: plain cross-entropy), whose
    ``stage_loss`` is the pipeline's loss on the last stage. ``init_weights``: a full state dict
    (``model.init_from``) that replaces the seeded init before precision and parallelism, so
    every layout shards or splits those weights as it would its own."""
    tcfg = cfg.training
    full_model = build_model(model_config, device, seed=tcfg.seed)
    if init_weights is not None:
        full_model.load_state_dict(init_weights, strict=True)  # copies onto the device; shapes checked by name
    # Precision first (parallel/apply.py's step 0): casts, fp32 master copy, autocast rule wrappers.
    sharded = data_parallel_kind(dims) in ("fsdp", "hsdp")
    runtime = apply_precision(full_model, policy, sharded=sharded)
    note = compile_note(runtime) if cfg.parallel.compile else None
    if note and log is not None:
        log.info(f"precision: {note}")
    mp = TrainerPrecision(cfg.precision, policy, runtime, device, sharded=sharded, log=log,
                          pp_group=mesh["pp"].get_group() if dims.pp > 1 else None)
    common = dict(dims=dims, mesh=mesh, device=device, mp=mp, loss_parallel=cfg.parallel.loss_parallel)
    cpu_offload = cfg.offload.optimizer and cfg.offload.mode == "fsdp"  # FSDP2's CPUOffloadPolicy
    if dims.pp > 1:
        # Each rank keeps its pipeline stages ("model parts"), FQNs unchanged.
        stage_loss = model_loss.stage_loss if model_loss is not None else cross_entropy_loss
        pipeline, model_parts, predicted = build_pipeline_parts(
            full_model, mesh, dims, cfg.parallel, device, tcfg.batch_size, tcfg.seq_len, pp_layout,
            pipeline_loss(mp, tcfg.grad_accum_steps, stage_loss), log=log.info if log is not None else None,
            compressor=compressor, precision=policy, cpu_offload=cpu_offload)
        if model_loss is not None:  # its stage_loss runs the last stage's MTP modules
            model_loss.bind_stage(pipeline.last_stage_module, pipeline.microbatches)
        runtime.rebind(torch.nn.ModuleList(model_parts))  # the stages are copies; free the whole model
        act_shape = (tcfg.batch_size, tcfg.seq_len, model_config.dim)
        if dims.tp > 1 and cfg.parallel.tp_mode == "2d":  # X_ij: batch rows by grid row, hidden by grid column
            q = math.isqrt(dims.tp)
            act_shape = (tcfg.batch_size // q, tcfg.seq_len, model_config.dim // q)
        elif dims.tp > 1 and cfg.parallel.sequence_parallel:  # the local sequence shard
            act_shape = (tcfg.batch_size, tcfg.seq_len // dims.tp, model_config.dim)
        layout: StepLayout = PipelineStep(pipeline, model_parts, act_shape,
                                          eval_loss=stage_loss, **common)
        # An MTP model's embedding is on the first and the last stage: one gradient, counted once.
        shared = shared_embedding_grads(pipeline, mesh["pp"].get_group(), mesh.local_rank("pp"), dims.pp)
        if shared is not None:
            layout.grad_finishers.append(shared)
            layout.counted_elsewhere.extend(shared.duplicates)
        model = None
    else:
        pipeline, predicted = None, None
        model = parallelize_module_stack(full_model, mesh, dims, cfg.parallel, device, compressor, precision=policy,
                                         cpu_offload=cpu_offload)
        model_parts = [getattr(model, "module", model)]  # DDP wraps; state dicts use raw FQNs
        layout = LocalStep(model, loss_fn, **common)
    del full_model
    reducer = expert_grad_reducer(model_parts, mesh, dims)
    if reducer is not None:
        layout.grad_finishers.append(reducer)
    partials = partial_grad_reducer(model_parts, dims.tp)  # TP's Partial norm-weight gradients, summed once
    if partials is not None:
        layout.grad_finishers.append(partials)
    return ModelStack(mp, model, model_parts, mp.opt_parts(model_parts), pipeline, predicted, layout)
