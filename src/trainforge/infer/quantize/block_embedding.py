"""A token embedding kept in Q8_0 / Q4_0 blocks (llama.cpp's layouts, ``blocks.py``'s stored form).

A lookup reads a handful of rows per step, so the table never needs to be float: only the rows
asked for are dequantised. A GGUF file's quantised ``token_embd.weight`` loads onto it byte for
byte (``gguf_loading.py``) instead of being decoded to a (V, dim) fp32 table, 4 / 7.1 times the
bytes of its Q8_0 / Q4_0 blocks (the 90m model's 25 MB fp32 table was most of the gap in the
issue's RSS bound).

Stored form, the same as a ``Q8_0Linear`` / ``Q4_0Linear`` of shape (V, dim):
``weight`` int8 (V, dim) or uint8 (V, dim/2) codes, ``scales`` fp16 (V, dim/32).
"""

from __future__ import annotations

import functools
from typing import Callable

import torch
from torch import nn

from trainforge.infer.cpu_kernels import load_kernels
from trainforge.infer.cpu_kernels.formats import BLOCK
from trainforge.infer.quantize.blocks import Q4_0Linear, Q8_0Linear

# The linears of the same stored form name its codes' dtype, codes per byte and format functions.
_LAYOUTS = {cls.MODE: cls for cls in (Q8_0Linear, Q4_0Linear)}
MODES = tuple(_LAYOUTS)


class BlockEmbedding(nn.Module):
    """``nn.Embedding``'s lookup over blocks: ``forward(tokens)`` -> rows (*tokens.shape, dim) in
    ``dtype``, equal to ``formats.dequantize_*`` of the stored form's rows."""

    def __init__(self, num_embeddings: int, embedding_dim: int, mode: str, dtype: torch.dtype = torch.float32,
                 device=None):
        super().__init__()
        if mode not in _LAYOUTS:
            raise ValueError(f"block embedding mode {mode!r}: use one of {MODES}")
        if embedding_dim % BLOCK:
            raise ValueError(f"{mode} embedding: dim {embedding_dim} is not a multiple of {BLOCK}")
        layout = _LAYOUTS[mode]
        per_byte, code_dtype = layout.CODES_PER_BYTE, layout.CODE_DTYPE
        self.mode, self.num_embeddings, self.embedding_dim, self.dtype = mode, num_embeddings, embedding_dim, dtype
        self.register_buffer("weight", torch.empty(num_embeddings, embedding_dim // per_byte, dtype=code_dtype,
                                                   device=device))
        self.register_buffer("scales", torch.empty(num_embeddings, embedding_dim // BLOCK, dtype=torch.float16,
                                                   device=device))

    @staticmethod
    def quantize_stored(w: torch.Tensor, mode: str) -> dict[str, torch.Tensor]:
        """A float (V, dim) table -> its stored form (``formats.quantize_*``)."""
        qs, d = _LAYOUTS[mode].QUANTIZE(w)
        return {"weight": qs, "scales": d}

    def dequantize(self) -> torch.Tensor:
        """The whole (V, dim) table in fp32 (tests, export)."""
        return _LAYOUTS[self.mode].DEQUANTIZE(self.weight, self.scales)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        flat = tokens.reshape(-1)
        rows = _LAYOUTS[self.mode].DEQUANTIZE(self.weight.index_select(0, flat), self.scales.index_select(0, flat))
        return rows.to(self.dtype).reshape(*tokens.shape, self.embedding_dim)

    def bind_gather(self, tokens: torch.Tensor, out: torch.Tensor) -> Callable[[], None]:
        """The decode step's form: a call that writes the rows of ``tokens`` (B,) into ``out``
        (B, dim), reading ``tokens`` when called, through buffers allocated here once (no
        allocation per step). The arithmetic of ``formats.dequantize_*`` (fp32 codes times the
        fp32 scale), so the rows are the same bits as ``forward``'s."""
        B, nb = tokens.shape[0], self.embedding_dim // BLOCK
        ops = load_kernels() if self.weight.device.type == "cpu" else None
        if ops is not None and out.dtype == torch.float32 and out.stride(-1) == 1 and tokens.is_contiguous():
            # One C++ op (blocks.cpp), same arithmetic: 8 small torch ops took ~0.1 ms of a 2.2 ms 90m q4_0 step.
            return functools.partial(ops.block_gather_into.default, self.weight, self.scales, tokens, out)
        codes = torch.empty(B, self.weight.shape[1], dtype=self.weight.dtype, device=self.weight.device)
        scales = torch.empty(B, nb, dtype=self.scales.dtype, device=self.scales.device)
        direct = out.dtype == torch.float32 and out.is_contiguous()
        # fp32, as formats.py computes: in out itself when it is fp32
        rows = out.view(B, nb, BLOCK) if direct else torch.empty(B, nb, BLOCK, device=out.device)
        p = functools.partial
        calls = [p(torch.index_select, self.weight, 0, tokens, out=codes),
                 p(torch.index_select, self.scales, 0, tokens, out=scales)]
        if self.mode == "q8_0":
            calls.append(p(rows.copy_, codes.view(B, nb, BLOCK)))
        else:  # byte j of a block: element j low nibble, element j + 16 high (formats.quantize_q4_0)
            packed, half = codes.view(B, nb, BLOCK // 2), torch.empty(B, nb, BLOCK // 2, dtype=torch.uint8,
                                                                       device=codes.device)
            calls += [p(torch.bitwise_and, packed, 0xF, out=half), p(rows[..., :BLOCK // 2].copy_, half),
                      p(torch.bitwise_right_shift, packed, 4, out=half), p(rows[..., BLOCK // 2:].copy_, half),
                      p(rows.sub_, 8.0)]
        calls.append(p(torch.mul, rows, scales.unsqueeze(-1), out=rows))
        if not direct:
            calls.append(p(out.copy_, rows.view(B, -1)))

        def gather() -> None:
            for call in calls:
                call()

        return gather

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, mode={self.mode}"
