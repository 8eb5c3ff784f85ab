"""Worker: compressed all-reduce vs the exact fp32 mean, on every codec.

Run under torchrun (gloo). Rank 0 prints one JSON line per codec with the worst
error relative to the codec's bound, whether all ranks got identical bytes, and
the bytes sent vs the formula."""

from __future__ import annotations

import json
import math

import torch
import torch.distributed as dist

from trainforge.compression.codecs import BlockQuantCodec, TopKCodec, make_codec
from trainforge.compression.collective import compressed_all_reduce_mean, ring_all_reduce_bytes
from trainforge.compression.error_feedback import ErrorFeedback


def block_absmax(x: torch.Tensor, block: int) -> torch.Tensor:
    nb = math.ceil(x.numel() / block)
    xb = torch.nn.functional.pad(x.abs(), (0, nb * block - x.numel())).reshape(nb, block)
    return xb.amax(dim=1).repeat_interleave(block)[: x.numel()]


def main() -> None:
    dist.init_process_group("gloo")
    group = dist.group.WORLD
    n, rank = dist.get_world_size(), dist.get_rank()
    numel = 10_007  # odd: chunks and blocks get padding
    gen = torch.Generator().manual_seed(100 + rank)
    # Gradient-like: mostly small, a few outliers, a zero stretch.
    x = torch.randn(numel, generator=gen) * 1e-3
    x[::997] *= 50
    x[5000:5600] = 0
    everyone = [torch.empty_like(x) for _ in range(n)]
    dist.all_gather(everyone, x)
    exact = torch.stack(everyone).double().mean(0)
    chunk = math.ceil(numel / n)
    for name in ("none", "int8", "int4", "topk", "topk+int4"):
        codec = make_codec(name, block_size=256, topk_ratio=0.05)
        mean, info = compressed_all_reduce_mean(x, group, codec, "k", ErrorFeedback(False))
        outs = [torch.empty_like(mean) for _ in range(n)]
        dist.all_gather(outs, mean)
        identical = all(torch.equal(o, mean) for o in outs)
        err = (mean.double() - exact).abs()
        if isinstance(codec, BlockQuantCodec):
            q = codec.qmax
            # Half 1: each rank's rounding, averaged; half 2: rounding of the averaged chunk
            # (its blocks start at chunk boundaries: padding per chunk).
            def row_absmax(v: torch.Tensor) -> torch.Tensor:  # blocks restart at every chunk
                rows = torch.nn.functional.pad(v, (0, n * chunk - numel)).reshape(n, chunk)
                return torch.cat([block_absmax(r, 256) for r in rows])[:numel].double()

            stage1 = torch.stack([row_absmax(e) for e in everyone]).mean(0) / (2 * q)
            stage2 = row_absmax(exact.float()) / (2 * q)
            # half 2 quantises the half-1 result, whose blocks' absmax exceed the exact ones by <= stage1
            bound = stage1 + stage2 * (1 + 1.0 / q) + 1e-9
            worst = float((err / bound).max())
        elif isinstance(codec, TopKCodec):
            worst = float("nan")  # lossy by design: checked through error feedback elsewhere
        else:
            worst = float(err.max())
        expected_bytes = (n - 1) * (codec.nbytes(chunk) + codec.nbytes(chunk) + 8)
        if rank == 0:
            print(json.dumps({"codec": name, "worst_over_bound": worst, "identical": identical,
                              "bytes_sent": info.bytes_sent, "expected_bytes": expected_bytes,
                              "ratio": info.bytes_sent / ring_all_reduce_bytes(numel, n),
                              "rel_err": float(err.norm() / exact.norm())}), flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
