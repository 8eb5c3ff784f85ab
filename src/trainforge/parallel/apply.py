"""Apply parallelism to a single-device model, in one documented order:

0. precision (the trainer calls ``precision.apply_precision`` on the whole model first:
   parameter casts, fp32 master copy, autocast rule wrappers, which every later step keeps)
1. pipeline split (each rank keeps its stages; FQNs unchanged)  -- ``pipeline.py``
2. tensor parallel (DTensor plans; must see plain modules)        -- ``tensor_parallel.py``
   or, with ``parallel.tp_mode = "2d"``, SUMMA on a q x q grid      -- ``tp2d/apply.py``
   or expert parallel (routed experts sharded over ``ep``,
   token all-to-all hooks; per pipeline stage)                     -- ``expert_parallel.py``
3. activation checkpointing (wraps whole blocks)                  -- ``activation_checkpoint.py``
4. compile (optional, per block: ``parallel.compile``; ~1.0x on CPU, real gains on GPU)
5. data parallel: FSDP2 / HSDP last, so it shards the TP-sharded
   DTensors along one more mesh axis; DDP only without TP/PP; the
   expert-parallel parameters are left out (reduced over edp)    -- ``data_parallel.py``
"""

from __future__ import annotations

import torch
from torch import nn

from trainforge.errors import ConfigError
from trainforge.parallel.activation_checkpoint import apply_activation_checkpointing
from trainforge.parallel.data_parallel import apply_data_parallel
from trainforge.parallel.dims import ParallelDims, ParallelMesh
from trainforge.precision.hardware import cpu_compile_unavailable


def parallelize_module_stack(model: nn.Module, mesh: ParallelMesh | None, dims: ParallelDims, section,
                             device: torch.device, compressor=None, precision=None, cpu_offload: bool = False
                             ) -> nn.Module:
    """Steps 2-5 for one model or pipeline-stage module. Returns the module to call.
    ``compressor`` compresses gradients on the dp_replicate axis (step 5); ``precision``
    (a ``PrecisionPolicy``) gives FSDP2 its mixed-precision policy (step 5). With
    ``dims.ep`` > 1 the expert gradients need ``expert_grad_reducer(parts, ...)`` after
    each backward. ``cpu_offload``: FSDP2's CPUOffloadPolicy in step 5."""
    ignored: list[nn.Parameter] = []
    if dims.ep > 1 and mesh is not None:
        from trainforge.parallel.expert_parallel import apply_expert_parallel

        ignored = apply_expert_parallel(model, mesh.experts)
    if dims.tp > 1 and mesh is not None and section.tp_mode == "2d":
        from trainforge.parallel.tp2d.apply import apply_tp2d

        apply_tp2d(model, mesh["tp"])
    elif dims.tp > 1 and mesh is not None:
        from trainforge.parallel.tensor_parallel import apply_tensor_parallel

        apply_tensor_parallel(model, mesh["tp"], sequence_parallel=section.sequence_parallel,
                              loss_parallel=section.loss_parallel)
    apply_activation_checkpointing(model, section.activation_checkpointing)
    if section.compile:
        if torch.device(device).type == "cpu" and (why := cpu_compile_unavailable()):
            raise ConfigError(f"parallel.compile = true: {why}; install g++ (Debian/Ubuntu: apt install g++) "
                              "or set parallel.compile = false (~1.0x on CPU anyway)")
        # Per block, not the whole model: one compiled graph reused by every block, and
        # FSDP's per-block hooks stay outside the compiled regions.
        for block in model.layers.values():
            block.compile()
    return apply_data_parallel(model, mesh, dims, device, compressor, precision, ignored_params=ignored,
                               cpu_offload=cpu_offload)


def expert_grad_reducer(parts: list[nn.Module], mesh: ParallelMesh | None, dims: ParallelDims):
    """The finisher of expert gradients (sum over edp, divide by dp) for the parameters of
    ``parts`` (unwrapped modules), or None without expert parallelism."""
    if dims.ep == 1 or mesh is None:
        return None
    from trainforge.parallel.expert_parallel import ExpertGradReducer, expert_params

    return ExpertGradReducer([p for part in parts for p in expert_params(part)], mesh["edp"], dims.dp)


def explicit_split(section) -> list[int] | None:
    """``parallel.pp_split`` as a list of stage starts, or None for ``auto`` / ``even``."""
    return None if section.pp_split in ("auto", "even") else [int(x) for x in section.pp_split.split(",")]


def pipeline_boundaries(model: nn.Module, section, num_stages: int, batch_size: int, seq_len: int,
                        microbatches: int, device: torch.device,
                        log=None) -> tuple[list[int] | None, list[float] | None]:
    """``parallel.pp_split``: explicit list, ``even`` (None), or ``auto``: every rank
    profiles the full model on one microbatch, the timings are averaged over all ranks
    (so every rank chooses the same split), and the slowest stage is minimised.
    Returns (boundaries, predicted seconds per stage; None unless auto)."""
    if section.pp_split != "auto":
        return explicit_split(section), None
    from trainforge.parallel.stage_balance import average_layer_costs, plan_stages, profile_layer_costs

    mb = max(1, batch_size // microbatches)
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, model.cfg.vocab_size, (mb, seq_len + 1), generator=gen).to(device)
    costs = profile_layer_costs(model, tokens[:, :-1], tokens[:, 1:], steps=3)
    model.zero_grad(set_to_none=True)
    # Averaged over the whole world, not just this rank's pp group: TP and FSDP peers sit
    # in other pp groups and must hold exactly the same layers.
    costs = average_layer_costs(costs, None)
    limit = section.pp_memory_limit_mb * 2**20 or None
    plan = plan_stages(costs, num_stages, memory_limit_bytes=limit,
                       in_flight_microbatches=min(microbatches, num_stages), log=False)
    if log is not None:
        ms = lambda ts: [round(1e3 * t, 1) for t in ts]  # noqa: E731
        log(f"pipeline split auto: boundaries {plan.boundaries}, measured stage ms {ms(plan.stage_times_s)}; "
            f"even {plan.even_boundaries}: {ms(plan.even_stage_times_s)} ({plan.predicted_speedup:.2f}x)")
    return list(plan.boundaries), list(plan.stage_times_s)


def check_pipeline_layout(model_config, dims: ParallelDims, section, batch_size: int) -> tuple[int, int]:
    """Validate the pipeline settings before any collective. Returns (stages, microbatches)."""
    from trainforge.model.pipeline_plans import split_backward_refusal
    from trainforge.parallel.pipeline import check_pipeline_config, stages_per_rank

    explicit = explicit_split(section)
    num_stages = stages_per_rank(section.pp_schedule, dims.pp, explicit) * dims.pp
    microbatches = section.microbatches or 2 * num_stages
    check_pipeline_config(model_config.n_layers, dims.pp, section.pp_schedule, microbatches, explicit, batch_size,
                          model_config.tie_embeddings, split_backward_refusal(model_config))
    if dims.pp > 1 and getattr(model_config, "pipeline_spans", ()):
        from trainforge.errors import ConfigError
        from trainforge.parallel.pipeline import check_stage_starts, even_boundaries

        if section.pp_split == "auto":
            # The profiler times each block alone on full-rate hidden states; a span that must run
            # on one stage holds blocks that do not run so (ones on a reduced-rate sequence).
            raise ConfigError(f"config key 'parallel.pp_split' = 'auto' (parallel.pp = {dims.pp}) cannot measure "
                              f"the blocks of {model_config.pipeline_spans_source}; give the stage starts "
                              "(parallel.pp_split = 0,...) or even, outside the spans a stage must hold whole")
        check_stage_starts(model_config, explicit or even_boundaries(model_config.n_layers, num_stages), dims.pp)
    return num_stages, microbatches


def build_pipeline_parts(model: nn.Module, mesh: ParallelMesh, dims: ParallelDims, section, device: torch.device,
                         batch_size: int, seq_len: int, layout: tuple[int, int], loss_fn, log=None,
                         compressor=None, precision=None, cpu_offload: bool = False):
    """Step 1 (pipeline split) then steps 2-5 on each stage. ``layout`` is
    ``check_pipeline_layout``'s (stages, microbatches), validated before the mesh existed.
    Returns (Pipeline, stage modules, predicted seconds per stage or None)."""
    from trainforge.parallel.pipeline import build_pipeline, split_model

    schedule = section.pp_schedule
    num_stages, microbatches = layout
    boundaries, predicted = pipeline_boundaries(model, section, num_stages, batch_size, seq_len, microbatches,
                                                device, log)
    pp_rank = mesh.local_rank("pp")
    parts = split_model(model, pp_rank, dims.pp, boundaries, schedule)
    parts = [parallelize_module_stack(p, mesh, dims, section, device, compressor, precision, cpu_offload)
             for p in parts]
    pipeline = build_pipeline(parts, mesh["pp"], pp_rank, dims.pp, schedule, microbatches, loss_fn, device,
                              batch_size)
    return pipeline, parts, predicted
