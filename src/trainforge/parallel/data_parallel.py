"""Data parallelism: DDP, FSDP2 (``fully_shard``) or HSDP, chosen from the layout.

- only ``dp_replicate`` > 1 (no TP/PP): DDP over the ``dp_replicate`` mesh;
- ``dp_shard`` > 1 and/or combined with TP/PP: FSDP2 over ``dp_shard``, or HSDP over
  the 2-D ``(dp_replicate, dp_shard)`` mesh when both are > 1 (shard within a node,
  replicate across nodes, where bandwidth is scarce).

Each transformer block is its own FSDP unit so only one block's full parameters are
materialised at a time; the root call covers embeddings, final norm and output.

With gradient compression (``[compression]``) the ``dp_replicate`` axis carries
compressed gradients: DDP gets a communication hook, and HSDP becomes FSDP2 over
``dp_shard`` alone plus an all-reduce hook per FSDP unit that averages over
``dp_replicate`` (see ``compression/hooks.py``).

With a low-precision ``[precision]`` policy, FSDP2's ``MixedPrecisionPolicy`` gathers
parameters in the compute dtype and reduces gradients in ``reduce_dtype``; the sharded
fp32 parameters are the master weights. Modules of the fp32 rules that own parameters
(norms, a router) become their own units gathered in fp32, sharded before their block.

Expert-parallel parameters (``expert_parallel.py``) are ``ignored_params`` here: they are
already split over ``ep`` and their gradients are reduced over ``edp`` instead.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard
from torch.nn.parallel import DistributedDataParallel

from trainforge.parallel.dims import ParallelDims, ParallelMesh


def data_parallel_kind(dims: ParallelDims) -> str:
    if dims.dp == 1:
        return "none"
    if dims.dp_shard == 1 and dims.tp == 1 and dims.pp == 1:
        return "ddp"
    return "hsdp" if dims.dp_replicate > 1 else "fsdp"


def apply_fsdp(model: nn.Module, mesh: ParallelMesh, dims: ParallelDims,
               mp_policy: MixedPrecisionPolicy | None = None, compressor=None, precision=None,
               ignored_params: list[nn.Parameter] | None = None, cpu_offload: bool = False) -> nn.Module:
    """``precision``: a ``PrecisionPolicy`` (overrides ``mp_policy``); None or all-fp32 keeps
    FSDP2's defaults, so fp32 runs are unchanged. ``cpu_offload``: FSDP2's ``CPUOffloadPolicy``
    (``[offload] mode = fsdp``): sharded parameters, gradients and optimizer state on the host."""
    fp32_units: list[nn.Module] = []
    if precision is not None and precision.low_precision:
        from trainforge.precision.policy import fsdp_fp32_modules, fsdp_fp32_policy, fsdp_mixed_precision

        mp_policy = fsdp_mixed_precision(precision)
        fp32_units = fsdp_fp32_modules(model, precision)
    if dims.dp_replicate > 1 and compressor is None:
        dp_mesh = mesh.world["dp_replicate", "dp_shard"]  # 2-D mesh: fully_shard does HSDP
    else:
        # Without compression: plain FSDP. With it: shard over dp_shard only; the
        # replicate axis is averaged by the compressed all-reduce hooks below.
        dp_mesh = mesh.world["dp_shard"]
    ignored = {"ignored_params": set(ignored_params)} if ignored_params else {}
    if cpu_offload:  # pinned host memory only where there is a device to copy from
        ignored["offload_policy"] = CPUOffloadPolicy(pin_memory=dp_mesh.device_type == "cuda")
    kw = {"mesh": dp_mesh, "mp_policy": mp_policy or MixedPrecisionPolicy(), **ignored}
    for unit in fp32_units:  # before the blocks holding them: a unit is claimed by its first fully_shard
        fully_shard(unit, mesh=dp_mesh, mp_policy=fsdp_fp32_policy(precision), **ignored)
    blocks = list(model.layers.items())
    for i, (_, block) in enumerate(blocks):
        # The last block's parameters are needed again at once by backward: keep them.
        fully_shard(block, reshard_after_forward=i < len(blocks) - 1, **kw)
    fully_shard(model, **kw)
    if compressor is not None:
        from trainforge.compression.hooks import register_fsdp_hooks

        first = blocks[0][0] if blocks else "root"
        fqns = {id(m): fqn for fqn, m in model.named_modules()}
        # The root unit's key names the stage too (its first block): pipeline stages
        # on one rank each have a root unit. fp32 units (norms) need the hook as well, or
        # their gradients would not be averaged over dp_replicate.
        register_fsdp_hooks([(f"layers.{name}", b) for name, b in blocks] + [(fqns[id(u)], u) for u in fp32_units]
                            + [(f"root@{first}", model)], compressor)
    return model


def apply_ddp(model: nn.Module, mesh: ParallelMesh, device: torch.device, compressor=None,
              ignored_params: list[nn.Parameter] | None = None) -> nn.Module:
    kw = {}
    ids = {id(p) for p in ignored_params or []}
    # Expert-parallel parameters are reduced by ExpertGradReducer, not by DDP.
    ignored = [fqn for fqn, p in model.named_parameters() if id(p) in ids]
    if getattr(compressor, "needs_single_bucket", False):
        # PowerSGD launches its second all-reduce from a future callback, which hangs
        # on gloo once there is more than one bucket: give it one bucket.
        n_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
        kw["bucket_cap_mb"] = n_bytes / 2**20 + 1
    # DDP broadcasts rank 0's buffers at every forward; a module's ``rank_local_buffers`` (a
    # router's token counts and auxiliary-loss sums) are this rank's own: they add up over
    # micro-batches until their owner all-reduces them.
    ignored += [f"{fqn}.{name}" for fqn, m in model.named_modules() for name in getattr(m, "rank_local_buffers", ())]
    if ignored:  # one call: each call replaces the model's ignore list
        DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(model, ignored)
    ddp = DistributedDataParallel(model, process_group=mesh["dp_replicate"].get_group(),
                                  device_ids=[device.index] if device.type == "cuda" else None, **kw)
    if compressor is not None:
        from trainforge.compression.hooks import attach_to_ddp

        attach_to_ddp(ddp, compressor, device)
    return ddp


def apply_data_parallel(model: nn.Module, mesh: ParallelMesh | None, dims: ParallelDims,
                        device: torch.device, compressor=None, precision=None,
                        ignored_params: list[nn.Parameter] | None = None, cpu_offload: bool = False) -> nn.Module:
    """Wrap or shard ``model`` in place; returns the module to call (DDP returns a wrapper).
    ``cpu_offload``: FSDP2 layouts only (``apply_fsdp``).
    ``compressor`` (``compression.hooks.build_compressor``) compresses the dp_replicate axis;
    ``precision`` (a ``PrecisionPolicy``) sets FSDP2's mixed precision (DDP reduces
    gradients in the parameters' dtype). ``ignored_params``: left out of both (experts)."""
    kind = data_parallel_kind(dims)
    if kind == "none" or mesh is None:
        return model
    if kind == "ddp":
        return apply_ddp(model, mesh, device, compressor, ignored_params)
    return apply_fsdp(model, mesh, dims, compressor=compressor, precision=precision, ignored_params=ignored_params,
                      cpu_offload=cpu_offload)
