"""``[offload]``: optimizer offload (``train/offload_optimizer.py``), validated at the edge.

Off by default (``optimizer = false``): a run without the section trains exactly as before.
``check_offload`` holds the checks that need other sections (the layout, compression,
precision); ``Config.validate`` calls it, so a combination the offload does not support is
refused by name before anything is built.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Literal

from trainforge.config_base import _f, _require
from trainforge.errors import ConfigError


@dataclass
class OffloadSection:
    optimizer: bool = _f(False, "keep the fp32 master weights and the AdamW state in host memory (pinned on "
                                "CUDA) and run the update on host threads; the device keeps the parameters "
                                "and gradients only")
    mode: Literal["trainforge", "fsdp"] = _f(
        "trainforge", "trainforge = gradients copied to the host per bucket as the backward produces them, the "
                      "update on host threads, parameters copied back (single device, DDP, FSDP2); fsdp = FSDP2's "
                      "own CPUOffloadPolicy (sharded parameters, gradients and state on the host, the update on "
                      "the host; needs parallel.dp_shard > 1)")
    delay: int = _f(0, "trainforge: 0 = the update lands before the next forward (same result as AdamW on the "
                       "device); 1 = the update of step t runs during step t+1's forward and backward and lands "
                       "after them (ZeRO-Offload's delayed parameter update)")
    fraction: float = _f(1.0, "trainforge: share of the parameters (by count, in order) whose master weights and "
                              "AdamW state go to the host (Megatron's optimizer offload fraction); the rest stay "
                              "on the device with a plain AdamW")
    bucket_mb: float = _f(16.0, "trainforge: host buffer size per bucket, in MiB of fp32: one gradient copy and "
                                "one update task per bucket")
    threads: int = _f(1, "trainforge: host threads running updates (buckets are updated in parallel)")

    @property
    def enabled(self) -> bool:
        return self.optimizer

    def validate(self) -> None:
        _require(self.mode in ("trainforge", "fsdp"), "offload.mode", self.mode, "trainforge or fsdp")
        _require(self.delay in (0, 1), "offload.delay", self.delay, "0 or 1")
        _require(math.isfinite(self.fraction) and 0.0 < self.fraction <= 1.0, "offload.fraction", self.fraction,
                 "a number in (0, 1] (the share offloaded; 1 = all)")
        _require(math.isfinite(self.bucket_mb) and self.bucket_mb > 0, "offload.bucket_mb", self.bucket_mb,
                 "a number > 0")
        _require(self.threads >= 1, "offload.threads", self.threads, "an integer >= 1")
        if self.mode == "fsdp":
            for key, v, default in (("delay", self.delay, 0), ("fraction", self.fraction, 1.0)):
                _require(v == default, f"offload.{key}", v,
                         f"{default} with offload.mode = fsdp (FSDP2's CPUOffloadPolicy has no such knob); "
                         "use offload.mode = trainforge")


FSDP_NEEDED = ("FSDP2's CPUOffloadPolicy needs an FSDP2 layout; set parallel.dp_shard > 1 (or -1 on several "
               "processes with dp_replicate = 1), or use offload.mode = trainforge")


def check_offload_layout(offload: OffloadSection, data_parallel: str) -> None:
    """The layout check once the world size is known (``data_parallel``: ``none``, ``ddp``,
    ``fsdp`` or ``hsdp``, from ``parallel.data_parallel.data_parallel_kind``)."""
    if offload.optimizer and offload.mode == "fsdp" and data_parallel not in ("fsdp", "hsdp"):
        raise ConfigError(f"config key 'offload.mode' = 'fsdp' cannot run on this layout (data parallelism: "
                          f"{data_parallel}): {FSDP_NEEDED}")


def check_offload(offload: OffloadSection, parallel: Any, compression: Any, precision: Any) -> None:
    """Refuse, by key, the combinations offload does not support (``Config.validate``)."""
    if not offload.optimizer:
        return

    def refuse(key: str, value: Any, why: str) -> None:
        raise ConfigError(f"config key '{key}' = {value!r} cannot be combined with offload.optimizer = true "
                          f"(offload.mode = {offload.mode}): {why}")

    if offload.mode == "fsdp":
        if parallel.dp_shard == 1:
            refuse("parallel.dp_shard", parallel.dp_shard, FSDP_NEEDED)
        if compression.codec != "none":
            refuse("compression.codec", compression.codec, "the compressed FSDP2 hooks reduce device gradients; "
                   "set compression.codec = none")
        return
    for key, v in (("parallel.tp", parallel.tp), ("parallel.pp", parallel.pp), ("parallel.ep", parallel.ep)):
        if v > 1:
            refuse(key, v, "the host update needs each parameter's final gradient when the backward ends, which "
                   "tensor, pipeline and expert parallelism finish later; set it to 1, or use offload.mode = fsdp "
                   "(FSDP2 + TP)" if key == "parallel.tp" else "set it to 1")
    if compression.codec != "none":
        refuse("compression.codec", compression.codec, "gradient compression and the offload both hook the "
               "gradient buckets; set compression.codec = none")
    if precision.policy in ("fp16-mixed", "dynamic") or precision.compute_dtype == "fp16":
        key, v = (("precision.policy", precision.policy) if precision.policy in ("fp16-mixed", "dynamic")
                  else ("precision.compute_dtype", precision.compute_dtype))
        refuse(key, v, "fp16 loss scaling rescales gradients after they reached the host; use bf16-mixed or fp32")
    if precision.optimizer_state_dtype not in ("auto", "fp32"):
        refuse("precision.optimizer_state_dtype", precision.optimizer_state_dtype,
               "the host keeps fp32 master weights and AdamW state; use auto or fp32")
