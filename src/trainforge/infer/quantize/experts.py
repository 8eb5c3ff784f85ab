"""Quantised routed experts: what the int8 and int4 kinds of ``GroupedExperts`` share.

A ``QuantExperts`` replaces a MoE layer's ``GroupedExperts`` (``model/moe.py``) and keeps its
forward contract, ``forward(x, counts)`` with x (M, dim) sorted by expert and ``counts`` (n,)
tokens per expert, so ``MoE.forward`` (routing, weighting, combine, shared experts) stays
the only definition of the math. Each expert's projection is quantised exactly as a linear
of the same kind would be (``Int8Linear`` / ``Int4Linear``): the stored form stacks the
per-expert tensors along a leading expert dim, ``w1`` / ``w1_scales`` (/ ``w1_zeros``), and
so on for ``w2`` and ``w3``, under the module's name in the safetensors file.

``pack`` builds one packed linear of that kind per expert and projection (the linear
kinds' kernels, unchanged) and the forward runs only the experts that received tokens, on
their contiguous slices: a decode step of B rows touches at most B x top-k experts.

Kernels, per expert slice, measured on the moe-tiny experts (16 x (176 x 256), top-4) on this
CPU at 1 thread (ms per experts call for M routed rows; shared 2-core machine, best of 5,
two runs' ranges):

    M rows               4            32          512
    fp32 grouped   0.25-0.33   1.27-2.19   3.9-4.7   (GroupedExperts, torch._grouped_mm)
    int8pack_bf16  0.21-0.26   1.10-1.83   5.3-5.7   (the int8 CPU default)
    fbgemm int8    0.44-0.66   2.50-3.25   4.0-5.1
    int4pack_cpu   0.25-0.31   1.30-1.82   5.4-6.2   (bf16 activations)

``int8pack`` on fp32 activations takes a slow path for more than one row (8 rows of one
expert: ~4.7 ms), hence ``int8pack_bf16``; fbgemm also quantises the activations (7-bit per
tensor), bf16 only rounds them. The forward calls the kernels straight and keeps their
bf16 output until the result (the casts back to fp32 between the projections cost more
than the matmuls at decode sizes). The experts are L2-sized here, so quantising them buys
memory and a little decode speed; a long prompt's prefill (M in the hundreds) is faster
with the fp32 grouped GEMM.

The router is never quantised (``quantize.linear_names`` leaves ``*.router.gate`` out and
loading keeps it fp32): top-k selection over near-tied scores flips under weight
rounding, and a flipped expert changes the token's whole feed-forward, not one logit digit.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from trainforge.infer.quantize.common import QuantLinear, choose_kernel
from trainforge.quant_formats.layers import expert_buffer_name

PROJECTIONS = ("w1", "w2", "w3")


class QuantExperts(nn.Module):
    """``n`` quantised SwiGLU experts, ``GroupedExperts``' forward contract. Subclasses set
    ``MODE`` and ``LINEAR`` (the quantised linear kind whose stored form and kernels each
    expert projection uses) and may pad the hidden dim (``padded_hidden``)."""

    MODE = ""
    LINEAR: type[QuantLinear] = QuantLinear
    DEFAULT_KERNEL: dict[str, str] = {}  # device type -> kernel for "auto"
    _KINDS: dict[str, type[QuantExperts]] = {}  # MODE -> subclass, filled as subclasses are defined

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        if cls.MODE:
            QuantExperts._KINDS[cls.MODE] = cls

    def __init__(self, n: int, dim: int, hidden: int, kernel: str = "auto", device=None, **kw):
        super().__init__()
        self.n, self.dim, self.hidden = n, dim, hidden
        self.kernel, self.kw = kernel, kw
        self.hidden_stored = self.padded_hidden(hidden, **kw)
        self.kernel_name: str | None = None  # after pack()
        self.weight_bytes = 0
        self._experts: list[tuple[QuantLinear, ...]] | None = None  # per expert: (w1, w2, w3), packed
        self._kernels: list[tuple[Callable, ...]] = []  # their kernels: (M, K) -> (M, N), in the kernel's dtype
        for p in PROJECTIONS:
            out_f, in_f = self.shape(p)
            like = self.LINEAR(in_f, out_f, kernel=kernel, device="meta", **kw)
            for s in self.LINEAR.STORED:
                t = getattr(like, s)
                self.register_buffer(self.buffer_name(p, s), torch.empty(n, *t.shape, dtype=t.dtype, device=device))

    # -- shapes and names -------------------------------------------------------------------

    @classmethod
    def padded_hidden(cls, hidden: int, **kw) -> int:
        return hidden

    @classmethod
    def skip_reason(cls, dim: int, hidden: int, **kw) -> str | None:
        """Why experts of this shape stay float (None: they can be quantised)."""
        return None

    def shape(self, p: str) -> tuple[int, int]:
        """(out, in) of projection ``p`` in the stored form (hidden padded)."""
        return (self.dim, self.hidden_stored) if p == "w2" else (self.hidden_stored, self.dim)

    buffer_name = staticmethod(expert_buffer_name)

    # -- offline: float weights -> stored form ----------------------------------------------

    @classmethod
    def quantize_stored(cls, w1: torch.Tensor, w2: torch.Tensor, w3: torch.Tensor, **kw) -> dict[str, torch.Tensor]:
        """GroupedExperts' float w1, w3 (n, hidden, dim), w2 (n, dim, hidden) -> stored
        tensors by buffer name. A padded hidden dim gets zero rows in w1, w3 and zero
        columns in w2: silu(0) * 0 = 0, so the padding adds exactly nothing."""
        n, hidden, dim = w1.shape
        pad = cls.padded_hidden(hidden, **kw) - hidden
        w = {"w1": F.pad(w1.detach().float(), (0, 0, 0, pad)), "w3": F.pad(w3.detach().float(), (0, 0, 0, pad)),
             "w2": F.pad(w2.detach().float(), (0, pad))}
        out = {}
        for p in PROJECTIONS:
            rows, cols = w[p].shape[1:]
            # Per-row (int8) and per-row-group (int4) quantisation: the experts' rows stacked.
            lin = cls.LINEAR.quantize(w[p].reshape(n * rows, cols), kernel="reference", **kw)
            for s, t in lin.stored().items():
                out[cls.buffer_name(p, s)] = t.reshape(n, rows, *t.shape[1:])
        return out

    def stored(self) -> dict[str, torch.Tensor]:
        if self._experts is not None and self.kernel_name != "reference":
            raise RuntimeError(f"{type(self).__name__} is packed for the {self.kernel_name} kernel; its stored "
                               "tensors were released (quantise the state dict offline to keep them)")
        return {name: buf for name, buf in self.named_buffers(recurse=False)}

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        self.stored()  # raises when packed
        super()._save_to_state_dict(destination, prefix, keep_vars)

    def _linear(self, p: str, e: int | None, kernel: str) -> QuantLinear:
        """Projection ``p`` of expert ``e`` (None: every expert's rows stacked) as a stored-form linear."""
        out_f, in_f = self.shape(p)
        tensors = {s: getattr(self, self.buffer_name(p, s)) for s in self.LINEAR.STORED}
        if e is None:
            tensors, out_f = {s: t.flatten(0, 1) for s, t in tensors.items()}, self.n * out_f
        else:
            tensors = {s: t[e] for s, t in tensors.items()}
        return self.LINEAR.from_stored(tensors, in_f, out_f, kernel=kernel, **self.kw)

    def dequantize(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The float (fp32) w1, w2, w3 these experts stand for, in GroupedExperts' shapes."""
        w = {}
        for p in PROJECTIONS:
            out_f, in_f = self.shape(p)
            w[p] = self._linear(p, None, "reference").dequantize().view(self.n, out_f, in_f)
        h = self.hidden
        return w["w1"][:, :h], w["w2"][:, :, :h], w["w3"][:, :h]

    # -- runtime ----------------------------------------------------------------------------

    def pack(self, kernel: str | None = None) -> str:
        """Build every expert's packed projections (``kernel`` overrides ``self.kernel``;
        "auto" = ``DEFAULT_KERNEL`` for the device, "measure" = ``choose_kernel``'s measurement)
        and release the stored tensors. Returns the kernel used (a projection shape the kernel
        refuses falls back to "reference", as the linears do)."""
        if self._experts is not None:
            return self.kernel_name
        name = kernel or self.kernel
        device = self.w1.device
        if name == "auto":
            name = self.DEFAULT_KERNEL.get(device.type, "reference")
        elif name == "measure":
            name = choose_kernel(self.MODE, device, measure=True, **self.LINEAR(16, 16, device="meta", **self.kw)
                                 ._kernel_kwargs())
        self.weight_bytes = sum(t.nbytes for t in self.stored().values())
        experts, used = [], set()
        for e in range(self.n):
            lins = tuple(self._linear(p, e, name) for p in PROJECTIONS)
            used.update(lin.pack(name) for lin in lins)
            experts.append(lins)
        self._experts = experts
        self._kernels = [tuple(lin._impl for lin in lins) for lins in experts]
        self.kernel_name = name if used == {name} else "+".join(sorted(used))
        if self.kernel_name != "reference":
            for buf, _ in list(self.named_buffers(recurse=False)):  # the packed linears own the weights now
                setattr(self, buf, torch.empty(0, device=device))
        return self.kernel_name

    def forward(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        if self._experts is None:
            self.pack()
        out = x.new_empty(x.shape)
        start = 0
        for e, c in enumerate(counts.tolist()):
            if c:  # experts without tokens cost nothing
                # The kernels straight (x is (M, dim) already): their output stays in the kernel's
                # dtype (bf16 for the CPU kernels, which round w2's input to bf16 anyway) up to `out`.
                w1, w2, w3 = self._kernels[e]
                xs = x[start:start + c]
                out[start:start + c] = w2(F.silu(w1(xs)) * w3(xs))
                start += c
        return out

    def extra_repr(self) -> str:
        return f"n={self.n}, dim={self.dim}, hidden={self.hidden}, kernel={self.kernel_name or self.kernel}"
