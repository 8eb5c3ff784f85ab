"""The advisor's training rules: each reads a run's evidence and returns a suggestion only
when a measurement crosses its threshold, with that measurement, the threshold and a
predicted gain.

    for rule in TRAIN_RULES:
        s = rule(ev, ctx)      # a Suggestion, or a Check (falsy) saying why not

A rule is a plain function of the evidence; every threshold is a named constant below with
the reason for its value. A predicted gain is a tokens/s ratio (after / before) from a
closed form stated in the rule; the formulas live in ``predict.py`` so a cost model can
replace them (``predict.layout_speedup``). Without a suggestion a rule returns a
``Check`` (``advice_types``): passed, not measured or not applicable, with its threshold and
the measured value, for ``advise --json``. Rules never touch files: ``advise.py`` applies
the changes and the CLI writes the advised config.

Hand-written: DeepSpeed's autotuner and vLLM's auto_tune search by trial; no library
turns one run's measurements into config changes."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

from trainforge.plan import comm_model as cm
from trainforge.plan import predict
from trainforge.plan.advice_types import (LARGE_SPEEDUP, Check, Context, Evidence, Suggestion, no_gain,
                                          not_applicable, not_measured, passed)
from trainforge.plan.lr_scaling import batch_change_lr
from trainforge.plan.run_evidence import RunEvidence

# Below this a speed suggestion is not shown at all: within the noise of one run.
MIN_SPEEDUP = 1.03

# Pipeline: slowest stage / mean stage above 1.15 costs >= 13% of the step (a 1F1B step
# runs at the pace of the slowest stage); the auto split reaches 1.0-1.1 on the
# benchmarks' models (docs/benchmarks-archive.md "Pipeline schedules", part 2).
STAGE_IMBALANCE = 1.15
# Bubble (idle / step, mean over stages) above 0.25, once the idle that imbalance causes is
# taken out: the analytic 1F1B bubble at the default m = 2p microbatches is 1/3 (p = 2:
# 0.2 + ~0.08 of gloo/Python per action measured), so 0.25 means "more microbatches pay".
BUBBLE_HIGH = 0.25
# Microbatches per stage the advice aims at: the analytic bubble (p-1)/(m+p-1) is <= 0.2
# at m = 4p for any p, and each microbatch stays large enough to keep its GEMMs shaped.
MICROBATCHES_PER_STAGE = 4
# Communication share (collective time / step, torch.profiler) above 0.25: compression of
# the dp_replicate all-reduce then buys >= 1.2x with int8 (wire 0.254 of fp32).
COMM_SHARE_HIGH = 0.25
# ... and above 0.5 int4 (+ error feedback; wire 0.129 of fp32, no loss regret beyond the
# seed spread in docs/benchmarks-archive.md "Gradient compression") instead of int8.
COMM_SHARE_INT4 = 0.5
# Peak memory above 85% of the device's: the allocator's fragmentation and a longer batch
# (validation, a longer document) leave no more headroom than that.
MEMORY_HIGH = 0.85
# Data wait (batch fetch / step) above 10%: the loader, not the model, sets the pace.
DATA_WAIT_HIGH = 0.10
# Profiling one step in fewer than every 20 pays the profiler's cost on >= 5% of steps (a
# profiled step costs 2-5% more: predict.PROFILED_STEP_SLOWDOWN), for little more insight.
PROFILE_EVERY_MIN = 20
PROFILE_EVERY_ADVISED = 100
# The monitor's own host time (hooks, enrichment, sinks) above 5% of wall time; the
# default monitor costs 0.6% (docs/benchmarks-archive.md "Monitoring overhead").
MONITOR_SHARE_HIGH = 0.05
# MFU below half of what a well-shaped micro-batch reaches on the device
# (predict.MFU_REACHABLE): far from compute-bound, so a larger micro-batch pays; above it
# the gain is within what one more doubling of the batch would risk in memory and lr.
MFU_LOW_SHARE = 0.5
# ... and below 80% when the micro-batch grows by merging accumulation micro-steps
# (batch_size x k, grad_accum_steps / k): the same global batch, so only speed and memory
# change and a milder deficit pays (debug at 1 x 32 tokens x 16 measured MFU 0.07-0.09 here,
# merged 0.13).
MFU_LOW_SHARE_ACCUM = 0.8
# A micro-batch under 4096 tokens leaves per-micro-batch fixed costs (Python, kernel
# launches, hooks) a large share of the step; the advice grows it toward this size.
TARGET_MICROBATCH_TOKENS = 4096
# Layout: a model whose replicated states (predict.DDP_BYTES_PER_PARAM per parameter) fit
# under MEMORY_HIGH on every rank does not need FSDP2's sharding.
# FSDP2's collectives above 10% of the step (an all-gather per block in forward and again in
# backward, a reduce-scatter per block: 3 passes over the parameters in many small calls,
# exposed on CPU) against DDP's one bucketed all-reduce (2 passes).
FSDP_COMM_SHARE = 0.10
# The predicted gain --apply needs: below it a suggestion is shown, not applied (within
# what a run-to-run spread of 2-3% and the predictor's own error can hide).
APPLY_MIN_SPEEDUP = LARGE_SPEEDUP
# A low-precision compute dtype the hardware probe measured at <= 0.8x fp32's matmul time.
LOWP_FASTER = 0.8
# fp16 steps the loss scaler skipped above 5%: that share of the compute is thrown away.
SKIPPED_STEPS_HIGH = 0.05


Rule = Callable[[RunEvidence, Context], "Suggestion | Check"]


def _step(ev: RunEvidence) -> float | None:
    s = ev.median("step_s")
    return s if s and s > 0 else None


# ------------------------------------------------------------------------ pipeline


def pipeline_split(ev: RunEvidence, ctx: Context) -> Suggestion | Check:
    stages = ev.stage_compute_s
    split = str(ev.cfg("parallel.pp_split", "auto"))
    metric = "stage max / mean"
    if ev.degree("pp") < 2:
        return not_applicable("no pipeline (pp = 1)")
    if split == "auto":  # auto's boundaries are not recorded: nothing to infer layer costs from
        return not_applicable("parallel.pp_split = auto: its stage boundaries are not recorded")
    if not stages or len(stages) < 2 or sum(stages) <= 0:
        return not_measured(metric, STAGE_IMBALANCE, "no per-stage compute times (stage_compute_s) recorded")
    mean = sum(stages) / len(stages)
    imbalance = max(stages) / mean
    if imbalance < STAGE_IMBALANCE:
        return passed(metric, imbalance, STAGE_IMBALANCE)
    n_layers = predict.model_shape(ev.config).n_layers
    speedup, new_max, starts = predict.resplit_speedup(stages, n_layers, split)
    if speedup < MIN_SPEEDUP:  # the imbalance is the granularity of whole blocks: no split does better
        return no_gain(metric, imbalance, STAGE_IMBALANCE,
                       f"no contiguous split of whole blocks does better ({speedup:.2f}x predicted)")
    ms = ", ".join(f"{1e3 * t:.0f}" for t in stages)
    # One stage per rank: the split measured in this run, written out (pp_split's start-up
    # profile of one microbatch on one process can misjudge the head against the blocks
    # as the running pipeline sees them). Virtual stages: let auto place them.
    value = ",".join(map(str, starts)) if len(stages) == ev.degree("pp") else "auto"
    return Suggestion(
        "pipeline-split", f"re-split the pipeline stages by measured cost: parallel.pp_split = {value}",
        f"stage compute ms [{ms}]: the slowest stage sets the pace of every microbatch ({split} split)",
        [Evidence("stage max / mean", imbalance, STAGE_IMBALANCE)], {"parallel.pp_split": value}, speedup,
        f"per-layer costs inferred from the stage times (uniform blocks, head on the last stage); the "
        f"best contiguous split's slowest stage {1e3 * new_max:.0f} ms vs {1e3 * max(stages):.0f} ms",
        # A re-split moves layers between ranks and changes no number: the trainer's own
        # re-balance (train/rebalance.py) resumes from a checkpoint into a new split exactly.
        resume_exact=True)


def pipeline_bubble(ev: RunEvidence, ctx: Context) -> Suggestion | Check:
    p = ev.degree("pp")
    bubble = ev.median("bubble_fraction")
    if p < 2:
        return not_applicable("no pipeline (pp = 1)")
    if bubble is None:
        return not_measured("bubble_fraction", BUBBLE_HIGH, "no bubble_fraction recorded")
    stages = ev.stage_compute_s
    # Idle caused by an unbalanced split is the split rule's to fix, not more microbatches.
    if stages and max(stages) > 0 and str(ev.cfg("parallel.pp_split", "auto")) != "auto":
        bubble_own = bubble - (1 - (sum(stages) / len(stages)) / max(stages))
    else:
        bubble_own = bubble
    if bubble_own < BUBBLE_HIGH:
        return passed("bubble_fraction" + (" (less imbalance idle)" if bubble_own != bubble else ""), bubble_own,
                      BUBBLE_HIGH)
    schedule = str(ev.cfg("parallel.pp_schedule", "1f1b"))
    m = int(ev.cfg("parallel.microbatches", 0) or 2 * p)
    batch = int(ev.cfg("training.batch_size", 8))
    n_stages = len(stages) if stages else p
    target = MICROBATCHES_PER_STAGE * n_stages
    divisors = [d for d in range(m + 1, batch + 1) if batch % d == 0]
    new_m = next((d for d in divisors if d >= target), divisors[-1] if divisors else None)
    ev_list = [Evidence("bubble_fraction" + (" (less imbalance idle)" if bubble_own != bubble else ""),
                        bubble_own, BUBBLE_HIGH)]
    if new_m is not None:
        speedup = predict.bubble_speedup(bubble_own, p, m, new_m, schedule, schedule)
        return Suggestion(
            "pipeline-microbatches", f"more pipeline microbatches: {m} -> {new_m} (parallel.microbatches)",
            f"pipeline idle {bubble_own:.0%} of the step with {m} microbatches on {p} stages ({schedule})",
            ev_list, {"parallel.microbatches": new_m}, speedup,
            f"analytic bubble {predict.analytic_bubble(p, m, schedule):.2f} -> "
            f"{predict.analytic_bubble(p, new_m, schedule):.2f} ({schedule}), the measured excess over it kept")
    if schedule in ("gpipe", "1f1b") and predict.model_shape(ev.config).n_layers >= 2 * p:
        speedup = predict.bubble_speedup(bubble_own, p, m, m, schedule, "zbv")
        return Suggestion(
            "pipeline-schedule", f"zero-bubble schedule: {schedule} -> zbv (parallel.pp_schedule)",
            f"pipeline idle {bubble_own:.0%}; training.batch_size = {batch} allows no more than {m} microbatches",
            ev_list, {"parallel.pp_schedule": "zbv"}, speedup,
            f"analytic bubble {predict.analytic_bubble(p, m, schedule):.2f} -> "
            f"{predict.analytic_bubble(p, m, 'zbv'):.2f} (zbv replayed action list), measured excess kept")
    return no_gain(ev_list[0].metric, bubble_own, BUBBLE_HIGH,
                   f"training.batch_size = {batch} allows no more microbatches and {schedule} has no zero-bubble "
                   "schedule to move to with this many layers")


# ------------------------------------------------------------------------ layout


def layout_ddp(ev: RunEvidence, ctx: Context) -> Suggestion | Check:
    """FSDP2 on a model that fits whole on every rank: DDP over the same ranks. The predicted
    DDP step keeps what the run measured outside FSDP2's collectives (its own CPU overhead
    included, so the prediction errs low) and adds the optimizer over the whole model and
    the gradient all-reduce, counted whole, at this machine's measured link
    (``predict.ddp_step_s``).

    Not for pipelines: a 2-stage pipeline of `tiny` on 2 ranks measured the same tokens/s
    as DDP over them (1.00x, quiet machine: each DDP rank's whole model ran 30% slower
    than the two half models' mean), so the stage times do not predict a DDP step here."""
    world, shard, rep = ev.world_size, ev.degree("dp_shard"), ev.degree("dp_replicate")
    step, peak, limit = _step(ev), ev.max("peak_memory_bytes"), ctx.memory_limit_bytes
    metric = "comm_share (FSDP2 collectives)"
    if world < 2 or shard < 2 or rep * shard != world or ev.degree("tp") != 1 or ev.degree("pp") != 1:
        return not_applicable("not an FSDP2-only layout (dp_shard > 1, tp = pp = 1)")
    if step is None or peak is None or not limit:
        what = "step_s" if step is None else "peak_memory_bytes" if peak is None else "the device memory"
        return not_measured(metric, FSDP_COMM_SHARE, f"{what} unknown")
    shape = predict.model_shape(ev.config)
    if shape.is_moe:  # experts are kept out of FSDP and split by ep: not a layout this rule models
        return not_applicable("a MoE model: experts are split by ep, not FSDP2")
    n_params = shape.num_params()
    replicated = peak + predict.DDP_BYTES_PER_PARAM * n_params  # conservative: nothing FSDP2 held is freed
    if replicated > MEMORY_HIGH * limit:
        return not_applicable(f"the replicated model would not fit: (peak + replicated states) / device memory "
                              f"{replicated / limit:.2f} > {MEMORY_HIGH}")
    coll = ev.median("collective_s")
    share = ev.median("comm_share")
    if coll is None and share is not None:
        coll = share * step
    if coll is None:
        return not_measured(metric, FSDP_COMM_SHARE, "no collective_s or comm_share recorded")
    if coll / step < FSDP_COMM_SHARE:
        return passed(metric, coll / step, FSDP_COMM_SHARE)
    link, where = (ctx.link, "the given link") if ctx.link is not None else predict.measured_link(world)
    opt = ev.median("optimizer_s") or 0.0
    grad_bytes = 4.0 * n_params
    compute = max(step - coll - opt, 0.0)
    ar = cm.all_reduce_s(grad_bytes, world, link)
    new_step = predict.ddp_step_s(compute, opt * shard, ar)
    speedup = step / max(new_step, 1e-9)
    if speedup < MIN_SPEEDUP:
        return no_gain(metric, coll / step, FSDP_COMM_SHARE, f"DDP predicted at {speedup:.2f}x")
    return Suggestion(
        "layout-ddp", f"DDP instead of FSDP2: parallel.dp_replicate = {world}, dp_shard = 1",
        f"FSDP2 shards a {n_params / 1e6:.1f}M-parameter model that fits whole on each rank; its per-block "
        f"all-gathers and reduce-scatters took {coll / step:.0%} of the step ({1e3 * coll:.0f} of "
        f"{1e3 * step:.0f} ms)",
        [Evidence("comm_share (FSDP2 collectives)", coll / step, FSDP_COMM_SHARE),
         Evidence("(peak + replicated model states) / device memory", replicated / limit, MEMORY_HIGH, "<")],
        {"parallel.dp_replicate": world, "parallel.dp_shard": 1}, speedup,
        f"DDP step = the step less its collectives and optimizer ({1e3 * compute:.0f} ms, FSDP2's own overhead "
        f"kept) + the optimizer on the whole model on every rank + the {grad_bytes / 2**20:.0f} MiB gradient "
        f"all-reduce ({1e3 * ar:.0f} ms, cost model at {where}) = {1e3 * new_step:.0f} ms vs {1e3 * step:.0f} ms")


# ------------------------------------------------------------------------ communication


def compression(ev: RunEvidence, ctx: Context) -> Suggestion | Check:
    share = ev.median("comm_share")
    step = _step(ev)
    if ev.world_size < 2:
        return not_applicable("one process: no collectives")
    if str(ev.cfg("compression.codec", "none")) != "none":
        return not_applicable(f"compression.codec = {ev.cfg('compression.codec')} already")
    if ev.degree("dp_replicate") < 2:  # compression hooks sit on the dp_replicate all-reduce (DDP) only
        return not_applicable("no dp_replicate axis: compression hooks sit on its all-reduce")
    if share is None or step is None:
        return not_measured("comm_share", COMM_SHARE_HIGH, "no comm_share or step_s recorded")
    if share < COMM_SHARE_HIGH:
        return passed("comm_share", share, COMM_SHARE_HIGH)
    codec = "int4" if share >= COMM_SHARE_INT4 else "int8"
    block = int(ev.cfg("compression.block_size", 256))
    ratio = predict.wire_ratio(codec, block)
    comm_s = ev.median("collective_s") or share * step
    speedup = predict.compression_speedup(step, comm_s, ratio)
    return Suggestion(
        "compression", f"compress the gradient all-reduce: compression.codec = {codec} (+ error feedback)",
        f"collectives take {share:.0%} of the step ({comm_s * 1e3:.0f} ms of {step * 1e3:.0f} ms) on the "
        f"dp_replicate axis ({ev.degree('dp_replicate')} replicas)",
        [Evidence("comm_share", share, COMM_SHARE_HIGH)], {"compression.codec": codec}, speedup,
        f"comm time x (1 - {ratio:.3f}) saved ({codec}: {predict.CODEC_BITS[codec]} bits + one fp32 scale per "
        f"{block} values, against fp32); the codec's own compute not counted")


# ------------------------------------------------------------------------ memory


def memory(ev: RunEvidence, ctx: Context) -> Suggestion | Check:
    peak = ev.max("peak_memory_bytes")
    metric = "peak memory / device memory"
    if peak is None or not ctx.memory_limit_bytes:
        return not_measured(metric, MEMORY_HIGH, "no peak_memory_bytes recorded" if peak is None else
                            f"device memory unknown ({ctx.memory_limit_source or 'pass --memory_limit_gb'})")
    share = peak / ctx.memory_limit_bytes
    if share < MEMORY_HIGH:
        return passed(metric, share, MEMORY_HIGH)
    shape = predict.model_shape(ev.config)
    b, t = int(ev.cfg("training.batch_size", 8)), int(ev.cfg("training.seq_len", 256))
    logits = predict.logits_bytes(b, t, shape.vocab_size)
    evidence = [Evidence("peak memory / device memory", share, MEMORY_HIGH),
                Evidence("peak_memory_bytes", peak, MEMORY_HIGH * ctx.memory_limit_bytes, unit="bytes")]
    single = ev.degree("pp") == 1 and ev.degree("tp") == 1
    fwd, step = ev.median("forward_s"), _step(ev)
    if single and int(ev.cfg("training.loss_chunk_tokens", 0)) == 0 and logits >= 0.2 * peak:
        return Suggestion(
            "memory-chunked-loss", "chunked output projection + loss: training.loss_chunk_tokens = 1024",
            f"peak {peak / 2**30:.2f} GiB of {ctx.memory_limit_bytes / 2**30:.2f} GiB "
            f"({ctx.memory_limit_source}); the fp32 logits and their gradient alone are "
            f"{logits / 2**30:.2f} GiB (vocab {shape.vocab_size})", evidence,
            {"training.loss_chunk_tokens": 1024}, 1 / 1.02 if fwd else None,
            f"saves ~{logits / 2**30:.2f} GiB; ~7% more forward FLOPs in the head (recomputed in backward)",
            needed=True)
    if str(ev.cfg("parallel.activation_checkpointing", "none")) == "none":
        acts = sum(v for k, v in ev.last.items() if k.startswith("mem_activations_") and isinstance(v, (int, float)))
        speedup = step / (step + fwd) if fwd and step else None
        return Suggestion(
            "memory-checkpointing", "activation checkpointing: parallel.activation_checkpointing = full",
            f"peak {peak / 2**30:.2f} GiB of {ctx.memory_limit_bytes / 2**30:.2f} GiB ({ctx.memory_limit_source})",
            evidence, {"parallel.activation_checkpointing": "full"}, speedup,
            (f"saves most of the {acts / 2**30:.2f} GiB of saved activations; " if acts else "")
            + "backward recomputes each block's forward (one more forward per step)", needed=True)
    return no_gain(metric, share, MEMORY_HIGH, "the loss is chunked or small and activation checkpointing is on "
                   "already: nothing this rule knows frees more")


# ------------------------------------------------------------------------ batch and MFU


def batch_size(ev: RunEvidence, ctx: Context) -> Suggestion | Check:
    b, t = int(ev.cfg("training.batch_size", 8)), int(ev.cfg("training.seq_len", 256))
    accum = int(ev.cfg("training.grad_accum_steps", 1))
    mfu, tps, step = ev.window_median("mfu"), ev.tokens_per_s, _step(ev)
    reachable = predict.MFU_REACHABLE[ev.device]
    metric = "mfu (of the compute part of the step)"
    if ev.degree("pp") > 1:
        return not_applicable("a pipeline: its microbatches, not training.batch_size, set the GEMM shapes")
    if b * t >= TARGET_MICROBATCH_TOKENS:
        return passed("tokens per micro-batch", b * t, TARGET_MICROBATCH_TOKENS, "<")
    if not mfu or not tps or not step:
        return not_measured(metric, None, "no mfu, tokens_per_s or step_s recorded", "<")
    # MFU of the compute part: time in collectives, data waits and the monitor is other
    # rules' to cut, and a larger batch would not shrink it.
    other = (ev.median("comm_share") or 0.0) + (ev.monitor_share or 0.0) + (ev.median("data_wait_s") or 0.0) / step
    mfu = mfu / max(1.0 - other, 0.1)
    keep_global = accum > 1
    low = (MFU_LOW_SHARE_ACCUM if keep_global else MFU_LOW_SHARE) * reachable
    if mfu >= low:
        return passed(metric, mfu, low, "<")
    k_max = max(1, TARGET_MICROBATCH_TOKENS // (b * t))
    k = 1 << int(math.log2(k_max))
    if keep_global:
        k = math.gcd(k, accum)  # the same global batch: batch_size x k, grad_accum_steps / k
    k = _fit_memory(ev, ctx, k)
    if k < 2:
        return no_gain(metric, mfu, low, "no larger micro-batch fits (memory, or the accumulation steps to merge)",
                       "<")
    fixed = (ev.median("optimizer_s") or 0.0) + (ev.median("data_wait_s") or 0.0)
    speedup = predict.batch_speedup(step, fixed, accum, k, keep_global, mfu, reachable)
    if speedup < MIN_SPEEDUP:
        return no_gain(metric, mfu, low, f"batch_size x {k} predicted at {speedup:.2f}x", "<")
    changes: dict[str, Any] = {"training.batch_size": b * k}
    if keep_global:
        changes["training.grad_accum_steps"] = accum // k
    # The LR at the new global batch, by the run's optimizer.lr_scaling (plan/lr_scaling.py).
    dp = ev.degree("dp_replicate") * ev.degree("dp_shard")
    lr_text, lr_follows = batch_change_lr(float(ev.cfg("training.lr", 1e-3)), ev.cfg("optimizer.lr_scaling", "none"),
                                          int(ev.cfg("optimizer.lr_reference_batch", 0)), b * accum * dp,
                                          b * k * (accum // k if keep_global else accum) * dp)
    return Suggestion(
        "batch", f"larger micro-batch: training.batch_size {b} -> {b * k}"
        + (f", grad_accum_steps {accum} -> {accum // k} (same global batch)" if keep_global else "")
        + (f"; {lr_text}" if lr_follows else ""),
        f"{b * t} tokens per micro-batch at MFU {mfu:.1%}: per-micro-batch fixed costs dominate",
        [Evidence("tokens per micro-batch", b * t, TARGET_MICROBATCH_TOKENS, "<"),
         Evidence("mfu (of the compute part of the step)", mfu, low, "<")], changes, speedup,
        f"step = fixed + compute: compute at MFU {reachable:.0%} (reachable on {ev.device}) scales with "
        f"tokens, the rest is per micro-batch; tokens/s grows until compute-bound",
        note="" if keep_global else "changes the global batch (the optimisation); the LR follows it" if lr_follows
        else f"changes the global batch (the optimisation): not applied; set it by hand with a retuned learning "
             f"rate: {lr_text}", auto=lr_follows)


def _fit_memory(ev: RunEvidence, ctx: Context, k: int) -> int:
    """Largest k' <= k (halving) whose activations (k' x the measured ones) stay under MEMORY_HIGH."""
    peak = ev.max("peak_memory_bytes")
    acts = sum(v for key, v in ev.last.items() if key.startswith("mem_activations_") and isinstance(v, (int, float)))
    if not ctx.memory_limit_bytes or not peak or not acts:
        return k
    while k >= 2 and peak + (k - 1) * acts > MEMORY_HIGH * ctx.memory_limit_bytes:
        k //= 2
    return k


# ------------------------------------------------------------------------ data and monitoring


def data_wait(ev: RunEvidence, ctx: Context) -> Suggestion | Check:
    step, wait = _step(ev), ev.median("data_wait_s")
    share = wait / step if wait is not None and step else None
    frac = ev.window_median("data_io_wait_frac")
    metric, value = ("data_wait_s / step_s", share) if share is not None else ("data_io_wait_frac", frac)
    if frac is not None and (value is None or frac > value):
        metric, value = "data_io_wait_frac", frac
    if not ev.cfg("data.cache.dir"):  # prefetch and fetch workers belong to the tiered cache
        return not_applicable("no tiered cache (data.cache.dir): its prefetch settings are what this rule changes")
    if value is None:
        return not_measured(metric, DATA_WAIT_HIGH, "no data_wait_s or data_io_wait_frac recorded")
    if value < DATA_WAIT_HIGH:
        return passed(metric, value, DATA_WAIT_HIGH)
    depth, workers = int(ev.cfg("data.prefetch_depth", 8)), int(ev.cfg("data.fetch_workers", 4))
    return Suggestion(
        "data-prefetch", f"fetch further ahead: data.prefetch_depth {depth} -> {2 * depth}, "
        f"data.fetch_workers {workers} -> {min(2 * workers, 16)}",
        f"the loop waited for data {value:.0%} of the step", [Evidence(metric, value, DATA_WAIT_HIGH)],
        {"data.prefetch_depth": 2 * depth, "data.fetch_workers": min(2 * workers, 16)},
        1 / (1 - min(value, 0.9)), "upper bound: the whole wait hidden behind compute", resume_exact=True)


def profiler(ev: RunEvidence, ctx: Context) -> Suggestion | Check:
    every = int(ev.cfg("monitor.profile_every", 0))
    if every <= 0 or not ev.cfg("monitor.enabled", True):
        return not_applicable("the profiler is off")
    if every >= PROFILE_EVERY_MIN:
        return passed("monitor.profile_every", every, PROFILE_EVERY_MIN, "<")
    wall = ev.wall_per_step_s
    if wall is None:
        return not_measured("monitor.profile_every", PROFILE_EVERY_MIN, "no tokens_per_s to time a step by", "<")
    profiled = [r["step_s"] for r in ev.records if isinstance(r.get("top_ops"), dict) and _pos(r.get("step_s"))]
    plain = [r["step_s"] for r in ev.records if not isinstance(r.get("top_ops"), dict) and _pos(r.get("step_s"))]
    speedup, how = predict.profiler_speedup(every, PROFILE_EVERY_ADVISED, wall, profiled, plain)
    if speedup < MIN_SPEEDUP:
        return no_gain("monitor.profile_every", every, PROFILE_EVERY_MIN,
                       f"profile_every {PROFILE_EVERY_ADVISED} predicted at {speedup:.2f}x", "<")
    evidence = [Evidence("monitor.profile_every", every, PROFILE_EVERY_MIN, "<")]
    return Suggestion(
        "profiler", f"profile less often: monitor.profile_every {every} -> {PROFILE_EVERY_ADVISED}",
        f"torch.profiler runs on 1 step in {every}: each profiled step records every operator and its trace "
        "is reduced to top operators", evidence, {"monitor.profile_every": PROFILE_EVERY_ADVISED}, speedup, how,
        resume_exact=True)


def _pos(v: Any) -> bool:
    return isinstance(v, (int, float)) and v > 0


def monitor_cost(ev: RunEvidence, ctx: Context) -> Suggestion | Check:
    share = ev.monitor_share
    if share is None:
        return not_measured("monitor_s / wall", MONITOR_SHARE_HIGH, "no monitor_s recorded over two windows")
    if share < MONITOR_SHARE_HIGH:
        return passed("monitor_s / wall", share, MONITOR_SHARE_HIGH)
    if 0 < int(ev.cfg("monitor.profile_every", 0)) < PROFILE_EVERY_MIN:
        # a frequent profiler's trace reduction is that share: the profiler rule's
        return no_gain("monitor_s / wall", share, MONITOR_SHARE_HIGH, "the frequent profiler is that cost: see "
                       "the profiler rule")
    every = int(ev.cfg("monitor.interval_steps", 10))
    changes: dict[str, Any] = {"monitor.interval_steps": 4 * every}
    if ev.cfg("monitor.activation_stats", False):
        changes["monitor.activation_stats"] = False
    return Suggestion(
        "monitor", f"sample model statistics less often: monitor.interval_steps {every} -> {4 * every}",
        f"the monitor's own code took {share:.1%} of wall time", [Evidence("monitor_s / wall", share,
                                                                            MONITOR_SHARE_HIGH)],
        changes, 1 / (1 - 0.75 * min(share, 0.9)), "3/4 of the monitor's measured time saved", resume_exact=True)


# ------------------------------------------------------------------------ precision


def precision(ev: RunEvidence, ctx: Context) -> Suggestion | Check:
    cap, step = ctx.capability, _step(ev)
    policy = str(ev.cfg("precision.policy", "fp32"))
    metric = "bf16 / fp32 matmul time (hardware probe)"
    if cap is None:
        return not_applicable("no hardware probe for this run's device (a CUDA run, or --no_hardware_probe)")
    if step is None:
        return not_measured(metric, LOWP_FASTER, "no step_s recorded", "<")
    skipped = ev.last.get("optimizer_skipped_steps")
    n = ev.last.get("step") or 0
    if policy == "fp16-mixed" and isinstance(skipped, (int, float)) and n and skipped / n >= SKIPPED_STEPS_HIGH:
        bf16 = cap.support.get("bf16")
        if bf16 is not None and bf16.fast:
            return Suggestion(
                "precision-skips", "bf16 instead of fp16: precision.policy = bf16-mixed",
                f"the fp16 loss scaler skipped {skipped:.0f} of {n} steps (overflow)",
                [Evidence("skipped steps / steps", skipped / n, SKIPPED_STEPS_HIGH)],
                {"precision.policy": "bf16-mixed"}, 1 / (1 - skipped / n), "the skipped steps' compute recovered; "
                f"{bf16.reason}")
    if policy != "fp32":
        return not_applicable(f"precision.policy = {policy}: already low precision, and no fp16 overflow to fix")
    support = cap.support.get("bf16")
    if support is None or not support.fast or support.slowdown is None:
        return not_applicable(f"bf16 matmuls are not fast on {cap.name}" + (f" ({support.reason})" if support else ""))
    if support.slowdown > LOWP_FASTER:
        return passed(metric, support.slowdown, LOWP_FASTER, "<")
    share = predict.matmul_share(ev.top_ops, step)
    speedup = 1 / (1 - share + share * support.slowdown)
    return Suggestion(
        "precision", "bf16 autocast: precision.policy = bf16-mixed",
        f"the run is fp32 while bf16 matmuls run at {support.slowdown:.2f}x fp32's time on {cap.name}",
        [Evidence("bf16 / fp32 matmul time (hardware probe)", support.slowdown, LOWP_FASTER, "<")],
        {"precision.policy": "bf16-mixed"}, speedup,
        f"matmul share {share:.0%} of the step ({'profiled' if ev.top_ops else 'assumed'}) x the probe's ratio")


TRAIN_RULES: tuple[Rule, ...] = (memory, layout_ddp, pipeline_split, pipeline_bubble, compression, batch_size,
                                 data_wait, profiler, monitor_cost, precision)
