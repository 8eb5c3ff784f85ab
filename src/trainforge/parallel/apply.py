"""Apply parallelism to a single-device model, in one documented order:

1. pipeline split (each rank keeps its stages; FQNs unchanged)  -- ``pipeline.py``
2. tensor parallel (DTensor plans; must see plain modules)        -- ``tensor_parallel.py``
3. activation checkpointing (wraps whole blocks)                  -- ``activation_checkpoint.py``
4. compile (optional; not applied yet: ~1.0x on CPU)
5. data parallel: FSDP2 / HSDP last, so it shards the TP-sharded
   DTensors along one more mesh axis; DDP only without TP/PP      -- ``data_parallel.py``
"""

from __future__ import annotations

import torch
from torch import nn

from trainforge.parallel.activation_checkpoint import apply_activation_checkpointing
from trainforge.parallel.data_parallel import apply_data_parallel
from trainforge.parallel.dims import ParallelDims, ParallelMesh


def parallelize_module_stack(model: nn.Module, mesh: ParallelMesh | None, dims: ParallelDims, section,
                             device: torch.device) -> nn.Module:
    """Steps 2-5 for one model or pipeline-stage module. Returns the module to call."""
    if dims.tp > 1 and mesh is not None:
        from trainforge.parallel.tensor_parallel import apply_tensor_parallel

        apply_tensor_parallel(model, mesh["tp"], sequence_parallel=section.sequence_parallel,
                              loss_parallel=section.loss_parallel)
    apply_activation_checkpointing(model, section.activation_checkpointing)
    return apply_data_parallel(model, mesh, dims, device)
