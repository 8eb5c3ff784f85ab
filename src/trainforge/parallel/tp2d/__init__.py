"""2-D tensor parallelism (SUMMA-style weight split; issue 23). Groundwork, not yet applied by
``parallel/apply.py`` nor selectable from the config (README, "2-D tensor parallelism":
what exists and what integration still needs).

The ``tp`` ranks form a q x q grid (``grid.py``); a linear layer's weight is split by input
features over grid rows and by output features over grid columns, activations by batch rows
over grid rows and by hidden over grid columns, and the matmul runs as SUMMA in its all-gather
form (``summa.py``). ``norm.py`` is RMSNorm on that layout; ``comm_bytes.py`` counts the bytes
each rank sends per step, 1-D vs 2-D.
"""

from trainforge.parallel.tp2d.comm_bytes import (
    BlockShape,
    summa_bytes_per_rank,
    summa_linear_bytes,
    summa_rmsnorm_bytes,
    tp1d_bytes_per_rank,
)
from trainforge.parallel.tp2d.grid import Grid2D, grid_side
from trainforge.parallel.tp2d.norm import RMSNorm2D
from trainforge.parallel.tp2d.summa import Linear2D, shard_activation, summa_matmul

__all__ = ["BlockShape", "Grid2D", "Linear2D", "RMSNorm2D", "grid_side", "shard_activation", "summa_bytes_per_rank",
           "summa_linear_bytes", "summa_matmul", "summa_rmsnorm_bytes", "tp1d_bytes_per_rank"]
