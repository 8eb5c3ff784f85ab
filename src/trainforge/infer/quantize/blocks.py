"""Q8_0 / Q4_0 weights: 32-value blocks along the input dim, one fp16 scale each (llama.cpp's layouts).

Stored form (safetensors, beside each other; the layouts of ``cpu_kernels/formats.py``):

- ``q8_0``: ``<layer>.weight`` int8 (N, K), ``<layer>.scales`` fp16 (N, K/32); W = q * d.
- ``q4_0``: ``<layer>.weight`` uint8 (N, K/2), ``<layer>.scales`` fp16 (N, K/32); W = (q - 8) * d,
  byte j of a block holding element j in its low nibble and element j + 16 in its high one.

These are a GGUF file's Q8_0 / Q4_0 blocks with the scale split out, so a GGUF checkpoint loads
onto them byte for byte (``gguf_loading.py``). Packing for the C++ kernel moves the bytes into
groups of 8 interleaved rows (``formats.pack_x8``) and drops the stored form: the process holds
the weights once, at 1.06 / 0.56 bytes a value.

Kernels (``common.PREFERENCE``):

- ``blocks`` (CPU): the C++ ops ``torch.ops.trainforge_cpu.q8_0_linear`` / ``q4_0_linear``
  (``cpu_kernels/``: activations quantised to int8 per block on the fly, integer dot products on
  AVX-512 VNNI / AVX2 / scalar, chosen by the CPU's features), built on first use, with
  ``_into`` forms the decode step writes through.
- ``dequant``: dequantise once at pack time and run the fp32 model's matmul (``RowBlockLinear``):
  the fallback where the C++ ops cannot be built (one line says so) and the path on CUDA; it gives
  up the memory saving.
- ``reference``: dequantise on every call; exact, slow.
"""

from __future__ import annotations

import torch
from torch import nn

from trainforge.infer.cpu_kernels import load_kernels
from trainforge.infer.cpu_kernels.formats import (BLOCK, dequantize_q4_0, dequantize_q8_0, pack_x8,
                                                  quantize_q4_0, quantize_q8_0)
from trainforge.infer.quantize.common import Kernel, QuantLinear
from trainforge.infer.weight_arena import empty_weight
from trainforge.model.decode_workspace import LinearInto, RowBlockLinear


def blocks_unavailable(device: torch.device) -> str | None:
    """Why the C++ block kernels cannot run a layer on ``device``, or None."""
    if device.type != "cpu":
        return "the block kernels run on CPU only"
    if load_kernels() is None:  # warns once, with the reason
        return "the C++ block kernels are unavailable"
    return None


class _BlockLinear(QuantLinear):
    """What Q8_0 and Q4_0 share; subclasses name the codes' shape and the kernel op."""

    STORED = ("weight", "scales")
    CODES_PER_BYTE = 1
    CODE_DTYPE = torch.int8
    OP = ""
    QUANTIZE = DEQUANTIZE = None  # formats.py's functions for the layout

    def __init__(self, in_features: int, out_features: int, kernel: str = "auto", device=None):
        super().__init__(in_features, out_features, kernel)
        if in_features % BLOCK:
            raise ValueError(f"{self.MODE}: in_features {in_features} is not a multiple of {BLOCK}")
        self.register_buffer("weight", torch.empty(out_features, in_features // self.CODES_PER_BYTE,
                                                   dtype=self.CODE_DTYPE, device=device))
        self.register_buffer("scales", torch.empty(out_features, in_features // BLOCK, dtype=torch.float16,
                                                   device=device))

    @staticmethod
    def skip_reason(in_features: int) -> str | None:
        return None if in_features % BLOCK == 0 else f"in_features {in_features} is not a multiple of {BLOCK}"

    @classmethod
    def quantize_stored(cls, w: torch.Tensor) -> dict[str, torch.Tensor]:
        qs, d = cls.QUANTIZE(w)
        return {"weight": qs, "scales": d}

    def dequantize(self) -> torch.Tensor:
        return type(self).DEQUANTIZE(self.weight, self.scales)

    @classmethod
    def probe_layer(cls, device: torch.device, **kw) -> "_BlockLinear":
        """Zero codes and scales, stored as a file's would be: probing a kernel runs no quantiser,
        whose ops a GGUF or pre-quantised load never needs (their code is resident once run:
        ~1 MiB of libtorch_cpu, issue 24)."""
        n, k = 64, 256
        stored = {"weight": torch.zeros(n, k // cls.CODES_PER_BYTE, dtype=cls.CODE_DTYPE, device=device),
                  "scales": torch.zeros(n, k // BLOCK, dtype=torch.float16, device=device)}
        return cls.from_stored(stored, k, n, **kw)

    @classmethod
    def quantize(cls, w: torch.Tensor, kernel: str = "auto") -> "_BlockLinear":
        return cls.from_stored(cls.quantize_stored(w.detach()), w.shape[1], w.shape[0], kernel=kernel)

    def forward_into(self, x: torch.Tensor, out: torch.Tensor) -> None:
        self.bind_into(x, out)()

    def bind_into(self, x: torch.Tensor, out: torch.Tensor):
        if self._impl is None:
            self.pack()
        if self.kernel_name == "dequant" and out.is_contiguous() and x.dtype == torch.float32:
            # The decode step's out= form of the float matmul; scratch for its few-row split.
            return self._dequant.bind(x, out, torch.empty(out.numel(), dtype=out.dtype, device=out.device))
        return super().bind_into(x, out)

    def supports(self, name: str) -> str | None:
        return blocks_unavailable(self.weight.device) if name == "blocks" else None

    def build_kernel(self, name: str) -> Kernel:
        if name == "blocks":
            ops = load_kernels()
            op, op_into = getattr(ops, self.OP), getattr(ops, self.OP + "_into")
            # The kernel's interleaved layout (pack_x8 moves bytes): pack() then drops the stored
            # buffers, so the closures hold the only copy.
            w, s = pack_x8(self.weight, self.scales, empty=empty_weight)  # in huge pages: weight_arena.py
            n = self.out_features
            self._into = (op_into.default, w, s)
            return lambda x: op(x.float().contiguous(), w, s, n)
        self._into = None
        if name == "dequant":
            # The fp32 model's own matmul on the dequantised weight (RowBlockLinear: rows split over
            # the threads), not F.linear: MKL's batch-1 GEMV is the slower one on AMD CPUs, and this
            # is the path every q8_0 / q4_0 / GGUF load takes where the C++ ops do not build
            # (docs/benchmarks-archive.md, "Without a C++ compiler").
            linear = nn.Linear(self.in_features, self.out_features, bias=False, device="meta")
            linear.weight = nn.Parameter(self.dequantize(), requires_grad=False)
            self._dequant = LinearInto(RowBlockLinear.of(linear), torch.get_num_threads(), None)
            return lambda x: self._dequant.mod(x.float())
        if name == "reference":
            return self.reference_forward
        raise ValueError(f"{self.MODE} kernel {name!r}: use one of blocks, dequant, reference, auto")


class Q8_0Linear(_BlockLinear):
    MODE = "q8_0"
    OP = "q8_0_linear"
    QUANTIZE, DEQUANTIZE = staticmethod(quantize_q8_0), staticmethod(dequantize_q8_0)


class Q4_0Linear(_BlockLinear):
    MODE = "q4_0"
    OP = "q4_0_linear"
    CODES_PER_BYTE = 2
    CODE_DTYPE = torch.uint8
    QUANTIZE, DEQUANTIZE = staticmethod(quantize_q4_0), staticmethod(dequantize_q4_0)
