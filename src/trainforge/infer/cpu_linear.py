"""Float linears on the C++ GEMV (``trainforge_cpu.f32_linear``) for CPU inference.

A decode step's float linear multiplies 1-8 activation rows by a weight read once from
memory: a weight stream. ``f32_linear`` sums one weight row after another, each thread's
share of rows one sequential stream for the hardware prefetcher, and writes into the decode
workspace (``bind_into``), where the row-block ``bmm`` of ``RowBlockLinear`` (its base)
streamed less (docs/benchmarks-archive.md, "fp32 GEMV"). Above 8 rows (a prompt) the base's path runs.
Swapped in from outside by ``prepare_model`` when the C++ kernels build; same ``weight``
and name, so a tied output stays tied.

A prompt's product (more rows than the row-block path takes) runs on oneDNN's fp32 GEMM where
the CPU has AVX-512, reading the same weight (no packed copy): 1.07-1.31x MKL's at 512 rows of
the 90m model's shapes on Zen 4 at 1 and 2 threads (``bench/cpu_kernels.py``, prompt GEMM) (MKL does not take its AVX-512 kernels on
AMD CPUs). On an AMD CPU held to AVX2 too (Zen 4 with ATen, oneDNN and MKL held to AVX2, as
``bench/cpu_decode_peer.py --isa avx2`` runs a Zen 3): the 90m f32 512-token prefill, 8 paired
in-process runs each, went x1.05-1.07 faster (medians of two probes at 1 and 2 threads; spread 0.95-1.24). Elsewhere (an Intel
CPU without AVX-512) MKL's, as before: oneDNN was not measured there.

On AMD CPUs the products of 9-64 rows (a batched decode step, a short prompt) leave the row-block
``bmm`` and the MKL ``mm`` that ``f32_linear`` hands them to (``amd_small_rows``); oneDNN had beaten
both (the 90m model's five linear shapes at 2 threads on Zen 4: 32 rows 7.9 ms against MKL's 16.1
and the bmm's 13.9). Up to ``SMALL_GEMM_ROWS`` (48) rows they run the C++ small GEMM
(``trainforge_cpu.f32_gemm_into``, cpu_kernels/small_gemm.cpp: register tiles in the weights' own
layout, the next tile's weights prefetched), 49-64 rows oneDNN. All the 90m model's linears at 2
threads on Zen 4 (``bench/cpu_kernels.py --sections small_gemm``, paired medians), small GEMM
against oneDNN: 9 rows x1.24, 16 x1.26, 24 x1.36, 32 x1.27, 48 x1.16, 64 x1.06; held to AVX2 x1.29,
x1.21, x1.09, x1.06, x1.00, x0.96. Intel CPUs keep MKL / the bmm (not measured against either).
"""

from __future__ import annotations

import functools
from typing import Callable

import torch
from torch import nn

from trainforge.infer.weight_arena import place_weight
from trainforge.model.decode_workspace import LinearInto, RowBlockLinear

GEMV_ROWS = 8  # F32_MAX_M in blocks.cpp: the op's own GEMV limit
SMALL_GEMM_ROWS = 48  # past this oneDNN caught up with the small GEMM (module docstring)


@functools.cache
def onednn_prompt_gemm() -> bool:
    """Whether prompts' fp32 products take oneDNN's GEMM (module docstring): a fixed choice per
    CPU, so a prompt's logits do not depend on a timing."""
    capability = torch.backends.cpu.get_cpu_capability()
    return torch.backends.mkldnn.is_available() and (capability == "AVX512" or capability == "AVX2" and _amd_cpu())


@functools.cache
def amd_small_rows() -> bool:
    """Whether products of ``GEMV_ROWS`` + 1 to ``LinearInto.MAX_ROWS`` fp32 rows run the C++ small
    GEMM (to ``SMALL_GEMM_ROWS``) and oneDNN (above; module docstring): on an AMD CPU, where they
    were measured."""
    return onednn_prompt_gemm() and _amd_cpu()


def _onednn(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, w, None, "none", [], "")


def _onednn_into(x: torch.Tensor, w: torch.Tensor, out: torch.Tensor) -> None:
    out.copy_(_onednn(x, w))  # oneDNN's op has no out= form: one copy of a few hundred KiB


@functools.cache
def _amd_cpu() -> bool:
    """Whether /proc/cpuinfo names an AMD CPU (False where it cannot be read)."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            return next((line for line in f if line.startswith("vendor_id")), "").rstrip().endswith("AuthenticAMD")
    except OSError:
        return False


def to_weight_arena(p: torch.Tensor) -> None:
    """Move ``p``'s data into the weight arena (``infer/weight_arena.py``: huge pages, 64-byte
    aligned; ``bench/cpu_kernels.py``'s weight stream measures it). ``.data`` is swapped, so the
    module sharing the Parameter (a tied output) keeps sharing it; the old copy is freed."""
    p.data = place_weight(p.data.contiguous())


class GemvLinear(RowBlockLinear):
    """``RowBlockLinear`` whose products of at most ``GEMV_ROWS`` fp32 rows run the C++ GEMV."""

    @classmethod
    def of(cls, linear: nn.Linear, ops) -> GemvLinear:
        new = super().of(linear)
        to_weight_arena(new.weight)
        new._op, new._op_into = ops.f32_linear.default, ops.f32_linear_into.default
        new._gemm_into = ops.f32_gemm_into.default
        return new

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        k = self.in_features
        if x.dtype != torch.float32 or self.bias is not None \
                or (torch.is_grad_enabled() and self.weight.requires_grad):  # the ops have no backward
            return super().forward(x)
        m = x.numel() // k
        if m <= GEMV_ROWS:
            return self._op(x.reshape(m, k), self.weight).view(*x.shape[:-1], self.out_features)
        if m <= SMALL_GEMM_ROWS and amd_small_rows():
            out = x.new_empty(m, self.out_features)
            self._gemm_into(x.reshape(m, k), self.weight, out)
            return out.view(*x.shape[:-1], self.out_features)
        if onednn_prompt_gemm() if m > LinearInto.MAX_ROWS else amd_small_rows():
            return _onednn(x.reshape(m, k), self.weight).view(*x.shape[:-1], self.out_features)
        return super().forward(x)

    def bind_into(self, x: torch.Tensor, out: torch.Tensor) -> Callable[[], None]:
        """out = x W^T for these very tensors: the op itself, no Python frame between (decode step);
        a step of more than ``GEMV_ROWS`` rows on the small GEMM or oneDNN where they take it (module
        docstring)."""
        if x.shape[0] > GEMV_ROWS and amd_small_rows():
            if x.shape[0] <= SMALL_GEMM_ROWS:
                return functools.partial(self._gemm_into, x, self.weight, out)
            return functools.partial(_onednn_into, x, self.weight, out)
        return functools.partial(self._op_into, x, self.weight, out)
