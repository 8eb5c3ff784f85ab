"""Bytes each rank sends per training step for one Llama block: 1-D (Megatron) vs 2-D (SUMMA) TP.

Pure arithmetic, no processes. The model of a collective over a group of p ranks on n bytes
(the ring algorithms NCCL uses for large messages; gloo picks others for small ones, so this is
the collectives' data volume, not gloo's wire count):

- all-gather whose output is n bytes: each rank sends (p-1)/p * n (its chunk, then p-2 relayed);
- reduce-scatter whose input is n bytes: (p-1)/p * n;
- all-reduce of n bytes (reduce-scatter + all-gather): 2 (p-1)/p * n.

Assumptions, both schemes: one forward and one backward per step, no activation checkpointing
(which would repeat the forward's collectives in backward); the block's projections only -
embedding, output layer and loss are outside the block and counted by neither per-block figure
(``summa_edge_collectives`` lists 2-D's, which the planner prices); the data-parallel
gradient reduction is on other axes and not counted; ``e`` bytes per element for activations,
weights and gradients alike (4 for float32, 2 for bf16). N = batch * seq tokens in the step
across the tp ranks (the ranks read the same batch).

1-D (Megatron-LM, p = tp). Per block, the residual stream (N, dim) is all-reduced after the
row-parallel ``wo`` and ``w2`` in forward, and after the column-parallel ``wq/wk/wv`` and
``w1/w3`` (their input gradient) in backward: 4 all-reduces of N * dim * e. With sequence
parallel each all-reduce becomes an all-gather plus a reduce-scatter (the same bytes), and the
two norms, now on different tokens per rank, all-reduce their weight gradients (dim each).
Weights never move. None of it depends on ffn or heads.

2-D (SUMMA, tp = q * q; ``summa.py``). Per matmul of input width d_in and output widths
d_out (several when q, k, v or w1, w3 share one gathered input): all-gather X over the grid row,
all-gather each weight over the grid column, and their reduce-scatters in backward:
2 (q-1)/q^2 * (N * d_in + d_in * sum(d_out)) * e. Per RMSNorm (``norm.py``): two all-reduces
of N/q sums of squares and one of the dim/q weight gradient. The attention between the
projections is local (heads split by grid column, whole sequences by grid row). Activations
move on groups of q instead of q^2, each carrying 1/q of the tokens, at the cost of moving
weights: 2-D wins when N is large next to the weights' widths.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from trainforge.parallel.tp2d.grid import grid_side


@dataclass(frozen=True)
class BlockShape:
    """One Llama block in one step: (batch, seq) tokens, widths and heads of the model config."""
    batch: int
    seq: int
    dim: int
    ffn: int  # ffn_hidden_dim
    n_heads: int
    n_kv_heads: int

    @property
    def tokens(self) -> int:
        return self.batch * self.seq

    @property
    def kv_dim(self) -> int:
        return self.n_kv_heads * (self.dim // self.n_heads)


@dataclass(frozen=True)
class Collective:
    """One collective a rank issues: ``op`` on a group of ``group_size`` ranks (``group``: the
    grid's "row" or "col" under 2-D), ``n_bytes`` the full tensor (an all-gather's output, a
    reduce-scatter's input, an all-reduce's tensor). ``sent_bytes``: what this rank sends, by
    the ring model of the module docstring; ``phase``: issued in forward (repeated when activation
    checkpointing recomputes it) or backward. The planner prices the same list by its link model
    (``plan/comm_model.py``)."""
    op: Literal["all_gather", "reduce_scatter", "all_reduce"]
    group: str
    group_size: int
    n_bytes: float
    phase: Literal["forward", "backward"]

    @property
    def sent_bytes(self) -> float:
        p = self.group_size
        return (2 if self.op == "all_reduce" else 1) * (p - 1) / p * self.n_bytes


def summa_linear_collectives(tokens: int, d_in: int, d_outs: int | Sequence[int], q: int,
                             elem_bytes: int = 4) -> list[Collective]:
    """The collectives of one ``summa_matmul`` (``summa.py``), forward then backward: X_i*
    gathered over the grid row and each W_*j over the grid column, then dX reduce-scattered
    over the row and each dW over the column."""
    d_outs = [d_outs] if isinstance(d_outs, int) else list(d_outs)
    x_panel = tokens / q * d_in * elem_bytes  # X_i* (N/q, in)
    w_panels = [d_in * d / q * elem_bytes for d in d_outs]  # W_*j (in, out/q)
    fwd = [Collective("all_gather", "row", q, x_panel, "forward")] + [
        Collective("all_gather", "col", q, w, "forward") for w in w_panels]
    bwd = [Collective("reduce_scatter", "row", q, x_panel, "backward")] + [
        Collective("reduce_scatter", "col", q, w, "backward") for w in w_panels]
    return fwd + bwd


def summa_rmsnorm_collectives(tokens: int, dim: int, q: int, elem_bytes: int = 4) -> list[Collective]:
    """The collectives of one ``RMSNorm2D`` call (``norm.py``), forward then backward: the sums
    of squares of the row's N/q tokens over the row, their gradient, the weight block's gradient
    (dim/q) over the column."""
    sums = tokens / q * elem_bytes
    return [Collective("all_reduce", "row", q, sums, "forward"), Collective("all_reduce", "row", q, sums, "backward"),
            Collective("all_reduce", "col", q, dim / q * elem_bytes, "backward")]


def summa_block_collectives(shape: BlockShape, tp: int, elem_bytes: int = 4) -> list[Collective]:
    """Every collective one rank issues for one block in one step under 2-D TP (tp = q * q;
    ``grid_side`` refuses other tp): two norms and four SUMMA matmuls. q must divide batch
    (whole sequences per grid row), heads and widths (ValueError naming the one that does not)."""
    q = grid_side(tp)
    for name, v in (("batch", shape.batch), ("n_heads", shape.n_heads), ("n_kv_heads", shape.n_kv_heads),
                    ("dim", shape.dim), ("ffn", shape.ffn)):
        if v % q:
            raise ValueError(f"summa_bytes_per_rank: the grid side q = {q} must divide {name} = {v}")
    n, d, f, kv = shape.tokens, shape.dim, shape.ffn, shape.kv_dim
    return (2 * summa_rmsnorm_collectives(n, d, q, elem_bytes)
            + summa_linear_collectives(n, d, [d, kv, kv], q, elem_bytes)  # wq, wk, wv: one gathered input
            + summa_linear_collectives(n, d, d, q, elem_bytes)            # wo
            + summa_linear_collectives(n, d, [f, f], q, elem_bytes)       # w1, w3
            + summa_linear_collectives(n, f, d, q, elem_bytes))           # w2


def summa_edge_collectives(tokens: int, dim: int, vocab: int, q: int, elem_bytes: int = 4, *,
                           embedding: bool = True, head: bool = True) -> list[Collective]:
    """The collectives of the model's edges under 2-D TP, one step (``apply.py``): the
    embedding's table gradient (vocab x dim/q, replicated over the grid rows) summed over the
    column in backward (``embedding.py``: the lookup itself is local); the final norm, the
    output projection as a SUMMA matmul of width vocab, and the vocab-parallel loss's three
    float32 all-reduces of the row's N/q per-token values (max, sum of exponentials, target
    logit: ``loss.py``) over the grid row. ``embedding`` / ``head``: whether this rank holds
    them (a pipeline's first / last stage)."""
    out = [Collective("all_reduce", "col", q, vocab * dim / q * elem_bytes, "backward")] if embedding else []
    if head:
        out += (summa_rmsnorm_collectives(tokens, dim, q, elem_bytes)
                + summa_linear_collectives(tokens, dim, vocab, q, elem_bytes)
                + 3 * [Collective("all_reduce", "row", q, tokens / q * 4, "forward")])
    return out


def summa_linear_bytes(tokens: int, d_in: int, d_outs: int | Sequence[int], q: int, elem_bytes: int = 4) -> float:
    """Bytes one rank sends for one ``summa_matmul`` of a (tokens, d_in) input with weights of
    output widths ``d_outs`` on a q x q grid, forward + backward:
    2 (q-1) (tokens d_in / q^2 + d_in sum(d_outs) / q^2) elem_bytes."""
    return sum(c.sent_bytes for c in summa_linear_collectives(tokens, d_in, d_outs, q, elem_bytes))


def summa_rmsnorm_bytes(tokens: int, dim: int, q: int, elem_bytes: int = 4) -> float:
    """Bytes one rank sends for one ``RMSNorm2D`` call, forward + backward (float32 sums of
    squares: they are all-reduced in the norm's compute dtype, counted as ``elem_bytes``)."""
    return sum(c.sent_bytes for c in summa_rmsnorm_collectives(tokens, dim, q, elem_bytes))


def summa_bytes_per_rank(shape: BlockShape, tp: int, elem_bytes: int = 4) -> float:
    """Bytes one rank sends per step for one block under 2-D TP: the sum over
    ``summa_block_collectives`` (its ValueErrors)."""
    return sum(c.sent_bytes for c in summa_block_collectives(shape, tp, elem_bytes))


def tp1d_bytes_per_rank(shape: BlockShape, tp: int, sequence_parallel: bool, elem_bytes: int = 4) -> float:
    """Bytes one rank sends per step for one block under 1-D (Megatron-style) TP of degree tp."""
    if tp < 1:
        raise ValueError(f"tp1d_bytes_per_rank: tp = {tp} must be >= 1")
    stream = shape.tokens * shape.dim * elem_bytes
    activations = 4 * 2 * (tp - 1) / tp * stream  # 4 all-reduces, or 4 all-gathers + 4 reduce-scatters
    norm_grads = 2 * 2 * (tp - 1) / tp * shape.dim * elem_bytes if sequence_parallel else 0.0
    return activations + norm_grads
