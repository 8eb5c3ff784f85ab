"""The planner's shared types: what a cluster can do (``Cluster``), what is trained
(``Workload``), how it is laid out (``Layout``) and what the cost model predicts for that
layout (``Estimate``). Units are in the names: bytes, bytes/s, FLOP/s, seconds.

``Cluster`` comes from the shipped GPU table (``hardware.py``: every number with its source)
or from a probe of this machine (``probe.py``); ``cost_model.estimate(workload, layout,
cluster)`` gives an ``Estimate``; ``planner.py`` enumerates layouts and ranks them; the
validation (``published.py``, ``bench/plan_validation.py``) compares estimates with published
and measured step times."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from trainforge.model.config import ModelConfig


@dataclass(frozen=True)
class LinkTier:
    """One level of the interconnect, alpha-beta: a message of n bytes takes
    ``latency_s + n / bandwidth_bytes_per_s`` (bandwidth per GPU, one direction: the bus
    bandwidth NCCL's all-reduce test reports)."""

    bandwidth_bytes_per_s: float
    latency_s: float
    source: str = ""


@dataclass(frozen=True)
class Cluster:
    """``n_gpus`` devices, ``gpus_per_node`` of them per node (the intra tier inside a node,
    the inter tier between nodes). ``peak_flops``: dense peak per device by compute dtype
    name ("bf16", "fp16", "fp32", "tf32", "fp8"). ``sources``: field -> where the number
    comes from (a datasheet URL, a paper, or "measured on this machine <date>")."""

    name: str
    n_gpus: int
    gpus_per_node: int
    peak_flops: dict[str, float]
    memory_bytes: float
    memory_bandwidth_bytes_per_s: float
    intra: LinkTier
    inter: LinkTier
    sources: dict[str, str] = field(default_factory=dict)
    # Fraction of the dense peak a well-shaped large GEMM reaches (measured by a probe, or a
    # published figure for the GPU); the cost model multiplies peak_flops by it.
    matmul_efficiency: float = 1.0
    # Per-kernel figures of the device (``gemm_efficiency.KERNEL_TABLES`` key): GEMM rate by
    # shape, flash-attention speed, and the training stack's terms. "" (a measured cluster):
    # no size dependence, one matmul_efficiency for every FLOP.
    kernel_table: str = ""
    # CPU time per step the FLOP and byte counts do not see, measured by ``calibration.calibrate``
    # (0 for the GPU table): ``step_overhead_s`` once per optimizer step (the trainer's
    # clipping, bad-step guard, loss sync, logging, Python around the optimizer);
    # ``pass_overhead_s`` once per forward + backward of the whole model (per-op dispatch; a
    # rank pays its layers' share per micro-batch and pipeline microbatch); under tensor
    # parallelism DTensor's dispatch on top, ``tp_pass_overhead_s`` per pass of the whole model
    # + ``tp_token_overhead_s`` per token of a rank's shard (tokens / tp), and
    # ``tp_step_overhead_s`` per step (clipping and AdamW on DTensors); under FSDP2 its hooks,
    # copies in and out of the collectives' buffers and DTensor bookkeeping,
    # ``fsdp_pass_overhead_s`` per pass + ``fsdp_token_overhead_s`` per token (apart from the
    # collectives themselves).
    step_overhead_s: float = 0.0
    pass_overhead_s: float = 0.0
    tp_pass_overhead_s: float = 0.0
    tp_token_overhead_s: float = 0.0
    tp_step_overhead_s: float = 0.0
    fsdp_pass_overhead_s: float = 0.0
    fsdp_token_overhead_s: float = 0.0
    # False where data-parallel traffic cannot hide behind compute: a CPU "cluster" with as many
    # processes as cores or more, whose collective threads take the cores the compute runs on.
    comm_overlaps_compute: bool = True
    # CPU cores the ranks of a node share (a measured CPU cluster); 0: a device per rank (GPUs).
    # With more ranks than cores a waiting rank's core runs other ranks (``cost_model.waiting_charged``).
    cores: int = 0

    @property
    def n_nodes(self) -> int:
        return -(-self.n_gpus // self.gpus_per_node)


@dataclass(frozen=True)
class Workload:
    """What one optimizer step trains: ``global_batch`` sequences of ``seq_len`` tokens.
    ``precision``: a ``[precision] policy`` name (fp32, bf16-mixed, fp16-mixed, bf16...);
    ``compression``: a ``[compression] codec`` name (none, int8, int4, adaptive, topk...).
    ``stack``: the training software stack (``gemm_efficiency.STACKS``: trainforge = eager
    PyTorch FSDP2/DTensor, trainforge-compile, megatron); it sets kernel speeds and overlap on
    clusters with a kernel table."""

    model: ModelConfig
    seq_len: int
    global_batch: int
    precision: str = "bf16-mixed"
    compression: str = "none"
    flavor: str = ""
    stack: str = "trainforge"


@dataclass(frozen=True)
class Layout:
    """One parallel layout, in ``[parallel]`` key names: the product
    dp_replicate x dp_shard x tp x pp is the GPU count; ep (expert parallelism) divides
    dp_replicate x dp_shard and the routed experts (``[parallel] ep``). ``microbatches``: pipeline microbatches per step
    (1 without a pipeline); ``grad_accum_steps``: gradient accumulation (micro-steps per
    optimizer step, each of global_batch / (dp x grad_accum) sequences per data-parallel rank).
    ``tp_mode``: "1d" (Megatron) or "2d" (SUMMA on a sqrt(tp) x sqrt(tp) grid, ``plan/tp2d_cost.py``)."""

    dp_replicate: int = 1
    dp_shard: int = 1
    tp: int = 1
    pp: int = 1
    ep: int = 1
    microbatches: int = 1
    pp_schedule: str = "1f1b"
    activation_checkpoint: bool = False
    grad_accum_steps: int = 1
    tp_mode: str = "1d"

    @property
    def n_gpus(self) -> int:
        return self.dp_replicate * self.dp_shard * self.tp * self.pp

    @property
    def dp(self) -> int:
        return self.dp_replicate * self.dp_shard

    def overrides(self) -> dict[str, dict[str, Any]]:
        """The TOML tables ``trainforge train --config`` reads for this layout."""
        par: dict[str, Any] = {"dp_replicate": self.dp_replicate, "dp_shard": self.dp_shard, "tp": self.tp,
                               "pp": self.pp}
        if self.tp_mode != "1d":
            par["tp_mode"] = self.tp_mode
        if self.ep > 1:
            par["ep"] = self.ep
        if self.pp > 1:
            par.update(microbatches=self.microbatches, pp_schedule=self.pp_schedule)
        if self.activation_checkpoint:
            par["activation_checkpointing"] = "full"
        return {"parallel": par, "training": {"grad_accum_steps": self.grad_accum_steps}}


@dataclass(frozen=True)
class Estimate:
    """The cost model's prediction for one layout. ``memory_bytes_per_gpu`` is the peak of
    the most loaded rank; ``breakdown`` names each part in seconds or bytes
    (``compute_s``, ``tp_comm_s``, ``dp_comm_s``, ``pp_comm_s``, ``bubble_s``,
    ``exposed_comm_s``, ``params_bytes``, ``grads_bytes``, ``optimizer_bytes``,
    ``activations_bytes``...). ``feasible`` is False with ``why`` when it does not fit or
    the layout is invalid for the model."""

    layout: Layout
    step_s: float
    memory_bytes_per_gpu: float
    mfu: float
    comm_share: float
    bubble_fraction: float
    tokens_per_s_per_gpu: float
    feasible: bool = True
    why: str = ""
    breakdown: dict[str, float] = field(default_factory=dict)
