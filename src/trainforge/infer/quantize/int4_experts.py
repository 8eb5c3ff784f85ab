"""Int4 routed experts: each expert's w1, w2, w3 quantised in groups along the input dim as
``Int4Linear`` (asymmetric min/max), stacked: ``w1`` uint8 (n, hidden, dim/2) + ``w1_scales``,
``w1_zeros`` fp32 (n, hidden, dim/group), and so on. Runs with
``torch.ops.aten._weight_int4pack_mm_for_cpu`` per expert slice on CPU (torchao's int4 fails
there), ``_weight_int4pack_mm`` on CUDA.

The experts' hidden dim is w2's input dim, and fine-grained experts are narrow (moe-tiny:
176, a multiple of no CPU group size): it is padded up to a multiple of ``group_size`` with
zero rows of w1, w3 and zero columns of w2, which add exactly nothing (silu(0) * 0 = 0).
Experts whose model dim is not a multiple of ``group_size`` stay float."""

from __future__ import annotations

from trainforge.infer.quantize.experts import QuantExperts
from trainforge.infer.quantize.int4 import Int4Linear


class Int4Experts(QuantExperts):
    MODE = "int4"
    LINEAR = Int4Linear
    DEFAULT_KERNEL = {"cpu": "int4pack_cpu", "cuda": "int4pack_cuda"}

    @classmethod
    def padded_hidden(cls, hidden: int, group_size: int = 128) -> int:
        return -(-hidden // group_size) * group_size

    @classmethod
    def skip_reason(cls, dim: int, hidden: int, group_size: int = 128) -> str | None:
        if dim % group_size:
            return f"dim {dim} is not a multiple of group_size {group_size}"
        return None
