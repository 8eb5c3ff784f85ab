"""``[training]``, ``[optimizer]`` and ``[checkpoint]``: the loop's own config sections
(training control's sections are in ``control_section.py``)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

from trainforge.config_base import _f, _require


@dataclass
class TrainingSection:
    steps: int = _f(300, "optimizer steps to run")
    batch_size: int = _f(8, "sequences per micro-batch")
    grad_accum_steps: int = _f(1, "micro-batches accumulated per optimizer step")
    seq_len: int = _f(256, "tokens per sequence (the longest, under a seq_len_schedule)")
    # A changing sequence length at constant tokens per step (train/seq_len_schedule.py).
    seq_len_schedule: Literal["fixed", "linear", "auto"] = _f(
        "fixed", "sequence length over training, at constant tokens per step (batch_size x seq_len: at half the "
                 "length, twice the sequences): fixed = seq_len throughout; linear = ramp from seq_len_start to "
                 "seq_len over seq_len_ramp_steps (rounded down to the lengths that divide seq_len); auto = start at "
                 "seq_len_start and double when the training loss plateaus, up to seq_len")
    seq_len_start: int = _f(0, "linear, auto: the first length, a multiple of seq_len_multiple dividing seq_len "
                               "(auto: seq_len / seq_len_start a power of two); 0 = seq_len / 4")
    seq_len_multiple: int = _f(8, "linear, auto: every length is a multiple of this (what the attention kernel or "
                                  "compiled shapes want, e.g. 8 or 64) and divides seq_len")
    seq_len_ramp_steps: int = _f(100, "linear: steps from seq_len_start to seq_len")
    seq_len_plateau_window: int = _f(8, "auto: logging intervals judged by the plateau test (the adaptive LR's) "
                                        "before each doubling")
    seq_len_plateau_rel_delta: float = _f(0.01, "auto: a plateau is the window's second half improving on its "
                                                "first by less than this fraction")
    lr: float = _f(1e-3, "peak learning rate, reached after warmup")
    lr_schedule: Literal["cosine", "wsd", "linear", "constant"] = _f(
        "cosine", "after the linear warmup: cosine or linear decay to min_lr_ratio at training.steps, wsd "
                  "(warmup-stable-decay: constant, then decay over the last decay_ratio of the steps), or constant")
    min_lr_ratio: float = _f(0.1, "decay floor as a fraction of lr (cosine, linear, wsd)")
    decay_ratio: float = _f(0.1, "wsd: fraction of training.steps spent decaying")
    decay_shape: Literal["linear", "sqrt", "cosine"] = _f("linear", "wsd: shape of the final decay")
    warmup_steps: int = _f(30, "linear warmup steps")
    grad_clip: float = _f(1.0, "clip the global gradient norm to this; 0 = off")
    seed: int = _f(1234, "seed for weights, data order and sampling")
    val_interval: int = _f(100, "run validation every this many steps (and at the end); 0 = only at the end")
    val_batches: int = _f(8, "micro-batches per validation pass")
    log_interval: int = _f(10, "print a log line every this many steps")
    device: str = _f("auto", "auto (cuda if present, else cpu), cpu, cuda, or cuda:N")
    threads: int = _f(0, "torch intra-op threads; 0 = leave torch's default")
    loss_chunk_tokens: int = _f(0, "output projection + cross-entropy this many tokens at a time, recomputed "
                                   "in backward (never the whole logits tensor: less memory, ~7% more forward "
                                   "FLOPs on small); 0 = all at once. Single-device or DDP runs")
    # Multi-token prediction (model.mtp_depth > 0; train/mtp_loss.py).
    mtp_loss_weight: float | None = _f(None, "multi-token prediction: lambda in loss = main loss + lambda x mean "
                                             "MTP loss over depths; unset = 0.3 (DeepSeek-V3) when "
                                             "model.mtp_depth > 0")
    mtp_loss_weight_final: float | None = _f(None, "multi-token prediction: lambda after "
                                                   "training.mtp_loss_weight_switch_step (DeepSeek-V3: 0.1)")
    mtp_loss_weight_switch_step: int = _f(0, "multi-token prediction: steps after this one use "
                                             "training.mtp_loss_weight_final; 0 = never switch")

    def validate(self) -> None:
        for name in ("steps", "batch_size", "grad_accum_steps", "seq_len", "val_batches", "log_interval"):
            v = getattr(self, name)
            _require(v >= 1, f"training.{name}", v, "an integer >= 1")
        for name in ("warmup_steps", "val_interval", "threads", "seed", "loss_chunk_tokens"):
            v = getattr(self, name)
            _require(v >= 0, f"training.{name}", v, "an integer >= 0")
        _require(math.isfinite(self.lr) and self.lr > 0, "training.lr", self.lr, "a finite number > 0")
        _require(0.0 <= self.min_lr_ratio <= 1.0, "training.min_lr_ratio", self.min_lr_ratio, "a number in [0, 1]")
        _require(0.0 < self.decay_ratio <= 1.0, "training.decay_ratio", self.decay_ratio, "a number in (0, 1]")
        if self.lr_schedule == "wsd":
            decay_steps = max(1, round(self.decay_ratio * self.steps))
            _require(self.warmup_steps + decay_steps <= self.steps, "training.decay_ratio", self.decay_ratio,
                     f"with lr_schedule = wsd, warmup_steps ({self.warmup_steps}) + decay_ratio x steps "
                     f"({decay_steps}) must not exceed training.steps ({self.steps}); lower one of them")
        _require(math.isfinite(self.grad_clip) and self.grad_clip >= 0, "training.grad_clip", self.grad_clip,
                 "a number >= 0 (0 turns clipping off)")
        for name in ("mtp_loss_weight", "mtp_loss_weight_final"):
            v = getattr(self, name)
            _require(v is None or (math.isfinite(v) and v >= 0), f"training.{name}", v, "a finite number >= 0")
        _require(self.mtp_loss_weight_switch_step >= 0, "training.mtp_loss_weight_switch_step",
                 self.mtp_loss_weight_switch_step, "an integer >= 0 (0 = never switch)")
        _require((self.mtp_loss_weight_final is None) == (self.mtp_loss_weight_switch_step == 0),
                 "training.mtp_loss_weight_switch_step", self.mtp_loss_weight_switch_step,
                 "set together with training.mtp_loss_weight_final (the weight after the switch; "
                 f"now {self.mtp_loss_weight_final}): both or neither")
        from trainforge.train.seq_len_ladder import check_schedule_keys

        check_schedule_keys(self)  # training.seq_len_* of a linear or auto schedule
        _require(self.device == "auto" or self.device == "cpu" or self.device.startswith("cuda"),
                 "training.device", self.device, "auto, cpu, cuda or cuda:N")


@dataclass
class OptimizerSection:
    name: Literal["adamw"] = _f("adamw", "optimizer (AdamW; more come with later issues)")
    beta1: float = _f(0.9, "AdamW beta1")
    beta2: float = _f(0.95, "AdamW beta2")
    eps: float = _f(1e-8, "AdamW epsilon")
    weight_decay: float = _f(0.1, "decoupled weight decay on matrices (not on norms or biases)")
    # A weight decay that changes over training (train/wd_schedule.py).
    weight_decay_schedule: Literal["constant", "linear", "cosine"] = _f(
        "constant", "weight decay over training: constant = optimizer.weight_decay throughout; linear or cosine = "
                    "from optimizer.weight_decay to optimizer.weight_decay_final, ramping from "
                    "weight_decay_ramp_start x training.steps to training.steps (a late increase: final > start)")
    weight_decay_final: float | None = _f(None, "linear, cosine: the weight decay at training.steps (set with "
                                                "weight_decay_schedule; unset = no schedule)")
    weight_decay_ramp_start: float = _f(0.0, "linear, cosine: where the ramp starts, as a fraction of "
                                             "training.steps in [0, 1) (0.5 = constant for the first half, then "
                                             "the ramp)")
    # Batch-size rule for the LR (plan/lr_scaling.py): the same recipe at another global batch.
    lr_scaling: Literal["none", "linear", "sqrt"] = _f(
        "none", "scale the peak LR with the global batch (batch_size x grad_accum_steps x data-parallel ranks, in "
                "sequences): none = training.lr as given; linear = training.lr x global / lr_reference_batch; "
                "sqrt = training.lr x sqrt(global / lr_reference_batch)")
    lr_reference_batch: int = _f(0, "linear, sqrt: the global batch, in sequences per optimizer step, at which "
                                    "training.lr was tuned (ignored with lr_scaling = none)")
    implementation: Literal["auto", "fused", "foreach", "for-loop", "cpu"] = _f(
        "auto", "AdamW kernel: auto picks fused where the device supports it, else foreach; cpu = trainforge's C++ "
                "CPU AdamW (AVX-512 / AVX2, threads; CPU training on plain tensors: one process or DDP), torch's "
                "fused where it cannot build")
    moments_dtype: Literal["float32", "bfloat16"] = _f(
        "float32", "dtype of AdamW's two moments (implementation = cpu): bfloat16 moves ~30% fewer bytes per step")
    moments_rounding: Literal["stochastic", "nearest"] = _f(
        "stochastic", "moments_dtype = bfloat16: how each step rounds the moments (nearest loses increments below "
                      "half a bf16 step: a second moment with beta2 near 1 stalls)")

    def validate(self) -> None:
        for name in ("beta1", "beta2"):
            v = getattr(self, name)
            _require(0.0 <= v < 1.0, f"optimizer.{name}", v, "a number in [0, 1)")
        _require(self.eps > 0, "optimizer.eps", self.eps, "a number > 0")
        _require(self.weight_decay >= 0, "optimizer.weight_decay", self.weight_decay, "a number >= 0")
        scheduled = self.weight_decay_schedule != "constant"
        final = self.weight_decay_final
        _require(final is None or (math.isfinite(final) and final >= 0), "optimizer.weight_decay_final", final,
                 "a finite number >= 0")
        _require(scheduled == (final is not None), "optimizer.weight_decay_final", final,
                 f"set together with optimizer.weight_decay_schedule = linear or cosine (now "
                 f"{self.weight_decay_schedule!r}): both or neither")
        _require(0.0 <= self.weight_decay_ramp_start < 1.0, "optimizer.weight_decay_ramp_start",
                 self.weight_decay_ramp_start, "a fraction of training.steps in [0, 1)")
        _require(self.lr_reference_batch >= 0, "optimizer.lr_reference_batch", self.lr_reference_batch,
                 "an integer >= 0 (sequences per optimizer step)")
        _require(self.lr_scaling == "none" or self.lr_reference_batch >= 1, "optimizer.lr_reference_batch",
                 self.lr_reference_batch, f"with optimizer.lr_scaling = {self.lr_scaling}, the global batch (in "
                 "sequences: batch_size x grad_accum_steps x data-parallel ranks) training.lr was tuned at, >= 1")
        _require(self.moments_dtype == "float32" or self.implementation == "cpu", "optimizer.moments_dtype",
                 self.moments_dtype, "float32 unless optimizer.implementation = cpu (the kernel that keeps "
                 "bfloat16 moments)")


@dataclass
class CheckpointSection:
    interval: int = _f(100, "save a checkpoint every this many steps (and always at the end); 0 = only at the end")
    keep_last: int = _f(3, "how many most recent checkpoints to keep")
    fallback: bool = _f(False, "on resume, skip a corrupt newest checkpoint (sha256 mismatch, unreadable or "
                               "missing file) with a warning and load the newest intact one; false = refuse")

    def validate(self) -> None:
        _require(self.interval >= 0, "checkpoint.interval", self.interval, "an integer >= 0")
        _require(self.keep_last >= 1, "checkpoint.keep_last", self.keep_last, "an integer >= 1")
