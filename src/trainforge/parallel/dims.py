"""The parallel layout: how many ways each mesh axis splits the world.

Axes, outermost first: ``pp`` (pipeline stages), ``dp_replicate`` (DDP / the
replicate axis of HSDP: inter-node), ``dp_shard`` (FSDP2: intra-node), ``tp``
(tensor parallel: innermost, so its heavy collectives stay on the fastest links).
Their product is the world size. ``ep`` (expert parallel) is not a fifth axis: it splits
the data-parallel ranks (dp = dp_replicate x dp_shard, flattened) into groups of ``ep``
neighbouring ranks that share one expert layer's experts; ``edp`` = dp / ep ranks hold the
same experts (as in torchtitan: expert-parallel ranks read different data too).
Validation happens here, before any collective, so a bad layout fails on every rank with
the same message.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from trainforge.errors import ConfigError

AXES = ("pp", "dp_replicate", "dp_shard", "tp")


@dataclass(frozen=True)
class ParallelDims:
    pp: int
    dp_replicate: int
    dp_shard: int
    tp: int
    world_size: int
    ep: int = 1  # splits dp; see the module docstring

    @classmethod
    def resolve(cls, section, world_size: int) -> "ParallelDims":
        """From the ``[parallel]`` section; ``dp_shard = -1`` fills what the other axes leave."""
        pp, rep, shard, tp = section.pp, section.dp_replicate, section.dp_shard, section.tp
        for name, v in (("pp", pp), ("dp_replicate", rep), ("tp", tp)):
            if v < 1:
                raise ConfigError(f"config key 'parallel.{name}' = {v}: must be >= 1")
        if shard == -1:
            rest = pp * rep * tp
            if world_size % rest:
                raise ConfigError(
                    f"parallel layout: pp={pp} x dp_replicate={rep} x tp={tp} = {rest} does not divide the world "
                    f"size {world_size}, so parallel.dp_shard = -1 cannot fill it; change the axes or the number "
                    "of processes")
            shard = world_size // rest
        elif shard < 1:
            raise ConfigError(f"config key 'parallel.dp_shard' = {shard}: must be >= 1, or -1 to fill")
        ep = getattr(section, "ep", 1)
        dims = cls(pp, rep, shard, tp, world_size, ep)
        if pp * rep * shard * tp != world_size:
            raise ConfigError(
                f"parallel layout: pp={pp} x dp_replicate={rep} x dp_shard={shard} x tp={tp} = "
                f"{pp * rep * shard * tp}, but the world size is {world_size} processes; the product must equal "
                "the number of processes (torchrun --nproc_per_node x nodes)")
        if ep < 1:
            raise ConfigError(f"config key 'parallel.ep' = {ep}: must be >= 1")
        if ep > 1 and getattr(section, "compile", False):
            # Dynamo passes the expert DTensors to _grouped_mm without GroupedExperts' to_local().
            raise ConfigError(f"config key 'parallel.compile' = true does not yet work with parallel.ep = {ep} "
                              "(expert-parallel weights under torch.compile); use parallel.compile = false or "
                              "parallel.ep = 1")
        if dims.dp % ep:
            raise ConfigError(
                f"config key 'parallel.ep' = {ep} must divide the data-parallel degree parallel.dp_replicate x "
                f"parallel.dp_shard = {rep} x {shard} = {dims.dp} (expert-parallel ranks are data-parallel ranks); "
                "change parallel.ep or parallel.dp_shard / the number of processes")
        return dims

    def check_model(self, model_config) -> None:
        """Shape constraints between the layout and the model, checked before any collective."""
        # The sizes a model's plans split, and whether it has plans at all, are its family's data
        # (model/*_tp.py); expert parallelism checks its own layer (expert_parallel.py).
        from trainforge.model.tp_plans import tp_refusal, tp_split_sizes
        from trainforge.parallel.expert_parallel import check_expert_layout

        if self.tp > 1:
            for what, size, why in tp_split_sizes(model_config):
                if size % self.tp:
                    raise ConfigError(f"config key 'parallel.tp' = {self.tp} must divide {what} = {size} ({why})")
        check_expert_layout(model_config, self.ep)
        refusal = tp_refusal(model_config) if self.tp > 1 else None
        if refusal:
            raise ConfigError(f"config key 'parallel.tp' = {self.tp}: {refusal}")
        if self.pp > model_config.n_layers:
            raise ConfigError(f"config key 'parallel.pp' = {self.pp} exceeds model.n_layers = "
                              f"{model_config.n_layers}: every stage needs at least one block")

    @property
    def dp(self) -> int:
        """Data-parallel degree: ranks that read different data."""
        return self.dp_replicate * self.dp_shard

    @property
    def edp(self) -> int:
        """Ranks holding the same experts (their expert gradients are summed): dp / ep."""
        return self.dp // self.ep

    def build_mesh(self, device_type: str) -> "ParallelMesh | None":
        """The 4-D mesh named by ``AXES`` plus a flattened ``dp`` mesh and, with ``ep`` > 1,
        ``dp`` unflattened to ``(edp, ep)`` (ep innermost: neighbouring ranks); None for one process."""
        if self.world_size == 1:
            return None
        world = init_device_mesh(device_type, (self.pp, self.dp_replicate, self.dp_shard, self.tp),
                                 mesh_dim_names=AXES)
        dp = world["dp_replicate", "dp_shard"]._flatten("dp")
        experts = dp._unflatten(0, (self.edp, self.ep), ("edp", "ep")) if self.ep > 1 else None
        return ParallelMesh(world, dp, experts)


@dataclass(frozen=True)
class ParallelMesh:
    """``world["tp"]``, ``world["pp"]``... are the per-axis sub-meshes; ``dp`` is
    dp_replicate x dp_shard flattened (data loading, loss averaging). The flattened mesh
    is kept here because slicing it from the root mesh is deprecated. ``experts``: the
    2-D ``(edp, ep)`` mesh over this rank's dp ranks (None unless ``ep`` > 1); ``mesh["ep"]``
    and ``mesh["edp"]`` are its axes."""

    world: DeviceMesh
    dp: DeviceMesh
    experts: DeviceMesh | None = None

    def __getitem__(self, axis: str | tuple[str, ...]) -> DeviceMesh:
        if axis == "dp":
            return self.dp
        if axis in ("ep", "edp"):
            assert self.experts is not None, "no expert-parallel mesh (parallel.ep = 1)"
            return self.experts[axis]
        return self.world[axis]

    def local_rank(self, axis: str) -> int:
        return self[axis].get_local_rank()


def dp_rank(mesh: "ParallelMesh | None") -> int:
    return 0 if mesh is None else mesh.dp.get_local_rank()

