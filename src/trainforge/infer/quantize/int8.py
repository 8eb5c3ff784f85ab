"""Int8 weights, one scale per output channel (symmetric, absmax / 127).

Stored form (what the offline transform writes to safetensors, beside each other):
``<layer>.weight`` int8 (N, K) and ``<layer>.scales`` fp32 (N,); W ~= weight * scales[:, None].

Kernels (``Int8Linear.kernel``; ``common.PREFERENCE`` holds the order per device):

- ``fbgemm`` (CPU): PyTorch's dynamic-quantised linear, ``torch.ops.quantized.linear_dynamic``
  on a prepacked per-channel qint8 weight. Activations are quantised per call (per tensor,
  7-bit range as ``torch.ao.nn.quantized.dynamic.Linear`` uses with fbgemm), int8 x int8 GEMM.
- ``int8pack`` (CPU, CUDA): ``torch.ops.aten._weight_int8pack_mm``, weight-only int8 with the
  activations kept in float (what gpt-fast calls on CPU).
- ``int8pack_bf16`` (CPU): the same op on bfloat16 activations, its fast path on CPU (fp32
  activations take a slow path there: 176 x 256 weight, 8 rows: ~4.7 ms fp32 vs ~22 us bf16,
  measured for the MoE experts, ``experts.py``).
- ``torchao`` (CUDA): torchao's int8 weight-only tensor subclass, when torchao is installed.
- ``reference``: dequantise to float on every call; exact, slow, works for any shape.

Measured, batch-1 y = x W^T with W 4096 x 4096 (ms per call, best of 5 interleaved rounds of
10 calls; ``common.measure_kernels``, run by ``bench/inference.py``), AMD EPYC (Zen 4) KVM
guest, 2 threads, torch 2.13.0+cpu, 2026-11-30, machine otherwise idle:

    fp32 F.linear          4.13 ms   (64 MB streamed from DRAM)
    fbgemm (dynamic int8)  0.26 ms   (16 MB: stays in the 32 MB LLC between calls, which flatters it)
    int8pack (fp32 x)      6.98 ms

and in a whole model (the 90M one of ``bench/inference.py``, batch-1 decode through the
engine): fp32 64 tok/s, fbgemm int8 169 tok/s. So the CPU default is ``fbgemm``. torchao 0.x's int8 weight-only path was ~10x slower than
fp32 on this CPU in the issue's measurement (its eager CPU fallback dequantises), and it is
not installed here; it stays first on CUDA, where its fused kernels are the fastest known
to us (gpt-fast's numbers), unmeasured here: this machine has no GPU.
"""

from __future__ import annotations

import warnings

import torch

from trainforge.infer.quantize.common import Kernel, QuantLinear, torchao_available, torchao_linear
from trainforge.quant_formats.int8 import dequantize_int8, quantize_int8

__all__ = ["Int8Linear", "dequantize_int8", "quantize_int8"]


class Int8Linear(QuantLinear):
    MODE = "int8"
    STORED = ("weight", "scales")

    def __init__(self, in_features: int, out_features: int, kernel: str = "auto", device=None):
        super().__init__(in_features, out_features, kernel)
        self.register_buffer("weight", torch.empty(out_features, in_features, dtype=torch.int8, device=device))
        self.register_buffer("scales", torch.empty(out_features, dtype=torch.float32, device=device))

    @classmethod
    def quantize(cls, w: torch.Tensor, kernel: str = "auto") -> "Int8Linear":
        q, scales = quantize_int8(w)
        return cls.from_stored({"weight": q, "scales": scales}, w.shape[1], w.shape[0], kernel=kernel)

    def dequantize(self) -> torch.Tensor:
        return dequantize_int8(self.weight, self.scales)

    def build_kernel(self, name: str) -> Kernel:
        q, scales = self.weight, self.scales
        if name == "fbgemm":
            with warnings.catch_warnings():  # quantized-tensor constructors warn of their future deprecation
                warnings.simplefilter("ignore")
                qw = torch._make_per_channel_quantized_tensor(
                    q.cpu(), scales.double().cpu(), torch.zeros(q.shape[0], dtype=torch.long), 0)
                packed = torch.ops.quantized.linear_prepack(qw, None)

            def fbgemm(x: torch.Tensor) -> torch.Tensor:
                return torch.ops.quantized.linear_dynamic(x.float().contiguous(), packed, True)
            return fbgemm
        if name == "int8pack":
            qc = q.contiguous()

            def int8pack(x: torch.Tensor) -> torch.Tensor:
                return torch.ops.aten._weight_int8pack_mm(x.contiguous(), qc, scales.to(x.dtype))
            return int8pack
        if name == "int8pack_bf16":
            qc, sb = q.contiguous(), scales.to(torch.bfloat16)

            def int8pack_bf16(x: torch.Tensor) -> torch.Tensor:
                return torch.ops.aten._weight_int8pack_mm(x.to(torch.bfloat16).contiguous(), qc, sb)
            return int8pack_bf16
        if name == "torchao":
            if not torchao_available():
                raise RuntimeError("the torchao int8 kernel needs torchao installed")
            from torchao import quantization as tq

            config = tq.Int8WeightOnlyConfig() if hasattr(tq, "Int8WeightOnlyConfig") else tq.int8_weight_only()
            lin = torchao_linear(self.dequantize().to(torch.bfloat16), config)
            return lambda x: lin(x.to(torch.bfloat16))
        if name == "reference":
            return self.reference_forward
        raise ValueError(f"int8 kernel {name!r}: use one of fbgemm, int8pack, int8pack_bf16, torchao, reference, auto")

    def supports(self, name: str) -> str | None:
        if name == "fbgemm" and self.weight.device.type != "cpu":
            return "fbgemm runs on CPU only"
        return None
