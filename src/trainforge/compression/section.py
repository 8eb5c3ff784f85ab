"""``[compression]``: how gradients cross the ``dp_replicate`` axis (DDP, or the
inter-node axis of HSDP)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

from trainforge.config_base import _f, _require

CodecName = Literal["none", "int8", "int4", "adaptive", "topk", "topk+int4", "powersgd"]


@dataclass
class CompressionSection:
    codec: CodecName = _f("none", "gradient codec on the dp_replicate axis: none, int8, int4, adaptive (4 or 8 "
                                  "bits per bucket from measured error), topk, topk+int4, powersgd (PyTorch's "
                                  "hook, DDP only; a baseline)")
    block_size: int = _f(256, "values per quantisation block (one fp32 scale each): int4 costs 4 + 32/block_size "
                              "bits per value")
    error_feedback: bool = _f(True, "add what compression dropped to the next step's gradient")
    warmup_steps: int = _f(10, "optimizer steps sent in full precision before compressing")
    min_bits: int = _f(4, "adaptive: narrowest width (4 or 8)")
    max_bits: int = _f(8, "adaptive: widest width (4 or 8)")
    target_rel_error: float = _f(0.25, "adaptive: widen a bucket when its expected relative error at min_bits "
                                       "exceeds this")
    topk_ratio: float = _f(0.01, "topk: fraction of values kept per chunk")
    stochastic_rounding: bool = _f(False, "round quantised values stochastically (unbiased) instead of to nearest")
    powersgd_rank: int = _f(4, "powersgd: rank of the low-rank approximation")
    host_reduce: bool = _f(False, "run the dp_replicate (inter-node) reduction from host memory on a host thread, "
                                  "with this codec (none = fp32), overlapping compute; DDP or HSDP")
    host_reduce_delay: int = _f(0, "host_reduce: 0 = the update applies its own step's gradient (the reduction "
                                   "overlaps only the rest of the backward); 1 = the update of step t applies the "
                                   "mean gradient of step t-1 (its reduction overlaps step t's forward and "
                                   "backward; the first step applies no update; costs loss, see the docs)")

    def validate(self) -> None:
        _require(self.block_size >= 8 and self.block_size % 8 == 0, "compression.block_size", self.block_size,
                 "a multiple of 8, >= 8 (e.g. 256)")
        _require(self.warmup_steps >= 0, "compression.warmup_steps", self.warmup_steps, "an integer >= 0")
        for name in ("min_bits", "max_bits"):
            v = getattr(self, name)
            _require(v in (4, 8), f"compression.{name}", v, "4 or 8")
        _require(self.min_bits <= self.max_bits, "compression.min_bits", self.min_bits,
                 f"at most compression.max_bits ({self.max_bits})")
        _require(math.isfinite(self.target_rel_error) and self.target_rel_error > 0, "compression.target_rel_error",
                 self.target_rel_error, "a number > 0")
        _require(0.0 < self.topk_ratio <= 1.0, "compression.topk_ratio", self.topk_ratio, "a number in (0, 1]")
        _require(self.host_reduce_delay in (0, 1), "compression.host_reduce_delay", self.host_reduce_delay, "0 or 1")
        _require(not (self.host_reduce and self.codec == "powersgd"), "compression.host_reduce", self.host_reduce,
                 "false with compression.codec = 'powersgd' (PyTorch's hook reduces on the device); use a codec "
                 "of trainforge's own (none, int8, int4, adaptive, topk, topk+int4)")
        _require(self.powersgd_rank >= 1, "compression.powersgd_rank", self.powersgd_rank, "an integer >= 1")
