"""``[parallel]`` (the layout: data, tensor, pipeline and expert parallel degrees and their
options) and ``[distributed]`` (process-group behaviour: how long to wait for a peer)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

from trainforge.config_base import _f, _require


@dataclass
class ParallelSection:
    dp_replicate: int = _f(1, "data-parallel replicas (DDP, or the replicate axis of HSDP: across nodes)")
    dp_shard: int = _f(-1, "FSDP2 shards per replica; -1 = whatever the other axes leave of the world size")
    tp: int = _f(1, "tensor-parallel degree (DTensor; keep within a node)")
    tp_mode: Literal["1d", "2d"] = _f("1d", "how the tp ranks split the model: 1d (Megatron: heads and FFN hidden "
                                            "dim over all tp ranks) or 2d (SUMMA: tp = q x q grid, weights split "
                                            "over grid rows and columns, batch rows over grid rows, hidden over "
                                            "grid columns; dense Llama models only; parallel/tp2d)")
    pp: int = _f(1, "pipeline stages")
    ep: int = _f(1, "expert-parallel degree: each expert layer's routed experts split over this many data-parallel "
                    "ranks (must divide dp_replicate x dp_shard and model.n_routed_experts)")
    pp_schedule: Literal["gpipe", "1f1b", "interleaved-1f1b", "zbv", "dualpipev"] = _f(
        "1f1b", "pipeline schedule")
    microbatches: int = _f(0, "pipeline microbatches per step; 0 = 2 x the number of stages")
    pp_split: str = _f("auto", "stage boundaries: auto (measured), even, or comma-separated first layer of "
                               "each stage, e.g. 0,5,9")
    pp_memory_limit_mb: int = _f(0, "auto split: most memory one stage may use (weights, grads, AdamW state, "
                                    "activations of in-flight microbatches); 0 = no limit")
    rebalance_threshold: float = _f(0.0, "re-split the pipeline (checkpoint, re-measure, continue) when the "
                                         "slowest stage's imbalance exceeds the planned one by this fraction; "
                                         "0 = off; needs pp_split = auto")
    rebalance_min_steps: int = _f(100, "steps between two pipeline re-balances")
    sequence_parallel: bool = _f(True, "shard norms and residuals along the sequence between TP regions (tp_mode "
                                       "1d; 2d splits batch rows over its grid rows instead and ignores it)")
    loss_parallel: bool = _f(True, "compute cross-entropy on vocab-sharded logits under TP (tp_mode 2d always "
                                   "does)")
    activation_checkpointing: Literal["none", "full"] = _f("none", "recompute each block's activations "
                                                                   "in backward")
    compile: bool = _f(False, "torch.compile each transformer block (after TP and activation checkpointing, "
                              "before data parallel); ~1.0x on CPU, costs tens of seconds at start")

    def validate(self) -> None:
        for name in ("dp_replicate", "tp", "pp", "ep"):
            v = getattr(self, name)
            _require(v >= 1, f"parallel.{name}", v, "an integer >= 1")
        _require(self.dp_shard == -1 or self.dp_shard >= 1, "parallel.dp_shard", self.dp_shard,
                 "an integer >= 1, or -1 to fill")
        _require(self.pp_memory_limit_mb >= 0, "parallel.pp_memory_limit_mb", self.pp_memory_limit_mb,
                 "an integer >= 0 (0 = no limit)")
        _require(self.rebalance_threshold >= 0, "parallel.rebalance_threshold", self.rebalance_threshold,
                 "a number >= 0 (0 = off)")
        _require(self.rebalance_min_steps >= 1, "parallel.rebalance_min_steps", self.rebalance_min_steps,
                 "an integer >= 1")
        if self.tp_mode == "2d":
            from trainforge.parallel.tp2d.grid import grid_side

            grid_side(self.tp)  # tp = q * q, q >= 2; the error names parallel.tp and parallel.tp_mode
            _require(self.loss_parallel, "parallel.loss_parallel", self.loss_parallel,
                     "true with parallel.tp_mode = \"2d\" (its logits stay split over the grid: batch rows by grid "
                     "row, vocab by grid column; nothing gathers them whole); set it to true or use tp_mode = \"1d\"")
        _require(self.microbatches >= 0, "parallel.microbatches", self.microbatches, "an integer >= 0 (0 = auto)")
        if self.pp_split not in ("auto", "even"):
            try:
                bounds = [int(x) for x in self.pp_split.split(",")]
            except ValueError:
                bounds = []
            _require(bool(bounds) and bounds[0] == 0 and bounds == sorted(set(bounds)), "parallel.pp_split",
                     self.pp_split, "auto, even, or increasing comma-separated layer indices starting at 0")


@dataclass
class DistributedSection:
    timeout_s: float = _f(600.0, "longest wait for another rank in one collective (and at start-up) before this "
                                 "rank fails with exit code 4: a hung or dead peer ends the job instead of "
                                 "blocking it forever")

    def validate(self) -> None:
        _require(math.isfinite(self.timeout_s) and self.timeout_s > 0, "distributed.timeout_s", self.timeout_s,
                 "a number of seconds > 0")
