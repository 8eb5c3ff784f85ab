"""2-D tensor parallelism (SUMMA-style weight split; issue 23), selected by
``parallel.tp_mode = "2d"`` and applied by ``parallel/apply.py`` through ``apply.py``'s
``apply_tp2d`` (README, "2-D tensor parallelism": what is supported and what is refused).

The ``tp`` ranks form a q x q grid (``grid.py``); a linear layer's weight is split by input
features over grid rows and by output features over grid columns, activations by batch rows
over grid rows and by hidden over grid columns, and the matmul runs as SUMMA in its all-gather
form (``summa.py``). ``norm.py`` is RMSNorm on that layout, ``embedding.py`` and ``loss.py``
its edges (the token lookup, the vocab-parallel cross-entropy); ``comm_bytes.py`` counts the
bytes each rank sends per step, 1-D vs 2-D.
"""

from trainforge.parallel.tp2d.comm_bytes import (
    BlockShape,
    summa_bytes_per_rank,
    summa_linear_bytes,
    summa_rmsnorm_bytes,
    tp1d_bytes_per_rank,
)
from trainforge.parallel.tp2d.embedding import Embedding2D
from trainforge.parallel.tp2d.grid import Grid2D, grid_side
from trainforge.parallel.tp2d.norm import RMSNorm2D
from trainforge.parallel.tp2d.summa import Linear2D, gathered_matmul, row_gather, shard_activation, summa_matmul

__all__ = ["BlockShape", "Embedding2D", "Grid2D", "Linear2D", "RMSNorm2D", "gathered_matmul", "grid_side",
           "row_gather", "shard_activation", "summa_bytes_per_rank", "summa_linear_bytes", "summa_matmul",
           "summa_rmsnorm_bytes", "tp1d_bytes_per_rank"]
