"""``[qat]``: quantisation-aware training (``train/qat.py``), validated at the edge.

Off by default (``scheme = "none"``): a run without the section trains exactly as before.
Checks that need other sections (``start_step`` against ``training.steps``) are in
``Config.validate``; the ones that need the model or the layout (MoE, tensor or pipeline
parallelism) in ``qat.check_qat``, before anything is allocated.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from trainforge.config_base import _f, _require

SCHEMES = ("none", "int8", "int4")


@dataclass
class QATSection:
    scheme: Literal["none", "int8", "int4"] = _f(
        "none", "fake-quantise the linear weights in training on the grid of `trainforge quantize --mode`: "
                "int8 (per-row absmax) or int4 (per-group min/max along the input dim); none = off")
    group_size: int = _f(128, "int4: weights per group along the input dim (32, 64, 128 or 256 for the CPU "
                              "kernel); layers whose in_features it does not divide stay float, as quantize does")
    start_step: int = _f(0, "fake quantisation is on from this step on (0 = the whole run): QAT over the last "
                            "part of a run, or a fine-tune resumed from a float checkpoint")
    activations: Literal["none", "int8"] = _f(
        "none", "with scheme = int8: also fake-quantise each linear's input as the CPU int8 kernel (fbgemm's "
                "dynamic linear) quantises it when serving: per tensor, 7-bit, asymmetric (W8A8); none = weights only")

    @property
    def enabled(self) -> bool:
        return self.scheme != "none"

    def validate(self) -> None:
        _require(self.scheme in SCHEMES, "qat.scheme", self.scheme, f"one of {list(SCHEMES)}")
        if self.scheme == "int4":
            _require(self.group_size >= 2 and self.group_size % 2 == 0, "qat.group_size", self.group_size,
                     "an even integer >= 2 (32, 64, 128 or 256 for the CPU int4 kernel)")
        _require(self.start_step >= 0, "qat.start_step", self.start_step,
                 "an integer >= 0 (the first step trained with fake-quantised weights; 0 = from the start)")
        _require(self.activations in ("none", "int8"), "qat.activations", self.activations, "none or int8")
        _require(self.activations == "none" or self.scheme == "int8", "qat.activations", self.activations,
                 "none with scheme int4 (the int4 kernels keep activations in bf16; int8 activations go with "
                 "scheme = int8, the W8A8 kernel)")
