"""Cross-entropy on the 2-D layout's logits: the grid's output edge.

The output projection (a ``Linear2D``) leaves rank (i, j) the logits of batch rows block i
and vocab block j, (B/q, T, V/q); ``apply.py`` presents them as the (B, T, V) DTensor they
are, placements (Shard(0), Shard(2)) on (tp_row, tp_col). DTensor's ``loss_parallel``
computes the cross-entropy on that layout: the max, the sum of exponentials and the target's
logit are reduced over the mesh dim that splits the vocabulary (``tp_col``: the grid row's
ranks), never gathering (B, T, V). torch 2.13 refuses its ``reduction="mean"`` on a mesh of
more than one dim (each rank would divide by its own token count), so this takes the sum,
which comes back Partial over ``tp_row`` (each grid row summed its own batch rows), reduces
it there and divides by the global token count.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor


def cross_entropy_2d(logits: DTensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean token cross-entropy, in fp32, of 2-D logits (B, T, V) (a DTensor (Shard(0),
    Shard(2)) on the grid's mesh) against ``targets`` (B, T), the full batch every tp rank
    holds. Must run, with its backward, inside ``loss_parallel()`` (``tensor_parallel.
    loss_context``). Returns a plain scalar, the same on every tp rank, attached to the graph."""
    if tuple(logits.placements) != (Shard(0), Shard(2)):
        raise ValueError(f"cross_entropy_2d: expected logits placed (Shard(0), Shard(2)) on (tp_row, tp_col), got "
                         f"{logits.placements}")
    flat = logits.flatten(0, 1).float()  # (B*T, V): batch block i's rows, vocab block j
    # Each rank takes its own block of the targets it already holds: no communication.
    rows = distribute_tensor(targets.flatten(0, 1), logits.device_mesh, (Shard(0), Replicate()), src_data_rank=None)
    total = F.cross_entropy(flat, rows, reduction="sum")  # scalar, (Partial(), Replicate())
    return total.full_tensor() / targets.numel()
