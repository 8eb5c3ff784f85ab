"""Compressed all-reduce: quantised reduce-scatter, then quantised all-gather.

Summing quantised codes is wrong (each rank has its own scales), and all-gathering
every rank's whole compressed gradient makes each rank receive (n-1) x size. So,
like a ring all-reduce, the reduction is split in two halves, each on compressed bytes:

1. reduce-scatter: every rank encodes its gradient as n row-chunks and sends chunk j
   to rank j (``all_to_all_single``); rank j decodes the n chunks it received and
   averages them in fp32 -> its chunk of the mean.
2. all-gather: every rank encodes its averaged chunk once and ``all_gather_single``s
   it; every rank decodes all n chunks -> the full mean, bit-identical on every rank
   (all decode the same bytes; a rank's own fp32 chunk is discarded for that reason).

Bytes each rank sends: (n-1) x row bytes in each half, i.e. about
2 (n-1)/n x size x bits/32 of an fp32 ring all-reduce's 2 (n-1)/n x size x 4 bytes,
for any n. Both halves use error feedback when enabled (a residual for the rank's
whole input and one for its averaged chunk). Each rank's (error^2, norm^2) of half 1
rides along in its all-gather row (8 bytes), so all ranks see the same global
compression error without another collective.

Collectives run blocking in the caller: with gloo, a collective launched from a
future's callback hangs once DDP has more than one bucket.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist

from trainforge.compression.codecs import Codec
from trainforge.compression.error_feedback import ErrorFeedback

STATS_BYTES = 8  # two fp32: this rank's half-1 error^2 and input norm^2


@dataclass
class ReduceInfo:
    bytes_sent: int
    fp32_ring_bytes: float  # what an uncompressed ring all-reduce of the same tensor sends per rank
    rel_error: float  # global relative error of half 1: sqrt(sum err^2 / sum norm^2); nan unless measured
    mean_norm: float  # norm of the result (same on every rank); nan unless measured


def ring_all_reduce_bytes(numel: int, world: int, bytes_per_value: int = 4) -> float:
    return 2 * (world - 1) / world * numel * bytes_per_value


def compressed_all_reduce_mean(x: torch.Tensor, group: dist.ProcessGroup, codec: Codec, key: str,
                               feedback: ErrorFeedback, generator: torch.Generator | None = None,
                               measure: bool = True) -> tuple[torch.Tensor, ReduceInfo]:
    """Mean of the 1-D fp32 ``x`` over ``group``, exchanged as ``codec`` bytes.

    ``x`` is not modified; returns (mean, info). ``feedback`` residuals are keyed
    ``key + "/in"`` (size n x chunk) and ``key + "/out"`` (size chunk). inf/nan in ``x``
    decode as nan (the trainer's non-finite check sees them), they do not raise."""
    n = group.size()
    numel = x.numel()
    chunk = math.ceil(numel / n)
    padded = torch.zeros(n * chunk, dtype=torch.float32, device=x.device)
    padded[:numel] = x.reshape(-1)

    # -- half 1: quantised reduce-scatter (all-to-all of row chunks) -------------------
    comp = feedback.compensate(key + "/in", padded)
    rows = comp.reshape(n, chunk)
    send = codec.encode_rows(rows, generator)  # (n, row bytes)
    err_sq = norm_sq = torch.zeros((), device=x.device)
    if feedback.enabled or measure:
        mine = codec.decode_rows(send, chunk)
        feedback.update(key + "/in", comp, mine.reshape(-1))
        if measure:
            err_sq, norm_sq = (rows - mine).pow(2).sum(), rows.pow(2).sum()
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=group)
    local = codec.decode_rows(recv, chunk).sum(dim=0) / n  # (chunk,) this rank's chunk of the mean

    # -- half 2: quantised all-gather of the averaged chunks ----------------------------
    comp2 = feedback.compensate(key + "/out", local)
    row2 = codec.encode_rows(comp2.reshape(1, chunk), generator)
    if feedback.enabled:
        feedback.update(key + "/out", comp2, codec.decode_rows(row2, chunk)[0])
    stats = torch.stack([err_sq, norm_sq]).float().view(torch.uint8).to(x.device)
    row2 = torch.cat([row2[0], stats])
    gathered = torch.empty(n * row2.numel(), dtype=torch.uint8, device=x.device)
    dist.all_gather_single(gathered, row2, group=group)
    gathered = gathered.view(n, -1)
    mean = codec.decode_rows(gathered[:, :-STATS_BYTES], chunk).reshape(-1)[:numel]

    rel_error = mean_norm = float("nan")
    if measure:  # host sync: only the adaptive codec needs these figures on the host
        all_stats = gathered[:, -STATS_BYTES:].contiguous().view(torch.float32).double()  # (n, 2)
        tot_err, tot_norm = all_stats.sum(dim=0).tolist()
        rel_error = math.sqrt(tot_err / tot_norm) if tot_norm > 0 else 0.0
        mean_norm = float(mean.norm())
    info = ReduceInfo(bytes_sent=(n - 1) * (send.shape[1] + row2.numel()),
                      fp32_ring_bytes=ring_all_reduce_bytes(numel, n), rel_error=rel_error, mean_norm=mean_norm)
    return mean.reshape(x.shape), info


def fp32_all_reduce_mean(x: torch.Tensor, group: dist.ProcessGroup) -> tuple[torch.Tensor, ReduceInfo]:
    """Uncompressed reference (and the warm-up path): one fp32 all-reduce, then / n."""
    n = group.size()
    out = x.detach().clone()
    dist.all_reduce(out, group=group)
    out /= n
    ring = ring_all_reduce_bytes(x.numel(), n)
    return out, ReduceInfo(bytes_sent=int(ring), fp32_ring_bytes=ring, rel_error=0.0, mean_norm=float(out.norm()))
