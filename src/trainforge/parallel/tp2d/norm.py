"""RMSNorm on the 2-D layout: hidden split by grid column, batch rows by grid row.

Rank (i, j) holds x_ij (B/q, ..., dim/q) and the weight block w_j (dim/q). The mean of squares
over the full hidden is the sum of the q partial sums of squares of grid row i, so one
all-reduce over ``row_group`` of a (B/q, ..., 1) tensor per call; its backward is the same
all-reduce of the partial gradients (each rank's normalised outputs depend on every rank's
sum). The weight block w_j is replicated over the q grid rows, which normalise different
batch rows, so its gradient is summed over ``col_group`` in backward (the weight is a DTensor
(Replicate(), Shard(0)) on the mesh; after backward its gradient is the full one, replicated).

Per rank per call (ring all-reduce of n elements sends 2 (q-1)/q n): activations
2 x 2 (q-1)/q * (B/q * T) and the weight gradient 2 (q-1)/q * dim/q, times the element size;
see ``comm_bytes.py``. Hand-written for the same reason as ``summa.py``.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard

from trainforge.parallel.tp2d.grid import Grid2D


class _AllReduceSum(torch.autograd.Function):
    """Sum over ``group`` in forward; the gradient, summed over ``group``, in backward."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.group = group
        out = x.clone()
        dist.all_reduce(out, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grad = grad.clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class _SumGradOver(torch.autograd.Function):
    """Identity in forward; the gradient summed over ``group`` in backward (a parameter
    replicated over ``group`` whose replicas see different data)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grad = grad.clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


def sum_grad_over(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """``x`` unchanged; its gradient summed over ``group`` in backward (the local block of a
    weight replicated over ``group`` whose replicas see different batch rows)."""
    return _SumGradOver.apply(x, group)


class RMSNorm2D(nn.Module):
    """``model.norm.RMSNorm`` on X_ij: the same float32 math, over the full ``dim``."""

    def __init__(self, weight_block: torch.Tensor, grid: Grid2D, dim: int, eps: float):
        super().__init__()
        self.grid, self.dim, self.eps = grid, dim, eps
        self.weight = nn.Parameter(DTensor.from_local(weight_block, grid.mesh, [Replicate(), Shard(0)],
                                                      run_check=False, shape=(dim,), stride=(1,)))

    @classmethod
    def from_rmsnorm(cls, norm: nn.Module, grid: Grid2D) -> "RMSNorm2D":
        """This rank's block of a full ``RMSNorm`` (``weight`` (dim,), ``eps``) every rank holds."""
        dim = norm.weight.shape[0]
        if dim % grid.q:
            raise ValueError(f"RMSNorm2D: the grid side q = {grid.q} must divide dim = {dim}")
        return cls(norm.weight.detach().chunk(grid.q)[grid.col].clone(), grid, dim, norm.eps)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()  # as RMSNorm: the mean of squares overflows fp16
        sum_sq = _AllReduceSum.apply(x.pow(2).sum(-1, keepdim=True), self.grid.row_group)  # (B/q, ..., 1)
        x = x * torch.rsqrt(sum_sq / self.dim + self.eps)
        weight = sum_grad_over(self.weight.to_local(), self.grid.col_group)  # (dim/q,)
        return weight * x.to(dtype)
