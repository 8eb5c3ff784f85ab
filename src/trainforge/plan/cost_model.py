"""The cost model: one layout of one workload on one cluster -> predicted step time,
memory per GPU, MFU, communication share and pipeline bubble (``Estimate``).

    est = estimate(Workload(FLAVORS["llama-8b"], seq_len=8192, global_batch=64),
                   Layout(dp_shard=8), cluster("h100", 8))

Batch. ``global_batch`` sequences per optimizer step; each data-parallel rank takes
global_batch / dp of them in ``grad_accum_steps`` micro-steps of ``training.batch_size``
sequences, which a pipeline cuts into ``microbatches``.

Compute (``gemm_efficiency.compute_s``). Per-block FLOPs (6 x active parameters + the
attention products, ``ModelConfig.flops_per_token``'s split by layer; MoE blocks count only
the experts a token uses, which expert parallelism moves but does not change), divided by
tp. On a cluster with a kernel table (the GPUs of ``hardware.py``): each GEMM of the block
(projections, MLP or experts, head; forward and both backward GEMMs) at peak x
matmul_efficiency x its shape factor (a wave model of cuBLAS fitted to a published H100
table), the attention products at the stack's flash-attention kernel speed (causal half);
without one (a measured cluster): every FLOP at peak[compute dtype] x matmul_efficiency.
Activation checkpointing recomputes each block's forward (+1/3 of its FLOPs). Pipeline
stages are split the way ``pp_split = auto`` would (balanced FLOPs,
``memory_model.stage_boundaries``); the slowest rank sets the pace.

Memory per rank (the most loaded one): parameters, gradients (the parameters' dtype),
AdamW's two moments (and an fp32 master copy where parameters are stored low), sharded
over dp_shard under FSDP2/HSDP and replicated under DDP; split by tp and, per stage, by
pp; routed experts split by ep (and, as the trainer does, kept out of FSDP: replicated over
the ranks holding the same experts). Plus activations (``memory_model``) x the microbatches
the schedule keeps alive (``pipeline_sim``), FSDP's two unsharded blocks in flight (compute
dtype) and one block's unsharded gradient, DDP's gradient buckets (a second copy of the
gradients) and autocast's low-precision weight copies, and a reserve (``RESERVED_BYTES``
for the CUDA context and communication buffers, ``FRAGMENTATION`` of the tensors for the
caching allocator). Over ``cluster.memory_bytes`` is infeasible.

Communication per optimizer step (``comm_model``: alpha-beta, the tier from where each
axis' group lies): TP, Megatron style, 4 all-reduces of a microbatch's activations per
block (2 forward, 2 backward; the reduce-scatter + all-gather pairs of sequence
parallelism move the same bytes), 2 more with recomputation, 2 for the embedding and
the loss. 2-D TP (``tp_mode = "2d"``): the SUMMA grid's own collectives on its row and column
links, edges included, and the panels it keeps in memory (``tp2d_cost``). EP: 4 all-to-alls of the dispatched tokens per MoE block (2 more with
recomputation). PP: each microbatch's activation forward and gradient back over each stage
boundary. DP: DDP all-reduces the gradients every micro-step (no ``no_sync`` in the
trainer); FSDP2 all-gathers the parameters for forward and again for backward and
reduce-scatters the gradients, every micro-step (under a pipeline the all-gathers repeat
per microbatch, the reduce-scatter once per step); HSDP then all-reduces the shard over
dp_replicate. Expert gradients are all-reduced over their replicas after backward. A
compressed codec on dp_replicate sends codec bytes (``codecs.make_codec(...).nbytes``;
``adaptive`` counted at its widest, 8 bits; ``powersgd`` as rank-4 factors of dim x dim
matrices).

What overlaps. DP traffic hides behind compute except one block's share (the first
all-gather and the last bucket's reduce wait for nobody) and whatever exceeds the compute
time; on a cluster with ``comm_overlaps_compute`` False (a measured CPU with processes >=
cores: gloo's threads take the cores the compute needs) all of it is added to the step.
Compressed collectives run blocking in the hooks (``compression/collective.py``)
and the expert-gradient all-reduce runs after backward: exposed. TP and EP sit inside each
stage's time, so they stretch the pipeline too; EP and, under the eager stacks (no async
TP), TP are exposed; the ``megatron`` stack overlaps TP as Transformer Engine's userbuffers
do (``gemm_efficiency.tp_exposed_s``: 1/16 waits, the rest hides behind the compute, what
exceeds it waits, the hidden part costs the GEMMs the communication kernels' SMs, and the
GEMMs run as TE's chunks, priced in the compute). Of the PP
transfers, those on the fill-and-drain critical path are exposed (2 x (stages - 1)); the
rest overlap the steady state.

Memory-bound work: the elementwise kernels stream each saved activation about four times
(written, read, its gradient written and read; six with recomputation; fused kernels; the
eager stack's separate kernels move ``EAGER_STREAM_FACTOR`` times that) and the loss ~14
bytes per logit fused (44 for an fp32 ``F.cross_entropy``, 52 for Megatron's fp32
vocab-parallel one), at HBM bandwidth, beside the GEMMs (not overlapped); AdamW streams its
state once per step. The stack's byte factors apply on clusters with a kernel table only (a
measured cluster's calibration holds its own).

CPU overheads (``Cluster``'s ``*_overhead_s``, measured by ``calibration.calibrate``; 0 on the GPU
table): a fixed cost per forward + backward (per-op dispatch), the rank's share of the layers
per pipeline microbatch, on the critical path like compute; under TP, DTensor's dispatch per
pass and per token of the rank's shard (``tp_overhead``, apart from the collectives); and a
fixed cost per optimizer step (the trainer's clipping, guard, loss sync and logging; DTensor's
clipping and AdamW under TP); under FSDP2 its own per-pass cost (hooks, copies into and out of
the collectives' buffers: ``fsdp_*_overhead``, apart from the collectives).

On a measured CPU cluster each collective is priced by the probe's own fit for its op and
group size (``comm_model``), FSDP2's are counted per unit (each block, then the root), and
every blocking collective also pays the probe's ``sync_s`` (what one costs where the ranks
computed just before it, beyond its back-to-back time). With more ranks than cores, waiting
is charged only where no other rank can take the core (``waiting_charged``): a pipeline's
bubble and waits cost nothing when the other stages' ranks fill the cores.

step_s = micro-steps x ((stage compute + memory-bound + TP + EP + syncs + pass overheads)
x (1 + charged x bubble / (1 - bubble)) + exposed PP + exposed DP) + expert reduce + optimizer
+ step overhead. bubble: the schedule's own action list replayed (``pipeline_sim``).
MFU = model FLOPs (no recomputation) / (step_s x n_gpus x peak[compute dtype]). Under the
planning-only ``fp8`` precision (``memory_model.FP8``) the blocks' linear GEMMs run at the FP8
peak (operands of one byte) and the rest as bf16-mixed; MFU stays of the bf16 peak, as FP8
training runs report it, so it compares across precisions.
"""

from __future__ import annotations

import dataclasses
import math
from types import SimpleNamespace

from trainforge.errors import ConfigError
from trainforge.plan import comm_model as cm
from trainforge.plan import gemm_efficiency as ge
from trainforge.plan import memory_model as mm
from trainforge.plan import tp2d_cost
from trainforge.plan.pipeline_sim import schedule_profile, stages_per_rank
from trainforge.plan.spec import Cluster, Estimate, Layout, Workload

FSDP_BLOCKS_IN_FLIGHT = 2  # the block running and the one prefetched
# Memory no tensor accounts for (assumptions): the CUDA context, NCCL's buffers and
# workspaces (~1 GiB), and the caching allocator's fragmentation (~5% of the tensors).
RESERVED_BYTES = 2**30
FRAGMENTATION = 0.05


def codec_bytes_per_value(codec: str, dim: int) -> float:
    """Bytes one fp32 gradient value costs on the wire under ``[compression] codec``."""
    if codec == "none":
        return 4.0
    if codec == "adaptive":
        codec = "int8"  # its widest width (compression.max_bits default): an upper bound
    if codec == "powersgd":
        return 4.0 * 2 * 4 / dim  # rank-4 factors P (dim x 4) and Q (dim x 4) of a dim x dim matrix
    from trainforge.compression.codecs import make_codec

    n = 1 << 20
    return make_codec(codec).nbytes(n) / n


def waiting_charged(cluster: Cluster, n_ranks: int, pp: int) -> float:
    """The share of a rank's waiting (the pipeline bubble, a blocking collective) that costs
    step time. On GPUs, or on a CPU with a core per rank, all of it. On a CPU with more ranks
    than cores (``Cluster.cores``) a waiting rank gives its core to the others: without a
    pipeline every rank waits at the same collectives at once, so it is all paid; with one,
    only one stage's ranks (n / pp) wait together while the other stages' ranks run on the
    cores, so the step loses only the cores those cannot fill: max(0, cores - (n - n / pp)) /
    cores. (8 ranks in 2 stages on 2 cores: the 4 running ranks keep both cores busy.)"""
    cores = cluster.cores
    if not cores or n_ranks <= cores or pp == 1:
        return 1.0
    return max(0, cores - (n_ranks - n_ranks // pp)) / cores


def layout_problem(workload: Workload, layout: Layout) -> str:
    """Why ``layout`` cannot run ``workload`` (the trainer's own checks, their messages), or ""."""
    from trainforge.parallel.apply import check_pipeline_layout
    from trainforge.parallel.dims import ParallelDims

    cfg = workload.model
    for name in ("dp_replicate", "dp_shard", "tp", "pp", "ep", "microbatches", "grad_accum_steps"):
        if getattr(layout, name) < 1:
            return f"parallel.{name} = {getattr(layout, name)} must be >= 1"
    if layout.tp_mode not in tp2d_cost.TP_MODES:
        return f"parallel.tp_mode = {layout.tp_mode!r}: use one of {', '.join(tp2d_cost.TP_MODES)}"
    try:
        dims = ParallelDims(layout.pp, layout.dp_replicate, layout.dp_shard, layout.tp, layout.n_gpus, layout.ep)
        if dims.dp % layout.ep:
            return (f"parallel.ep = {layout.ep} must divide dp_replicate x dp_shard = {dims.dp} (expert-parallel "
                    "ranks are data-parallel ranks)")
        per_rank, rem = divmod(workload.global_batch, layout.dp * layout.grad_accum_steps)
        if layout.tp_mode == "2d":  # its own shape rules (tp2d_cost); the rest of the model checks as at tp 1
            why = tp2d_cost.tp2d_problem(cfg, layout.tp, per_rank, layout.pp, layout.microbatches,
                                         workload.stack == "trainforge-compile")
            if why:
                return why
            dims = dataclasses.replace(dims, tp=1, world_size=layout.n_gpus // layout.tp)
        dims.check_model(cfg)
        if rem or per_rank < 1:
            return (f"global batch {workload.global_batch} is not a multiple of dp x grad_accum_steps = "
                    f"{layout.dp} x {layout.grad_accum_steps}")
        if layout.pp > 1:
            # the trainer's own pipeline check, on the config the planner writes (no pp_split: auto)
            check_pipeline_layout(cfg, dims, SimpleNamespace(pp_split="auto", pp_schedule=layout.pp_schedule,
                                                             microbatches=layout.microbatches), per_rank)
        elif layout.microbatches != 1:
            return f"parallel.microbatches = {layout.microbatches} without a pipeline (pp = 1): use 1"
    except ConfigError as e:
        return str(e).removeprefix("config key ")
    if workload.compression == "powersgd" and not (layout.dp_shard == 1 and layout.tp == 1 and layout.pp == 1):
        return "compression.codec = powersgd works with plain DDP only (dp_shard, tp and pp = 1)"
    return ""


def _infeasible(layout: Layout, why: str, memory: float = math.nan, breakdown: dict | None = None) -> Estimate:
    return Estimate(layout=layout, step_s=math.inf, memory_bytes_per_gpu=memory, mfu=0.0, comm_share=0.0,
                    bubble_fraction=0.0, tokens_per_s_per_gpu=0.0, feasible=False, why=why,
                    breakdown=breakdown or {})


def estimate(workload: Workload, layout: Layout, cluster: Cluster) -> Estimate:
    """Predict one layout (module docstring). Never raises for a bad layout: it comes
    back ``feasible=False`` with ``why``. ValueError for an unknown precision, codec or
    a layout using more GPUs than the cluster has."""
    cfg, s = workload.model, workload.seq_len
    if layout.n_gpus > cluster.n_gpus:
        raise ValueError(f"layout uses {layout.n_gpus} GPUs, the cluster has {cluster.n_gpus}")
    pb = mm.precision_bytes(workload.precision)
    wire = codec_bytes_per_value(workload.compression, cfg.dim)
    why = layout_problem(workload, layout)
    if why:
        return _infeasible(layout, why)
    peak = cluster.peak_flops.get(pb.compute_dtype)
    gemm_peak = cluster.peak_flops.get(pb.gemm_dtype) if pb.gemm_dtype else peak
    for dtype, rate in ((pb.compute_dtype, peak), (pb.gemm_dtype, gemm_peak)):
        if not rate:
            return _infeasible(layout, f"{cluster.name} has no {dtype} matmul peak (it has "
                                       f"{', '.join(sorted(cluster.peak_flops)) or 'none'}): choose another precision")
    ge.stack(workload.stack)  # ValueError naming the stacks for an unknown one

    tp, pp, ep, m = layout.tp, layout.pp, layout.ep, layout.microbatches
    ac = layout.activation_checkpoint
    batch_size = workload.global_batch // (layout.dp * layout.grad_accum_steps)  # training.batch_size
    mb_tokens = batch_size // m * s  # tokens of one pipeline microbatch (the whole micro-step without pp)
    # parallel/data_parallel.py's data_parallel_kind: none without data parallelism, DDP only when
    # dp_shard, tp and pp are all 1, else FSDP2 (HSDP with dp_replicate > 1).
    ddp = layout.dp > 1 and layout.dp_shard == 1 and tp == 1 and pp == 1
    fsdp = layout.dp > 1 and not ddp
    shard = layout.dp_shard if fsdp else 1
    v = stages_per_rank(layout.pp_schedule) if pp > 1 else 1
    n_stages = v * pp
    bounds = list(mm.stage_boundaries(cfg, s, n_stages, ac)) + [cfg.n_layers] if pp > 1 else [0, cfg.n_layers]
    profile = schedule_profile(layout.pp_schedule, pp, m)
    links = cm.axis_links(layout, cluster)
    a = pb.activation
    table = mm.layer_table(cfg, s, a)
    emb_params, head_params = mm.embedding_params(cfg), mm.head_params(cfg)
    head_acts = mm.head_activation_bytes_per_token(cfg, a, tp)

    from trainforge.parallel.pipeline import stage_ids_for_rank

    idle = waiting_charged(cluster, layout.n_gpus, pp)  # the share of waiting (bubble, syncs) that costs time
    rows: list[dict[str, float]] = []
    for rank in range(pp):
        stages = stage_ids_for_rank(rank, pp, layout.pp_schedule, n_stages) if pp > 1 else [0]
        layers = [i for st in stages for i in range(bounds[st], bounds[st + 1])]
        first, last = 0 in stages, n_stages - 1 in stages
        dense = sum(table.dense_params[i] for i in layers)
        experts = sum(table.expert_params[i] for i in layers)
        block_dense = max((table.dense_params[i] for i in layers), default=0)
        dense += (emb_params if first else 0) + (head_params if last else 0)
        dense_local = dense / tp  # every matrix (and the vocab) is split by tp; norms are a rounding error
        experts_local = experts / ep
        params_local = dense_local / shard + experts_local
        state = {"params_bytes": params_local * pb.param, "grads_bytes": params_local * pb.grad,
                 "optimizer_bytes": params_local * (2 * pb.optimizer_state + pb.master)}
        if fsdp:
            state["unsharded_bytes"] = (block_dense / tp * (FSDP_BLOCKS_IN_FLIGHT * a + pb.reduce)
                                        if shard > 1 else 0.0)
        if ddp:
            state["ddp_bucket_bytes"] = params_local * pb.grad
        if not fsdp and a < pb.param:
            state["autocast_copy_bytes"] = params_local * a  # cast weights saved for backward

        # Activations (memory_model docstring): per stage-microbatch alive, plus the head and a recompute.
        per_layer = [table.activation_bytes_per_token[i] / tp for i in layers]
        kept_by_stage = [(bounds[st + 1] - bounds[st]) * cfg.dim * a / tp if ac
                         else sum(table.activation_bytes_per_token[bounds[st]:bounds[st + 1]]) / tp for st in stages]
        stage_bytes = max(kept_by_stage) * mb_tokens
        acts = profile.peak_in_flight * stage_bytes
        if ac:
            acts += max(per_layer) * mb_tokens
        if last:
            acts += head_acts * mb_tokens
        if layout.tp_mode == "2d":  # the gathered SUMMA panels kept for backward (tp2d_cost), per stage-microbatch
            blocks_panels = (1 if ac else len(layers) * profile.peak_in_flight) * tp2d_cost.panel_bytes(
                cfg, block_dense, mb_tokens, tp, a)
            state["tp2d_panels_bytes"] = blocks_panels + (tp2d_cost.panel_bytes(cfg, 0, mb_tokens, tp, a, head=True)
                                                          if last else 0.0)
        state["activations_bytes"] = acts
        state["reserved_bytes"] = RESERVED_BYTES + FRAGMENTATION * sum(state.values())

        # Compute and exposed per-microbatch communication of this rank, one micro-step.
        compute = m * ge.compute_s(cfg, [table.flops_per_token[i] for i in layers], layers,
                                   table.head_flops_per_token if last else 0.0, s, mb_tokens, tp, ep, ac, cluster,
                                   peak, workload.stack, gemm_peak=gemm_peak,
                                   gemm_bytes=1 if pb.gemm_dtype == "fp8" else a)
        # Memory-bound kernels (norms, rotary, SwiGLU's product, residual adds, the loss): each saved
        # activation written in forward, read in backward, its gradient written and read (4x; 6x with
        # the recomputed forward), the logits' ~14 bytes per vocab entry; at HBM bandwidth, not hidden.
        streamed = (sum(per_layer) * (6 if ac else 4) * ge.stream_factor(cluster, workload.stack)
                    + (cfg.vocab_size / tp * ge.loss_bytes_per_logit(cluster, workload.stack) if last else 0.0))
        memory_bound = streamed * mb_tokens * m / cluster.memory_bandwidth_bytes_per_s
        tp_size, tp_link = links["tp"]
        act_bytes = mb_tokens * cfg.dim * a
        # Sequence parallel (the trainer's default): each message is an all-gather + reduce-scatter
        # pair (= one all-reduce under the formulas; a measured cluster prices each op by its fit).
        tp_msg_s = cm.all_gather_s(act_bytes, tp_size, tp_link) + cm.reduce_scatter_s(act_bytes, tp_size, tp_link)
        if layout.tp_mode == "2d":
            # Every collective on the grid's row and column links, edges and loss included (tp2d_cost).
            # Under a pipeline: per microbatch (the weight panels are gathered again for each), the
            # embedding on the first stage only, the head and loss on the last.
            grid = tp2d_cost.comm(cfg, batch_size // m, s, len(layers), tp, a, cluster, ac, embedding=first, head=last)
            tp_total, tp_count, tp_grid_sync = m * grid.seconds, 0, m * grid.sync_s
            tp_block_sent = m * grid.block_sent_bytes
        else:
            tp_msgs = len(layers) * (6 if ac else 4) + 2 * (first + last)
            # Loss parallel: 3 small all-reduces of per-token values (max, sum of exp, target logit)
            # per pass on the last stage; and once a step the norms' Partial gradients, summed in one
            # flat all-reduce (parallel/partial_grads.py).
            tp_small = (m * 3 * cm.all_reduce_s(mb_tokens * 4, tp_size, tp_link) if last else 0.0) \
                + cm.all_reduce_s((2 * len(layers) + last) * cfg.dim * 4, tp_size, tp_link)
            tp_total = m * tp_msgs * tp_msg_s + tp_small
            tp_count, tp_grid_sync = m * (2 * tp_msgs + 3 * last) + 1, 0.0
            tp_block_sent = m * len(layers) * (6 if ac else 4) * 2 * (tp - 1) / tp * act_bytes
        tp_comm = ge.tp_exposed_s(tp_total, compute, cluster, workload.stack)
        moe_layers = sum(table.moe[i] for i in layers)
        ep_size, ep_link = links["ep"]
        dispatched = mb_tokens * cfg.n_activated_experts * cfg.dim * a
        ep_comm = m * moe_layers * (6 if ac else 4) * cm.all_to_all_s(dispatched, ep_size, ep_link)

        # Data parallel, one micro-step (the module docstring's traffic and overlap rules).
        shard_size, shard_link = links["dp_shard"]
        rep_size, rep_link = links["dp_replicate"]
        hidden_dp = compressed = 0.0
        if fsdp:
            # One collective per FSDP unit (each block, then the root: embedding, final norm, head;
            # parallel/data_parallel.py): forward gathers every unit, backward every block but the
            # last (kept unsharded after forward) and not the root; one reduce-scatter per unit.
            # Under a pipeline the gathers repeat per microbatch.
            blocks = [table.dense_params[i] / tp for i in layers]
            root = ((emb_params if first else 0) + (head_params if last else 0)) / tp
            units = blocks + ([root] if root else [])
            passes = m if pp > 1 else 1
            gathered = units + blocks[:-1]
            hidden_dp += passes * sum(cm.all_gather_s(u * a, shard_size, shard_link) for u in gathered)
            hidden_dp += sum(cm.reduce_scatter_s(u * pb.reduce, shard_size, shard_link) for u in units)
        rep_values = dense_local / shard  # what crosses dp_replicate: the shard (HSDP) or everything (DDP)
        if workload.compression == "none":
            hidden_dp += cm.all_reduce_s(rep_values * (pb.reduce if fsdp else pb.grad), rep_size, rep_link)
        else:
            compressed = cm.all_reduce_s(rep_values * wire, rep_size, rep_link)
        edp_size, edp_link = links["edp"]
        # What each blocking collective costs beyond its own time where ranks compute between them
        # (``Link.sync_s``: measured by the probe on a CPU cluster, 0 on the GPU table), by count:
        # TP's all-gathers and reduce-scatters and its small all-reduces, EP's all-to-alls and the
        # pipeline's receives sit inside the stage's time; the data-parallel ones are exposed.
        stage_syncs = idle * ((tp_count * tp_link.sync_s + tp_grid_sync if tp > 1 else 0.0)
                              + m * moe_layers * (6 if ac else 4) * ep_link.sync_s
                              + (2 * m * v * links["pp"][1].sync_s if pp > 1 else 0.0))
        dp_syncs = idle * (((passes * len(gathered) + len(units)) * shard_link.sync_s if fsdp else 0.0)
                           + (len(units) if fsdp else 1) * rep_link.sync_s)
        exposed_dp = (max(0.0, hidden_dp - compute - memory_bound) + hidden_dp / max(1, len(layers))
                      if cluster.comm_overlaps_compute else hidden_dp) + compressed + dp_syncs
        # CPU time the counts do not see (Cluster's *_overhead_s; 0 for the GPU table): a pass's
        # fixed cost for this rank's share of the layers, m passes per micro-step; under tp DTensor's
        # dispatch on top (per pass, and per token of the rank's shard): a term apart from tp_comm.
        share = len(layers) / cfg.n_layers
        tp_overhead = m * share * (cluster.tp_pass_overhead_s + mb_tokens / tp * cluster.tp_token_overhead_s) \
            if tp > 1 else 0.0
        fsdp_overhead = m * share * (cluster.fsdp_pass_overhead_s + mb_tokens / tp * cluster.fsdp_token_overhead_s) \
            if fsdp else 0.0
        pass_overhead = m * share * cluster.pass_overhead_s + tp_overhead + fsdp_overhead
        # AdamW once per step: reads parameters, gradients and both moments, writes all but the gradients.
        optimizer_s = params_local * (pb.param + pb.grad + 2 * pb.optimizer_state + pb.master) * 1.75 \
            / cluster.memory_bandwidth_bytes_per_s
        rows.append({**state, "memory_bytes": sum(state.values()), "compute_s": compute,
                     "memory_bound_s": memory_bound, "optimizer_s": optimizer_s, "tp_comm_s": tp_comm,
                     "ep_comm_s": ep_comm, "dp_comm_s": hidden_dp + compressed + dp_syncs,
                     "exposed_dp_s": exposed_dp,
                     "expert_grad_comm_s": cm.all_reduce_s(experts_local * pb.grad, edp_size, edp_link),
                     "sync_s": stage_syncs + dp_syncs,
                     "busy_s": compute + memory_bound + tp_comm + ep_comm + stage_syncs})
        rows[-1]["pass_overhead_s"] = pass_overhead
        rows[-1]["tp_block_bytes_sent_per_step"] = tp_block_sent  # per rank, the blocks' TP collectives
    worst = max(rows, key=lambda r: r["busy_s"])  # the slowest rank paces the pipeline
    fullest = max(rows, key=lambda r: r["memory_bytes"])
    memory = fullest["memory_bytes"]

    # The step: micro-steps of the slowest rank stretched by the bubble, then what stays exposed.
    pp_size, pp_link = links["pp"]
    hop = mb_tokens * cfg.dim * a / tp  # sequence parallel: the (B, T/tp, dim) shard crosses
    pp_total = 2 * m * v * cm.p2p_s(hop, pp_link) if pp > 1 else 0.0
    pp_exposed = 2 * (n_stages - 1) * cm.p2p_s(hop, pp_link) if pp > 1 else 0.0
    micro = layout.grad_accum_steps
    bubble = profile.bubble_fraction
    # A pipeline stage's ranks wait through the bubble; on a CPU with more ranks than cores the
    # other stages' ranks take those cores meanwhile (``waiting_charged``).
    stretch = 1 + idle * bubble / (1 - bubble) if bubble < 1 else math.inf
    makespan = worst["busy_s"] * stretch
    bubble_s = micro * (makespan - worst["busy_s"])
    exposed_comm = micro * (worst["tp_comm_s"] + worst["ep_comm_s"] + pp_exposed + worst["exposed_dp_s"]) \
        + worst["expert_grad_comm_s"]
    overhead = worst["pass_overhead_s"] * stretch  # on the critical path, as compute
    step_overhead = cluster.step_overhead_s + (cluster.tp_step_overhead_s if tp > 1 else 0.0)
    step_s = (micro * (makespan + overhead + pp_exposed + worst["exposed_dp_s"]) + worst["expert_grad_comm_s"]
              + max(r["optimizer_s"] for r in rows) + step_overhead)
    model_flops = table.model_flops_per_token * workload.global_batch * s
    n = layout.n_gpus
    # Times of the slowest rank per step; bytes of the fullest rank.
    breakdown = {k: t * micro for k, t in worst.items()
                 if k.endswith("_s") and k not in ("busy_s", "exposed_dp_s", "expert_grad_comm_s", "optimizer_s")}
    breakdown["optimizer_s"] = max(r["optimizer_s"] for r in rows)
    breakdown.update({k: v for k, v in fullest.items() if k.endswith("_bytes")})
    breakdown["expert_grad_comm_s"] = worst["expert_grad_comm_s"]
    breakdown["step_overhead_s"] = step_overhead
    breakdown["tp_block_bytes_sent_per_step"] = micro * worst["tp_block_bytes_sent_per_step"]
    breakdown.update(pp_comm_s=micro * pp_total, bubble_s=bubble_s, exposed_comm_s=exposed_comm,
                     microbatch_tokens=float(mb_tokens), batch_size=float(batch_size),
                     peak_in_flight=float(profile.peak_in_flight), model_flops=model_flops)
    for axis, (size, link) in links.items():
        breakdown[f"{axis}_inter_node"] = float(link.tier == "inter")
    if memory > cluster.memory_bytes:
        parts = {k: v for k, v in fullest.items() if k.endswith("_bytes") and k != "memory_bytes"}
        largest = max(parts, key=parts.get)
        return _infeasible(layout, f"needs {memory / 2**30:.1f} GiB per GPU, {cluster.name} has "
                                   f"{cluster.memory_bytes / 2**30:.0f} GiB (largest part: "
                                   f"{largest.removesuffix('_bytes')} "
                                   f"{parts[largest] / 2**30:.1f} GiB)", memory, breakdown)
    return Estimate(layout=layout, step_s=step_s, memory_bytes_per_gpu=memory,
                    mfu=model_flops / (step_s * n * peak), comm_share=exposed_comm / step_s,
                    bubble_fraction=bubble_s / step_s, tokens_per_s_per_gpu=workload.global_batch * s / step_s / n,
                    breakdown=breakdown)
