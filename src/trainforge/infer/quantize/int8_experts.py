"""Int8 routed experts: each expert's w1, w2, w3 quantised per output channel as ``Int8Linear``
(symmetric absmax / 127), stacked: ``w1`` int8 (n, hidden, dim) + ``w1_scales`` fp32 (n, hidden),
and so on. Runs with ``torch.ops.aten._weight_int8pack_mm`` per expert slice: on CPU on
bfloat16 activations (the linear's ``int8pack_bf16`` kernel: that op's fast path there; see
``experts.py`` for the measurements), on CUDA as ``int8pack``."""

from __future__ import annotations

from trainforge.infer.quantize.experts import QuantExperts
from trainforge.infer.quantize.int8 import Int8Linear


class Int8Experts(QuantExperts):
    MODE = "int8"
    LINEAR = Int8Linear
    DEFAULT_KERNEL = {"cpu": "int8pack_bf16", "cuda": "int8pack"}
