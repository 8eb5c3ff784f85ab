r"""SUMMA matmul on a q x q grid (all-gather form) and the ``Linear2D`` module that holds its shard.

Layout. Y = X W with X (N, in) (N batch rows: whole sequences, see below) and W (in, out)
(``nn.Linear.weight`` is W^T, (out, in)). On the grid (``grid.py``), rank (i, j) holds

- X_ij: batch rows block i, input features block j          (N/q, in/q)
- W_ij: input features block i, output features block j     (in/q, out/q)
- Y_ij: batch rows block i, output features block j         (N/q, out/q)

so Y has X's layout and layers chain with no re-layout (elementwise ops act on shards).

Forward. Y_ij = sum_k X_ik W_kj = X_i* @ W_*j, where X_i* = [X_i0 .. X_i,q-1] is held by the
ranks (i, k) of grid row i and W_*j = [W_0j; ..; W_q-1,j] by the ranks (k, j) of grid column j:

    X_i* = all_gather(X_ij, row_group)    (N/q, in)        W_*j = all_gather(W_ij, col_group)   (in, out/q)
    Y_ij = X_i* @ W_*j

Classic SUMMA broadcasts panel k along rows and columns at step k and accumulates; gathering
all q panels at once is the same data in one collective per operand (fewer latency hops), at
the price of holding the whole panels X_i* and W_*j, which backward reuses.

Two autograd functions, so that projections sharing an input gather it once: ``row_gather``
(X_ij -> X_i*) and ``gathered_matmul`` (gathers each W_*j, several issued together, and
multiplies). ``parallel/tp2d/apply.py`` gathers the attention's and the feed-forward's input
once and hands X_i* to wq / wk / wv and w1 / w3 (``Linear2D(input_gathered=True)``); autograd
sums their dX_i* terms before the one reduce-scatter of ``row_gather``'s backward.

Backward (dY_ij (N/q, out/q) arrives on rank (i, j)).

    dX_ik = sum_j dY_ij W_kj^T.  Rank (i, j) computes its term for every k at once,
            dY_ij @ W_*j^T (N/q, in) = [dY_ij W_0j^T .. dY_ij W_q-1,j^T]; summing over j (the
            ranks of grid row i) and leaving block k on rank (i, k) is a reduce_scatter over
            ``row_group``: the transpose of the forward all-gather of X on the same group.
    dW_kj = sum_i X_ik^T dY_ij.  Rank (i, j) computes X_i*^T @ dY_ij (in, out/q), whose block k
            is its term for W_kj; summing over i (the ranks of grid column j) and leaving block k
            on rank (k, j) is a reduce_scatter over ``col_group``: the transpose of the forward
            all-gather of W. The dW reduce-scatters are issued before the dX matmul, so they
            overlap with it.

Per rank per call (ring collectives; group size q; e bytes per element), forward and backward:
2 (q-1)/q * (N/q * in + in * out/q) * e, see ``comm_bytes.py``. Each weight is unique to its
rank: no further gradient reduction over tp.

Several weights may share one input (q, k, v; w1, w3): ``summa_matmul(x, [w1, w3], grid)``,
or ``row_gather`` once and a ``Linear2D(input_gathered=True)`` per weight, gathers X once and
reduce-scatters one summed dX.

Batch rows are split over grid rows in units of whole sequences (x is (B/q, T, in/q)): the
attention, between the projections, then needs no communication when the heads are split by
grid column (n_heads and n_kv_heads divisible by q). Splitting the sequence instead would need
context-parallel attention.

Hand-written: DTensor expresses the weight's placement (``Linear2D.weight``), but its matmul
strategies pair the operands mesh dim by mesh dim, and here the contraction dim is split over
``tp_col`` in X and over ``tp_row`` in W, so DTensor would first redistribute an operand (not
SUMMA's panels); the collectives are therefore explicit, on the grid's groups.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, Shard

from trainforge.parallel.tp2d.grid import Grid2D


def _gather_last(x: torch.Tensor, group: dist.ProcessGroup, q: int) -> tuple[torch.Tensor, dist.Work]:
    """Start an all-gather of ``x`` (..., n) over ``group`` into (q, ..., n); ``_as_last`` ends it."""
    # Flat buffers: gloo splits the output along dim 0 into one input-shaped chunk per rank.
    out = x.new_empty(q * x.numel())
    work = dist.all_gather_single(out, x.contiguous().view(-1), group=group, async_op=True)
    return out.view(q, *x.shape), work


def _as_last(gathered: torch.Tensor) -> torch.Tensor:
    """(q, ..., n) -> (..., q * n): the q chunks side by side along the last dim, in group order."""
    return gathered.movedim(0, -2).flatten(-2)


def _reduce_scatter_last(x: torch.Tensor, group: dist.ProcessGroup, q: int) -> tuple[torch.Tensor, dist.Work]:
    """Start a sum-reduce-scatter of ``x`` (..., q * n) over ``group``: block k of the last dim,
    summed over the group, lands on its k-th rank as (..., n)."""
    chunks = x.unflatten(-1, (q, -1)).movedim(-2, 0).contiguous()  # (q, ..., n)
    out = x.new_empty(chunks[0].numel())
    work = dist.reduce_scatter_single(out, chunks.view(-1), group=group, async_op=True)
    return out.view(chunks.shape[1:]), work


def _wait(started: tuple[torch.Tensor, dist.Work]) -> torch.Tensor:
    out, work = started
    work.wait()
    return out


class _RowGather(torch.autograd.Function):
    """X_ij (..., in/q) -> X_i* (..., in): all-gather over ``row_group``; backward, the
    transpose: reduce-scatter of dX_i* over ``row_group`` (every consumer's terms summed by
    autograd first, so projections sharing an input reduce one dX)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, grid: Grid2D) -> torch.Tensor:
        ctx.grid = grid
        return _as_last(_wait(_gather_last(x, grid.row_group, grid.q)))

    @staticmethod
    def backward(ctx, dx_row: torch.Tensor):
        return _wait(_reduce_scatter_last(dx_row, ctx.grid.row_group, ctx.grid.q)), None


class _GatheredMatmul(torch.autograd.Function):
    @staticmethod
    def forward(ctx, grid: Grid2D, x_row: torch.Tensor, *weights: torch.Tensor):
        # x_row (..., in) = X_i*; weights w (out_w/q, in/q): local shards of nn.Linear weights (W^T blocks).
        q = grid.q
        w_works = [_gather_last(w, grid.col_group, q) for w in weights]  # issued together
        w_cols = [_as_last(_wait(ww)) for ww in w_works]  # (out_w/q, in) = (W_*j)^T
        ctx.grid = grid
        ctx.save_for_backward(x_row, *w_cols)
        return tuple(x_row @ w.t() for w in w_cols)  # Y_ij (..., out_w/q)

    @staticmethod
    def backward(ctx, *dys: torch.Tensor):
        grid, q = ctx.grid, ctx.grid.q
        x_row, *w_cols = ctx.saved_tensors
        x_flat = x_row.reshape(-1, x_row.shape[-1])
        # X_i*^T dY_ij, kept as its transpose (out_w/q, in) to match the weight shard's layout;
        # its reduce-scatter runs while dX_i*'s matmul does.
        dw_works = [_reduce_scatter_last(dy.reshape(-1, dy.shape[-1]).t() @ x_flat, grid.col_group, q) for dy in dys]
        dx_row = sum(dy @ w for dy, w in zip(dys, w_cols))  # (..., in): this rank's terms of dX_i*
        return (None, dx_row, *(_wait(w) for w in dw_works))


def row_gather(x: torch.Tensor, grid: Grid2D) -> torch.Tensor:
    """X_ij (B/q, ..., in/q) -> X_i* (B/q, ..., in), the input ``gathered_matmul`` takes;
    differentiable (backward: reduce-scatter over ``row_group``). Collective over the grid row."""
    return _RowGather.apply(x, grid)


def gathered_matmul(x_row: torch.Tensor, weights: Sequence[torch.Tensor], grid: Grid2D) -> tuple[torch.Tensor, ...]:
    """SUMMA's second half: ``x_row`` (B/q, ..., in) = X_i* from ``row_gather``; ``weights``
    as in ``summa_matmul``. Returns Y_ij (B/q, ..., out_w/q) per weight. Collective over the
    grid column."""
    return _GatheredMatmul.apply(grid, x_row, *weights)


def summa_matmul(x: torch.Tensor, weights: Sequence[torch.Tensor], grid: Grid2D) -> tuple[torch.Tensor, ...]:
    """``x @ W`` for each weight, on the grid; differentiable in ``x`` and the weights.

    ``x``: X_ij, (B/q, ..., in/q). ``weights``: local shards (out_w/q, in/q) of ``nn.Linear``
    weights, rank (i, j) holding rows (output features) block j and columns (input features)
    block i. Returns Y_ij (B/q, ..., out_w/q) per weight. Collective over the grid."""
    return gathered_matmul(row_gather(x, grid), weights, grid)


def shard_activation(x: torch.Tensor, grid: Grid2D) -> torch.Tensor:
    """Rank (i, j)'s block X_ij of a full activation (B, ..., hidden) every rank holds: batch
    block i, hidden block j (a slice, no communication). For the edges and tests."""
    return x.chunk(grid.q, dim=0)[grid.row].chunk(grid.q, dim=-1)[grid.col]


class Linear2D(nn.Module):
    """A bias-free linear layer on the grid: ``forward(X_ij) = Y_ij`` (``summa_matmul``).

    ``weight`` is a DTensor of the full ``nn.Linear`` weight (out, in) on the 2-D mesh with
    placements (Shard(1), Shard(0)): input features split over ``tp_row`` (grid rows), output
    features over ``tp_col`` (grid columns); in the (in, out) notation of the module docstring
    that is W split (Shard(0), Shard(1)). Keeping ``nn.Linear``'s layout and name means its
    state-dict entry has the single-device key, shape and meaning, so DCP can reshard it to a
    1-D tp or one process without a transpose."""

    def __init__(self, weight_shard: torch.Tensor, grid: Grid2D, out_features: int, in_features: int,
                 input_gathered: bool = False):
        super().__init__()
        self.grid, self.input_gathered = grid, input_gathered
        self.in_features, self.out_features = in_features, out_features
        self.weight = nn.Parameter(DTensor.from_local(weight_shard, grid.mesh, [Shard(1), Shard(0)],
                                                      run_check=False, shape=(out_features, in_features),
                                                      stride=(in_features, 1)))

    @classmethod
    def from_linear(cls, linear: nn.Linear, grid: Grid2D, input_gathered: bool = False) -> "Linear2D":
        """This rank's shard of a full, bias-free ``linear`` that every rank holds (the model is
        built single-device with one seed, then split, as ``tensor_parallel.py`` does).
        ``input_gathered``: the module is called with X_i* (``row_gather``'s output, shared
        with other projections of the same input) instead of X_ij."""
        if linear.bias is not None:
            raise ValueError("Linear2D: a bias is not supported (Llama's projections have none)")
        out_f, in_f = linear.weight.shape
        if out_f % grid.q or in_f % grid.q:
            raise ValueError(f"Linear2D: the grid side q = {grid.q} must divide both in_features = {in_f} and "
                             f"out_features = {out_f}")
        local = linear.weight.detach().chunk(grid.q, dim=0)[grid.col].chunk(grid.q, dim=1)[grid.row]
        return cls(local.clone(), grid, out_f, in_f, input_gathered)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """X_ij (B/q, ..., in/q), or X_i* (B/q, ..., in) when ``input_gathered`` -> Y_ij (B/q, ..., out/q)."""
        x_row = x if self.input_gathered else row_gather(x, self.grid)
        # to_local() is differentiable: the local gradient comes back as the DTensor's, same placements.
        return gathered_matmul(x_row, [self.weight.to_local()], self.grid)[0]

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, grid={self.grid.q}x{self.grid.q}"
                + (", input_gathered=True" if self.input_gathered else ""))
