"""The parallel layout: how many ways each mesh axis splits the world.

Axes, outermost first: ``pp`` (pipeline stages), ``dp_replicate`` (DDP / the
replicate axis of HSDP: inter-node), ``dp_shard`` (FSDP2: intra-node), ``tp``
(tensor parallel: innermost, so its heavy collectives stay on the fastest links).
Their product is the world size. Validation happens here, before any collective,
so a bad layout fails on every rank with the same message.
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
        dims = cls(pp, rep, shard, tp, world_size)
        if pp * rep * shard * tp != world_size:
            raise ConfigError(
                f"parallel layout: pp={pp} x dp_replicate={rep} x dp_shard={shard} x tp={tp} = "
                f"{pp * rep * shard * tp}, but the world size is {world_size} processes; the product must equal "
                "the number of processes (torchrun --nproc_per_node x nodes)")
        return dims

    def check_model(self, model_config) -> None:
        """Shape constraints between the layout and the model, checked before any collective."""
        if model_config.n_heads % self.tp or model_config.n_kv_heads % self.tp:
            raise ConfigError(
                f"config key 'parallel.tp' = {self.tp} must divide model.n_heads = {model_config.n_heads} and "
                f"model.n_kv_heads = {model_config.n_kv_heads} (each rank holds whole heads)")
        if model_config.ffn_hidden_dim % self.tp:
            raise ConfigError(f"config key 'parallel.tp' = {self.tp} must divide model.ffn_hidden_dim = "
                              f"{model_config.ffn_hidden_dim}")
        if self.pp > model_config.n_layers:
            raise ConfigError(f"config key 'parallel.pp' = {self.pp} exceeds model.n_layers = "
                              f"{model_config.n_layers}: every stage needs at least one block")

    @property
    def dp(self) -> int:
        """Data-parallel degree: ranks that read different data."""
        return self.dp_replicate * self.dp_shard

    def build_mesh(self, device_type: str) -> "ParallelMesh | None":
        """The 4-D mesh named by ``AXES`` plus a flattened ``dp`` mesh; None for one process."""
        if self.world_size == 1:
            return None
        world = init_device_mesh(device_type, (self.pp, self.dp_replicate, self.dp_shard, self.tp),
                                 mesh_dim_names=AXES)
        return ParallelMesh(world, world["dp_replicate", "dp_shard"]._flatten("dp"))


@dataclass(frozen=True)
class ParallelMesh:
    """``world["tp"]``, ``world["pp"]``... are the per-axis sub-meshes; ``dp`` is
    dp_replicate x dp_shard flattened (data loading, loss averaging). The flattened mesh
    is kept here because slicing it from the root mesh is deprecated."""

    world: DeviceMesh
    dp: DeviceMesh

    def __getitem__(self, axis: str | tuple[str, ...]) -> DeviceMesh:
        return self.dp if axis == "dp" else self.world[axis]

    def local_rank(self, axis: str) -> int:
        return self[axis].get_local_rank()


def dp_rank(mesh: "ParallelMesh | None") -> int:
    return 0 if mesh is None else mesh.dp.get_local_rank()

