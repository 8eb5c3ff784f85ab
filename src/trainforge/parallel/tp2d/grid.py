"""The q x q grid of the ``tp`` ranks for 2-D tensor parallelism, as a 2-D ``DeviceMesh``.

Rank (i, j) sits in grid row i and grid column j; the mesh dims are ``tp_row`` (coordinate i)
and ``tp_col`` (coordinate j), row-major over the tp axis (tp rank r = i * q + j), so a grid
row is q neighbouring tp ranks, on the fastest links when tp is innermost.

Two process groups per rank, taken from the mesh (every rank created every group, in the same
order, when the mesh was built, as ``new_group`` requires):

- ``row_group``: the q ranks of this rank's grid row, (i, 0) .. (i, q-1), in order of j. It is
  the 1-D slice along ``tp_col``. Activation panels travel on it (their hidden is split by j).
- ``col_group``: the q ranks of this rank's grid column, (0, j) .. (q-1, j), in order of i; the
  slice along ``tp_row``. Weight panels travel on it (a weight's input features split by i).

The 2-D mesh is the tp mesh reshaped with ``DeviceMesh._unflatten`` (private in torch 2.13, but
the one call that reshapes a dim of a bigger world mesh into named sub-dims without creating
groups on ranks outside it; checked on gloo CPU with a (dp=1, tp=4) world mesh only).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from trainforge.errors import ConfigError

DIMS = ("tp_row", "tp_col")


def grid_side(tp: int) -> int:
    """q for ``tp`` = q * q ranks, q >= 2; otherwise a ``ConfigError`` naming both keys."""
    q = math.isqrt(tp) if tp >= 0 else 0
    if q < 2 or q * q != tp:
        raise ConfigError(
            f"config key 'parallel.tp' = {tp} with parallel.tp_mode = \"2d\": 2-D tensor parallelism needs the tp "
            "ranks to form a square q x q grid with q >= 2 (parallel.tp = 4, 9, 16, ...); set parallel.tp to a "
            "square or use parallel.tp_mode = \"1d\"")
    return q


@dataclass(frozen=True)
class Grid2D:
    mesh: DeviceMesh  # 2-D, dims DIMS
    q: int
    row: int  # i, this rank's grid row
    col: int  # j, this rank's grid column

    @classmethod
    def from_tp_mesh(cls, tp_mesh: DeviceMesh) -> "Grid2D":
        """The grid of a 1-D tp mesh (``ParallelMesh["tp"]``). Collective: every rank of the
        world calls it, for its own tp mesh, at the same point."""
        if tp_mesh.ndim != 1:
            raise ValueError(f"Grid2D.from_tp_mesh: expected the 1-D tp mesh, got {tp_mesh.ndim} dims")
        q = grid_side(tp_mesh.size())
        mesh = tp_mesh._unflatten(0, (q, q), DIMS)
        i, j = mesh.get_coordinate()
        return cls(mesh, q, i, j)

    @property
    def row_group(self) -> dist.ProcessGroup:
        return self.mesh.get_group("tp_col")

    @property
    def col_group(self) -> dist.ProcessGroup:
        return self.mesh.get_group("tp_row")
