"""The C++ decode-step ops handed to the model's fast decode step from outside.

``model/fast_decode.py`` binds each module's ``decode_calls``; where a ``DecodeWorkspace``
carries ``kernels`` (this object), the rotary embedding and the paged-cache attention bind
one C++ op each (``attention.cpp``) instead of their 20 torch ops per layer, and the fused
RMSNorm and SwiGLU gate theirs (``norm_act.cpp``) instead of 5 and 2; ``compile`` then makes
the bound step one C++ call (``call_program.py``). The model layer never imports
``trainforge.infer``: the runner passes this in.
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import nn

from trainforge.infer.cpu_kernels.build import load_kernels
from trainforge.infer.cpu_kernels.call_program import compile_calls


class DecodeKernels:
    """``rope(xs, cos, sin)``: each x (B, n, D) rotated in place; ``paged_attention(q, k, v, kp, vp,
    slots, gather, bias, scale, out)``: store k / v at ``slots``, attend over ``gather`` (the schemas
    in attention.cpp); ``rms_norm`` and ``silu_mul`` (norm_act.cpp)."""

    def __init__(self, ops):
        self.rope = ops.rope_into.default
        self.paged_attention = ops.paged_attention_into.default
        self.rms_norm = ops.rms_norm_into.default  # (x, weight * sqrt(d), d * eps, out)
        self.silu_mul = ops.silu_mul_into.default  # (gate, up, out)

    @staticmethod
    def compile(calls: list[Callable[[], None]]) -> list[Callable[[], None]]:
        """A bound step's calls with each run of operator calls as one C++ call (call_program.py)."""
        return compile_calls(calls)


def decode_kernels(model: nn.Module) -> DecodeKernels | None:
    """The C++ decode ops for ``model``, or None where they do not apply (not fp32 on CPU, or the
    kernels did not build: ``load_kernels`` warns once)."""
    p = model.norm.weight
    if p.device.type != "cpu" or p.dtype != torch.float32:
        return None
    ops = load_kernels()
    return DecodeKernels(ops) if ops is not None else None
