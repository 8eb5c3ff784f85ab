"""Int4 weights in groups along the input dim (asymmetric min/max, configurable group size).

Stored form (safetensors, beside each other): ``<layer>.weight`` uint8 (N, K/2), two 4-bit
codes per byte (even k in the high nibble, the layout ``torch.ops.aten._convert_weight_to_int4pack``
takes on CUDA), ``<layer>.scales`` fp32 (N, K/group_size) and ``<layer>.zeros`` int8
(N, K/group_size): an integer zero point z in [-8, 7]. A code q in [0, 15] stands for
((q - 8) - z) * scale, computed as an exact small integer times the fp32 scale. That is
compressed-tensors' asymmetric int4 grid (signed codes q - 8, zero point z, ``(x_q - zp) *
scale``), so an exported directory decompresses to these weights bit for bit
(``quant_formats/compressed_tensors.py``), and QAT's fake quantisation (``train/qat.py``) calls the same two
functions. The group's range always contains 0 (min <= 0 <= max), which is what makes the zero
point an integer inside the code range.

Directories written before 2026-12-01 hold fp32 ``zeros`` in the value domain: q stands for
(q - 8) * scale + zero (gpt-fast's and torchao's convention, zero = min + 8 * scale). They keep
loading: ``dequantize_int4`` and the kernels read the zeros by dtype.

Kernels (``common.PREFERENCE`` holds the order per device):

- ``blocks`` (CPU): the C++ op ``torch.ops.trainforge_cpu.int4_linear`` (``cpu_kernels/``), Q4_0's
  integer kernel with a per-group zero: the codes are moved into Q4_0's interleaved blocks and
  a group's weight is (q - z') * s with z' = 8 + z (``formats.pack_int4_x8``), so each 32-value
  block's dot is sum(q * x_q) - z' * sum(x_q) in int32 on activations quantised to int8 per
  block, AVX-512 VNNI / AVX2 / scalar by the CPU's features. Needs int8 zero points (not a
  pre-2026-12 fp32 zero) and a group size that is a multiple of 32. Its ``_into`` form is what
  the decode step binds. It replaced ``int4pack_cpu`` as the CPU default: see the measurement
  below.
- ``int4pack_cpu`` (CPU): ``torch.ops.aten._weight_int4pack_mm_for_cpu`` on the tile layout of
  ``_convert_weight_to_int4pack_for_cpu``. Activations go in as bfloat16: the kernel has a fast
  path only for bf16 (fp32 activations took ~100 ms for 4096 x 4096, ~10x fp32 linear). Needs
  N % 16 == 0 and group_size in {32, 64, 128, 256}; other layers fall back to ``reference``.
- ``int4pack_cuda`` (CUDA): ``torch.ops.aten._weight_int4pack_mm`` (bf16), the gpt-fast kernel.
- ``torchao`` (CUDA): torchao's int4 weight-only tensor subclass, when torchao is installed
  (torchao's int4 failed on this CPU in the issue's measurement; CUDA only).
- ``reference``: dequantise to float on every call; exact, slow, any shape.

Measured, batch-1 y = x W^T with W 4096 x 4096, group 128 (ms per call, best of 5
interleaved rounds of 10 calls; ``common.measure_kernels``, run by ``bench/inference.py``),
AMD EPYC (Zen 4) KVM guest, 2 threads, torch 2.13.0+cpu, 2026-11-30, machine otherwise idle:

    fp32 F.linear               4.34 ms   (64 MB streamed from DRAM)
    int4pack_cpu (bf16 x)       0.47 ms   (8 MB: stays in the 32 MB LLC between calls)
    int4pack_cpu (fp32 x)       ~100 ms   (measured once, on a loaded machine: no fast path)

and in a whole model (the 90M one of ``bench/inference.py``, batch-1 decode through the
engine): fp32 64 tok/s, int4 245 tok/s. Unmeasured on CUDA here (no GPU on this machine).

``blocks`` against ``int4pack_cpu``, same measurement, group 128, an Emerald Rapids Xeon (KVM, 2
vCPUs), 2 threads, 2026-12-07, 7 rounds: AVX-512 0.81 vs 0.75 ms; with both held to AVX2
(``TRAINFORGE_CPU_ISA=avx2 ATEN_CPU_CAPABILITY=avx2``) 0.87 vs 1.53 ms. In the 90m model's decode
(``bench/inference.py``, x the plain fp32 loop): ``int4pack_cpu`` 5.06x with AVX-512 and 2.74x
with AVX2, ``blocks`` 4.96x and 4.73x (docs/benchmarks-archive.md, issue 24). So the CPU default is ``blocks``,
then ``int4pack_cpu`` for a layer it does not take.
"""

from __future__ import annotations

import torch

from trainforge.infer.cpu_kernels import load_kernels
from trainforge.infer.cpu_kernels.formats import pack_int4_x8
from trainforge.infer.quantize.blocks import blocks_unavailable
from trainforge.infer.quantize.common import Kernel, QuantLinear, torchao_available, torchao_linear
from trainforge.infer.weight_arena import empty_weight
from trainforge.quant_formats.int4 import dequantize_int4, quantize_int4, unpack_int4, value_zeros

__all__ = ["CPU_GROUP_SIZES", "Int4Linear", "dequantize_int4", "quantize_int4", "unpack_int4", "value_zeros"]

CPU_GROUP_SIZES = (32, 64, 128, 256)


class Int4Linear(QuantLinear):
    MODE = "int4"
    STORED = ("weight", "scales", "zeros")

    def __init__(self, in_features: int, out_features: int, kernel: str = "auto", group_size: int = 128,
                 device=None):
        super().__init__(in_features, out_features, kernel)
        self.group_size = group_size
        groups = in_features // group_size
        self.register_buffer("weight", torch.empty(out_features, in_features // 2, dtype=torch.uint8, device=device))
        self.register_buffer("scales", torch.empty(out_features, groups, dtype=torch.float32, device=device))
        self.register_buffer("zeros", torch.empty(out_features, groups, dtype=torch.int8, device=device))

    def _init_kwargs(self) -> dict:
        return {"kernel": self.kernel, "group_size": self.group_size}

    def _kernel_kwargs(self) -> dict:
        return {"group_size": self.group_size if self.group_size in CPU_GROUP_SIZES else 128}

    @classmethod
    def quantize(cls, w: torch.Tensor, kernel: str = "auto", group_size: int = 128) -> "Int4Linear":
        packed, scales, zeros = quantize_int4(w, group_size)
        return cls.from_stored({"weight": packed, "scales": scales, "zeros": zeros}, w.shape[1], w.shape[0],
                               kernel=kernel, group_size=group_size)

    def dequantize(self) -> torch.Tensor:
        return dequantize_int4(self.weight, self.scales, self.zeros)

    def _scales_and_zeros(self, dtype: torch.dtype) -> torch.Tensor:
        # (K/g, N, 2), the layout both aten int4pack kernels take.
        zeros = value_zeros(self.scales, self.zeros)
        return torch.stack((self.scales, zeros), dim=-1).transpose(0, 1).contiguous().to(dtype)

    def supports(self, name: str) -> str | None:
        if name == "blocks":
            if self.zeros.dtype != torch.int8:
                return "a pre-2026-12 fp32 zero point has no integer zero code"
            if self.group_size % 32 or self.in_features % self.group_size:
                return f"group_size {self.group_size} is not a multiple of 32 dividing in_features"
            return blocks_unavailable(self.weight.device)
        if name == "int4pack_cpu":
            if self.weight.device.type != "cpu":
                return "int4pack_cpu runs on CPU only"
            if self.out_features % 16:
                return f"out_features {self.out_features} is not a multiple of 16"
            if self.group_size not in CPU_GROUP_SIZES:
                return f"group_size {self.group_size} not in {CPU_GROUP_SIZES}"
        if name == "int4pack_cuda" and (self.out_features % 8 or self.in_features % 128):
            return "int4pack_cuda wants out_features % 8 == 0 and in_features % 128 == 0"
        return None

    def build_kernel(self, name: str) -> Kernel:
        gs = self.group_size
        self._into = None
        if name == "blocks":
            ops = load_kernels()
            w, s, z = pack_int4_x8(self.weight, self.scales, self.zeros, empty=empty_weight)
            n = self.out_features
            self._into = (ops.int4_linear_into.default, w, s, z, gs)
            return lambda x: ops.int4_linear(x.float().contiguous(), w, s, z, gs, n)
        if name == "int4pack_cpu":
            w = torch.ops.aten._convert_weight_to_int4pack_for_cpu(unpack_int4(self.weight), 2)
            sz = self._scales_and_zeros(torch.bfloat16)
            return lambda x: torch.ops.aten._weight_int4pack_mm_for_cpu(x.to(torch.bfloat16), w, gs, sz)
        if name == "int4pack_cuda":
            w = torch.ops.aten._convert_weight_to_int4pack(self.weight.contiguous(), 8)
            sz = self._scales_and_zeros(torch.bfloat16)
            return lambda x: torch.ops.aten._weight_int4pack_mm(x.to(torch.bfloat16), w, gs, sz)
        if name == "torchao":
            if not torchao_available():
                raise RuntimeError("the torchao int4 kernel needs torchao installed")
            from torchao import quantization as tq

            config = tq.Int4WeightOnlyConfig(group_size=gs) if hasattr(tq, "Int4WeightOnlyConfig") \
                else tq.int4_weight_only(group_size=gs)
            lin = torchao_linear(self.dequantize().to(torch.bfloat16), config)
            return lambda x: lin(x.to(torch.bfloat16))
        if name == "reference":
            return self.reference_forward
        raise ValueError(f"int4 kernel {name!r}: use one of blocks, int4pack_cpu, int4pack_cuda, torchao, reference, "
                         "auto")
