"""The parallel layout: how many ways each mesh axis splits the world.

Axes, outermost first: ``pp`` (pipeline stages), ``dp_replicate`` (DDP / the
replicate axis of HSDP: inter-node), ``dp_shard`` (FSDP2: intra-node), ``tp``
(tensor parallel: innermost, so its heavy collectives stay on the fastest links).
Their product is the world size. ``ep`` (expert parallel) is not a fifth axis: it splits
the data-parallel ranks (dp = dp_replicate x dp_shard, flattened) into groups of ``ep``
neighbouring ranks that share one MoE layer's experts; ``edp`` = dp / ep ranks hold the
same experts (torchtitan / DeepSeek-V3: expert-parallel ranks read different data too).
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
        mla = getattr(model_config, "is_mla", False)
        if mla and model_config.n_heads % self.tp:
            # Latent attention has no separate KV heads: one latent and one rotary key serve all heads.
            raise ConfigError(f"config key 'parallel.tp' = {self.tp} must divide model.n_heads = "
                              f"{model_config.n_heads} (each rank holds whole heads)")
        if not mla and (model_config.n_heads % self.tp or model_config.n_kv_heads % self.tp):
            raise ConfigError(
                f"config key 'parallel.tp' = {self.tp} must divide model.n_heads = {model_config.n_heads} and "
                f"model.n_kv_heads = {model_config.n_kv_heads} (each rank holds whole heads)")
        if model_config.ffn_hidden_dim % self.tp:
            raise ConfigError(f"config key 'parallel.tp' = {self.tp} must divide model.ffn_hidden_dim = "
                              f"{model_config.ffn_hidden_dim}")
        for r in sorted({s.width_ratio for s in getattr(model_config, "hourglass_stages", ())} - {1}):
            if (model_config.ffn_hidden_dim // r) % self.tp:
                raise ConfigError(f"config key 'parallel.tp' = {self.tp} must divide the feed-forward width "
                                  f"model.ffn_hidden_dim / {r} = {model_config.ffn_hidden_dim // r} of the "
                                  f"model.hourglass stages at width_ratio {r}")
        if self.ep > 1 and not model_config.is_moe:
            raise ConfigError(f"config key 'parallel.ep' = {self.ep} needs a mixture-of-experts model "
                              "(model.n_routed_experts > 0, e.g. model.flavor = moe-debug); use parallel.ep = 1")
        if self.ep > 1 and model_config.n_routed_experts % self.ep:
            raise ConfigError(f"config key 'parallel.ep' = {self.ep} must divide model.n_routed_experts = "
                              f"{model_config.n_routed_experts} (each rank holds the same number of experts)")
        if model_config.is_moe and self.tp > 1:
            raise ConfigError(f"config key 'parallel.tp' = {self.tp}: tensor parallelism of mixture-of-experts "
                              "blocks is not supported (the TP plans shard dense feed-forwards); use parallel.tp = 1 "
                              "and split the experts with parallel.ep")
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

