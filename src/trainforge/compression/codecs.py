"""Gradient codecs: pure tensor functions, no communication.

Every codec turns rows of fp32 values into rows of bytes of a size fixed by the
row length alone, so a collective can exchange them with equal splits and no size
handshake:

- ``NoCodec``: the fp32 bytes themselves (full precision through the same path).
- ``BlockQuantCodec``: per-block absmax quantisation to int8 (codes in [-127, 127])
  or int4 (codes in [-7, 7], two per byte). One fp32 scale per block of
  ``block_size`` values; optional stochastic rounding (unbiased, error <= one step).
- ``TopKCodec``: keep the ``ratio`` largest-magnitude values of each row (int32
  indices + values), optionally with the kept values block-quantised.

Layout of an encoded row (all parts 4-byte aligned, so slices can be viewed as
fp32/int32 without copies): quant ``[scales fp32 x blocks | codes]``;
top-k ``[indices int32 x k | values]``. Rows are padded to a multiple of 4 bytes.

Hand-written: torch has no block-wise gradient codec (torchao's are for weights,
and its int4 kernels fail on CPU).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


def _pad4(n: int) -> int:
    return (n + 3) // 4 * 4


def check_finite(x: torch.Tensor, what: str = "gradient") -> None:
    """Raise a clear error for inf/nan input (quantisation has no code for them)."""
    if not bool(torch.isfinite(x).all()):
        bad = int((~torch.isfinite(x)).sum())
        raise ValueError(f"{what} holds {bad} non-finite value(s) (inf/nan): it cannot be quantised. "
                         "Find the cause (learning rate, loss scale, data), or let the trainer skip "
                         "non-finite steps")


@dataclass(frozen=True)
class NoCodec:
    """fp32 as is: what an uncompressed all-reduce sends."""

    name: str = "none"
    bits: float = 32.0

    def nbytes(self, numel: int) -> int:
        return 4 * numel

    def encode_rows(self, x: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
        return x.float().contiguous().view(torch.uint8).reshape(x.shape[0], -1)

    def decode_rows(self, buf: torch.Tensor, numel: int) -> torch.Tensor:
        return buf.contiguous().view(torch.float32).reshape(buf.shape[0], numel)


@dataclass(frozen=True)
class BlockQuantCodec:
    """Per-block absmax int8/int4. Deterministic rounding: |x - decode(encode(x))| <=
    absmax(block) / (2 * qmax) per element; stochastic: < absmax(block) / qmax, unbiased.
    Blocks with absmax < qmax x 1.2e-38 (a subnormal scale) may lose that precision, down
    to flushing to zero: an error below 1.5e-36, far under any gradient that matters."""

    bits: int = 8
    block_size: int = 256
    stochastic: bool = False

    def __post_init__(self):
        if self.bits not in (4, 8):
            raise ValueError(f"quantised codec bits = {self.bits}: only 4 and 8 are implemented")
        if self.block_size < 2 or self.block_size % 2:
            raise ValueError(f"block_size = {self.block_size}: must be an even number >= 2")

    @property
    def name(self) -> str:
        return f"int{self.bits}"

    @property
    def qmax(self) -> int:
        return 2 ** (self.bits - 1) - 1  # symmetric: 127 or 7

    def blocks(self, numel: int) -> int:
        return math.ceil(numel / self.block_size)

    def code_bytes(self, numel: int) -> int:
        padded = self.blocks(numel) * self.block_size
        return padded if self.bits == 8 else padded // 2

    def nbytes(self, numel: int) -> int:
        return _pad4(4 * self.blocks(numel) + self.code_bytes(numel))

    def quantize(self, x: torch.Tensor, generator: torch.Generator | None = None
                 ) -> tuple[torch.Tensor, torch.Tensor]:
        """(rows, numel) fp32 -> (codes int8 (rows, blocks, block_size), scales fp32 (rows, blocks)).
        A block holding inf/nan gets a nan scale, so it decodes to nan (never to garbage)."""
        rows, numel = x.shape
        nb = self.blocks(numel)
        pad = nb * self.block_size - numel
        xb = torch.nn.functional.pad(x.float(), (0, pad)).reshape(rows, nb, self.block_size)
        absmax = xb.abs().amax(dim=-1)  # (rows, blocks)
        scales = absmax / self.qmax
        scales = torch.where(torch.isfinite(scales), scales, torch.full_like(scales, float("nan")))
        # An all-zero block has scale 0: divide by 1 instead, its codes are 0 either way.
        y = xb / torch.where(scales > 0, scales, torch.ones_like(scales)).unsqueeze(-1)
        if self.stochastic:
            noise = torch.rand(y.shape, generator=generator, device=y.device, dtype=y.dtype)
            y = torch.floor(y + noise)
        else:
            y = torch.round(y)
        codes = y.clamp_(-self.qmax, self.qmax).nan_to_num_(0.0).to(torch.int8)
        return codes, scales

    def dequantize(self, codes: torch.Tensor, scales: torch.Tensor, numel: int) -> torch.Tensor:
        rows = codes.shape[0]
        return (codes.float() * scales.unsqueeze(-1)).reshape(rows, -1)[:, :numel]

    def encode_rows(self, x: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
        rows, numel = x.shape
        codes, scales = self.quantize(x, generator)
        codes = codes.reshape(rows, -1)
        if self.bits == 4:
            u = (codes + 8).to(torch.uint8)  # 1..15, two per byte
            codes_u8 = u[:, 0::2] | (u[:, 1::2] << 4)
        else:
            codes_u8 = codes.view(torch.uint8)
        out = torch.zeros(rows, self.nbytes(numel), dtype=torch.uint8, device=x.device)
        nb = scales.shape[1]
        out[:, :4 * nb] = scales.contiguous().view(torch.uint8)
        out[:, 4 * nb:4 * nb + codes_u8.shape[1]] = codes_u8
        return out

    def decode_rows(self, buf: torch.Tensor, numel: int) -> torch.Tensor:
        rows = buf.shape[0]
        nb = self.blocks(numel)
        scales = buf[:, :4 * nb].contiguous().view(torch.float32)
        raw = buf[:, 4 * nb:4 * nb + self.code_bytes(numel)]
        if self.bits == 4:
            lo = (raw & 0x0F).to(torch.int8) - 8
            hi = (raw >> 4).to(torch.int8) - 8
            codes = torch.stack((lo, hi), dim=-1).reshape(rows, -1)
        else:
            codes = raw.contiguous().view(torch.int8)
        return self.dequantize(codes.reshape(rows, nb, self.block_size), scales, numel)


@dataclass(frozen=True)
class TopKCodec:
    """Keep the ``ceil(ratio * numel)`` largest |values| per row; the rest decode to 0.
    With ``values`` set, the kept values are block-quantised too (top-k + int4)."""

    ratio: float = 0.01
    values: BlockQuantCodec | None = None

    def __post_init__(self):
        if not 0.0 < self.ratio <= 1.0:
            raise ValueError(f"top-k ratio = {self.ratio}: must be in (0, 1]")

    @property
    def name(self) -> str:
        return "topk" if self.values is None else f"topk+{self.values.name}"

    @property
    def bits(self) -> float:
        per_kept = 32 + (32 if self.values is None else self.values.bits)
        return per_kept * self.ratio

    def k(self, numel: int) -> int:
        return max(1, min(numel, math.ceil(self.ratio * numel)))

    def _value_bytes(self, k: int) -> int:
        return 4 * k if self.values is None else self.values.nbytes(k)

    def nbytes(self, numel: int) -> int:
        k = self.k(numel)
        return 4 * k + self._value_bytes(k)

    def sparsify(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(rows, numel) -> (values (rows, k), int64 indices (rows, k)). nan counts as largest,
        so a non-finite gradient is sent, not silently dropped."""
        k = self.k(x.shape[1])
        mag = torch.nan_to_num(x.abs(), nan=float("inf"))
        idx = torch.topk(mag, k, dim=1, sorted=False).indices
        return x.gather(1, idx), idx

    def encode_rows(self, x: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
        rows, numel = x.shape
        vals, idx = self.sparsify(x.float())
        k = vals.shape[1]
        out = torch.empty(rows, self.nbytes(numel), dtype=torch.uint8, device=x.device)
        out[:, :4 * k] = idx.to(torch.int32).view(torch.uint8)
        enc = vals.contiguous().view(torch.uint8) if self.values is None else self.values.encode_rows(vals, generator)
        out[:, 4 * k:] = enc
        return out

    def decode_rows(self, buf: torch.Tensor, numel: int) -> torch.Tensor:
        rows = buf.shape[0]
        k = self.k(numel)
        idx = buf[:, :4 * k].contiguous().view(torch.int32).long()
        raw = buf[:, 4 * k:]
        vals = raw.contiguous().view(torch.float32) if self.values is None else self.values.decode_rows(raw, k)
        out = torch.zeros(rows, numel, dtype=torch.float32, device=buf.device)
        return out.scatter_(1, idx, vals)


Codec = NoCodec | BlockQuantCodec | TopKCodec


def encode(codec: Codec, x: torch.Tensor, generator: torch.Generator | None = None,
           allow_nonfinite: bool = False) -> torch.Tensor:
    """One 1-D tensor -> its bytes. Rejects inf/nan unless ``allow_nonfinite`` (the comm
    hooks allow them so a bad step reaches the trainer's non-finite check as nan)."""
    if not allow_nonfinite:
        check_finite(x)
    return codec.encode_rows(x.reshape(1, -1), generator)[0]


def decode(codec: Codec, buf: torch.Tensor, numel: int) -> torch.Tensor:
    return codec.decode_rows(buf.reshape(1, -1), numel)[0]


def make_codec(name: str, block_size: int = 256, bits: int | None = None, topk_ratio: float = 0.01,
               stochastic: bool = False) -> Codec:
    """Codec by config name: none, int8, int4, topk, topk+int4 (``bits`` overrides intN)."""
    if name == "none":
        return NoCodec()
    if name in ("int8", "int4"):
        return BlockQuantCodec(bits or int(name[3:]), block_size, stochastic)
    if name == "topk":
        return TopKCodec(topk_ratio)
    if name in ("topk+int4", "topk+int8"):
        return TopKCodec(topk_ratio, BlockQuantCodec(int(name[-1]), min(block_size, 64), stochastic))
    raise ValueError(f"unknown codec {name!r}: use none, int8, int4, topk or topk+int4")
