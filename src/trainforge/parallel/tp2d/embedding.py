"""The token embedding on the 2-D layout: the grid's input edge.

Every tp rank receives the same (B, T) token ids (the data loader shards over dp only). Rank
(i, j) looks up the tokens of batch rows block i in its block of the table, hidden block j:
X_ij (B/q, T, dim/q), the layout the blocks take (``summa.py``), with no forward
communication. The table (vocab, dim) is a DTensor with placements (Replicate(), Shard(1)):
whole vocabulary on every rank, hidden split by grid column, the single-device key and shape
for DCP. Its block is replicated over the q grid rows, which look up different batch rows,
so the gradient is summed over ``col_group`` in backward (as ``RMSNorm2D``'s weight):
2 (q-1)/q * vocab * dim/q elements per rank per step.

Why not the vocab split of 1-D TP (``RowwiseParallel``): there every rank sums partial
lookups of the same tokens, an all-reduce (or reduce-scatter) of the (B, T, dim) output in
forward; here the lookup is local and only the table's gradient moves, which is cheaper when
the batch's tokens outnumber the vocabulary's rows over q.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard

from trainforge.parallel.tp2d.grid import Grid2D
from trainforge.parallel.tp2d.norm import sum_grad_over


class Embedding2D(nn.Module):
    """``forward(tokens (B, T)) = X_ij (B/q, T, dim/q)``: ``nn.Embedding`` on this rank's block."""

    def __init__(self, weight_block: torch.Tensor, grid: Grid2D, num_embeddings: int, embedding_dim: int):
        super().__init__()
        self.grid, self.num_embeddings, self.embedding_dim = grid, num_embeddings, embedding_dim
        self.weight = nn.Parameter(DTensor.from_local(weight_block, grid.mesh, [Replicate(), Shard(1)],
                                                      run_check=False, shape=(num_embeddings, embedding_dim),
                                                      stride=(embedding_dim, 1)))

    @classmethod
    def from_embedding(cls, embedding: nn.Embedding, grid: Grid2D) -> "Embedding2D":
        """This rank's block of a full ``embedding`` that every rank holds (same seed)."""
        vocab, dim = embedding.weight.shape
        if dim % grid.q:
            raise ValueError(f"Embedding2D: the grid side q = {grid.q} must divide the embedding dim = {dim}")
        return cls(embedding.weight.detach().chunk(grid.q, dim=1)[grid.col].clone(), grid, vocab, dim)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        q = self.grid.q
        if tokens.shape[0] % q:
            raise ValueError(f"2-D tensor parallelism splits the batch rows over the grid's q = {q} rows: a batch of "
                             f"{tokens.shape[0]} sequences does not split; make training.batch_size a multiple of "
                             f"{q}")
        rows = tokens.chunk(q, dim=0)[self.grid.row]  # (B/q, T): whole sequences of batch block i
        return F.embedding(rows, sum_grad_over(self.weight.to_local(), self.grid.col_group))

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, grid={self.grid.q}x{self.grid.q}"
