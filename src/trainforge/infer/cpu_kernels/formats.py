"""Q8_0 / Q4_0 block formats (llama.cpp semantics) and plain PyTorch references.

Blocks are 32 values along K with one fp16 scale each, so GGUF tensors map onto these
layouts later without re-quantising.
"""

import numpy as np
import torch

BLOCK = 32


def _blocks(w: torch.Tensor) -> torch.Tensor:
    n, k = w.shape
    if k % BLOCK:
        raise ValueError(f"K={k} must be a multiple of {BLOCK}")
    return w.float().reshape(n, k // BLOCK, BLOCK)


def _absmax_blocks(b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Blocks (..., 32) -> (rounded codes in [-127, 127] as float, fp32 d = absmax / 127), the
    arithmetic of llama.cpp's Q8_0 and of the kernels' activation quantiser (x * (1/d), half to even)."""
    d = b.abs().amax(-1) / 127.0
    inv = torch.where(d > 0, 1.0 / d, torch.zeros_like(d))
    return torch.round(b * inv.unsqueeze(-1)).clamp(-127, 127), d


def quantize_q8_0(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(N, K) float -> qs int8 (N, K), d fp16 (N, K/32); value = qs * d."""
    q, d = _absmax_blocks(_blocks(w))
    return q.to(torch.int8).reshape(w.shape), d.half()


def quantize_q4_0(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(N, K) float -> qs uint8 (N, K/2), d fp16 (N, K/32); value = (q - 8) * d.

    d = max / -8 with max the signed value of largest magnitude (llama.cpp), and byte j of a
    block holds element j in its low nibble and element j + 16 in its high nibble.
    """
    b = _blocks(w)
    idx = b.abs().argmax(-1, keepdim=True)
    d = b.gather(-1, idx).squeeze(-1) / -8.0
    inv = torch.where(d != 0, 1.0 / d, torch.zeros_like(d))
    q = (torch.round(b * inv.unsqueeze(-1)) + 8).clamp(0, 15).to(torch.uint8)
    packed = q[..., :16] | (q[..., 16:] << 4)
    return packed.reshape(w.shape[0], -1), d.half()


def dequantize_q8_0(qs: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
    n, k = qs.shape
    return (qs.float().reshape(n, -1, BLOCK) * d.float().unsqueeze(-1)).reshape(n, k)


def dequantize_q4_0(qs: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
    n = qs.shape[0]
    p = qs.reshape(n, -1, BLOCK // 2)
    q = torch.cat([p & 0xF, p >> 4], dim=-1).float() - 8.0
    return (q * d.float().unsqueeze(-1)).reshape(n, -1)


def quantize_activations(x: torch.Tensor) -> torch.Tensor:
    """Per-32-block int8 round trip of x (M, K), the same arithmetic as the C++ kernels
    (d = absmax/127 in fp32, q = round(x * (1/d)), half to even), returned dequantised."""
    q, d = _absmax_blocks(_blocks(x))
    return (q * d.unsqueeze(-1)).reshape(x.shape)


# Rows per interleaved group of the kernels' weight layout (XR in blocks.cpp).
GROUP = 8


def pack_x8(qs: torch.Tensor, d: torch.Tensor, empty=torch.empty) -> tuple[torch.Tensor, torch.Tensor]:
    """The kernels' layout of Q8_0 / Q4_0 weights: (qs (N, K*bits/8), d (N, K/32)) ->
    (w (G, nb * 8 * bytes_per_block), s (G, nb * 8) fp16), G = ceil(N / 8), rows zero-padded;
    ``empty(shape, dtype=)`` allocates them (the weight arena: written in place, no second copy).

    For group g (rows 8g..8g+7) and block b, chunk c holds bytes 4c..4c+3 of each of the 8
    rows' block in turn (32 bytes), so one vector load gives a 32-bit lane per row
    (blocks.cpp explains why); the 8 rows' scales of a block lie side by side. Bytes are
    moved, never re-quantised: a GGUF file's blocks keep their values exactly."""
    nb = d.shape[1]
    return _interleave(qs, nb, empty), _lanes(d, empty)


def _padded(t: torch.Tensor) -> torch.Tensor:
    n = t.shape[0]
    g = -(-n // GROUP)
    if g * GROUP == n:
        return t
    if _host(t):
        return torch.from_numpy(np.concatenate([t.numpy(), np.zeros((g * GROUP - n, t.shape[1]), t.numpy().dtype)]))
    return torch.cat([t, t.new_zeros(g * GROUP - n, t.shape[1])])


def _host(*ts: torch.Tensor) -> bool:
    """Whether numpy can move these tensors' bytes (CPU, a numpy dtype): packing then runs no ATen
    op. A decode process runs no other permuted copy or cat, and torch's would map ~2 MiB of
    libtorch code into it (the 90m q4_0 GGUF; issue 24's memory bound, docs/benchmarks-archive.md)."""
    return all(t.device.type == "cpu" and t.dtype != torch.bfloat16 for t in ts)


def cat_rows(parts: list[torch.Tensor]) -> torch.Tensor:
    """``torch.cat(parts)`` along rows, through numpy where ``_host`` allows (fusing stored forms)."""
    if _host(*parts):
        return torch.from_numpy(np.concatenate([p.numpy() for p in parts]))
    return torch.cat(parts, dim=0)


def _interleave(qs: torch.Tensor, nb: int, empty) -> torch.Tensor:
    """Codes (N, nb * bytes_per_block) -> (G, nb * 8 * bytes_per_block) in 4-byte chunks per row (pack_x8)."""
    qs = _padded(qs)
    g, bpb = qs.shape[0] // GROUP, qs.shape[1] // nb
    w = empty((g, nb * GROUP * bpb), dtype=qs.dtype)
    if _host(qs, w):
        w.numpy().reshape(g, nb, bpb // 4, GROUP, 4)[...] = \
            qs.numpy().reshape(g, GROUP, nb, bpb // 4, 4).transpose(0, 2, 3, 1, 4)
    else:
        w.view(g, nb, bpb // 4, GROUP, 4).copy_(qs.reshape(g, GROUP, nb, bpb // 4, 4).permute(0, 2, 3, 1, 4))
    return w


def _lanes(t: torch.Tensor, empty) -> torch.Tensor:
    """Per-row values (N, C) -> (G, C * 8): for each column, the 8 rows of a group side by side."""
    t = _padded(t)
    g, c = t.shape[0] // GROUP, t.shape[1]
    out = empty((g, c * GROUP), dtype=t.dtype)
    if _host(t, out):
        out.numpy().reshape(g, c, GROUP)[...] = t.numpy().reshape(g, GROUP, c).transpose(0, 2, 1)
    else:
        out.view(g, c, GROUP).copy_(t.reshape(g, GROUP, c).permute(0, 2, 1))
    return out


def int4_codes_as_q4_0(packed: torch.Tensor) -> torch.Tensor:
    """``quantize.int4``'s nibbles (N, K/2: element 2i in byte i's high nibble, 2i + 1 in its low
    one) -> Q4_0's (byte j of a 32-value block: element j low, j + 16 high). Codes unchanged."""
    n = packed.shape[0]
    q = torch.stack((packed >> 4, packed & 15), dim=-1).reshape(n, -1, BLOCK)
    return (q[..., :16] | (q[..., 16:] << 4)).reshape(n, -1)


def pack_int4_x8(packed: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, empty=torch.empty
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The kernels' layout of ``quantize.int4`` weights (codes q, fp32 scale s and int8 zero point
    z per group; a weight is ((q - 8) - z) * s): the codes as ``pack_x8``'s Q4_0 blocks, and per
    group the 8 rows' scales (fp32) and zero codes z' = 8 + z (uint8, 0..15) side by side, so the
    kernel computes (q - z') * s with Q4_0's integer dots. -> (w, s (G, K/g * 8), z (G, K/g * 8))."""
    if zeros.dtype != torch.int8:
        raise ValueError("pack_int4_x8 takes int8 zero points (a pre-2026-12 fp32 zero has no integer code)")
    codes = int4_codes_as_q4_0(packed)
    w = _interleave(codes, codes.shape[1] // (BLOCK // 2), empty)
    return w, _lanes(scales.float(), empty), _lanes((zeros.to(torch.int16) + 8).to(torch.uint8), empty)
