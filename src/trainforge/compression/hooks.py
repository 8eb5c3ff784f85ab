"""Where compression meets the data-parallel wrappers.

- DDP: ``register_ddp_hook`` installs a communication hook that replaces each
  bucket's all-reduce with the compressed one.
- HSDP: FSDP2 shards over ``dp_shard`` only (a 1-D mesh) and ``register_fsdp_hooks``
  gives every FSDP unit an all-reduce hook that averages its reduce-scatter output
  over ``dp_replicate`` compressed. Shards stay in fp32 within a node (fast links);
  only the inter-node axis, where bandwidth is scarce, carries compressed bytes. It
  composes with TP (the hook sees the local shard) and PP (each stage's units hook).
- PowerSGD: PyTorch's own hook, as a baseline; DDP only.
- Host reduce (``compression.host_reduce``): the DDP hook, or under HSDP FSDP2's
  all-reduce hook, hands gradients to a host thread (``host_reduce.py``).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from trainforge.compression.collective import ring_all_reduce_bytes
from trainforge.compression.compressor import GradientCompressor
from trainforge.compression.section import CompressionSection
from trainforge.errors import ConfigError


def check_compression(section: CompressionSection, dims, kind: str, precision: str = "fp32") -> str | None:
    """Validate ``[compression]`` against the layout before any collective.
    ``kind``: the data-parallel kind (none, ddp, fsdp, hsdp); ``precision``: the
    ``precision.policy`` preset. Returns a warning when compression is configured but
    has nothing to compress."""
    if section.host_reduce:
        return _check_host_reduce(section, dims, kind, precision)
    if section.codec == "none":
        return None
    if dims.dp_replicate == 1:
        return (f"compression.codec = {section.codec!r} has no effect: it compresses the dp_replicate axis and "
                "parallel.dp_replicate = 1 (set --parallel.dp_replicate N, e.g. one per node)")
    if section.codec == "powersgd" and kind != "ddp":
        raise ConfigError(f"config key 'compression.codec' = 'powersgd' works with plain DDP only (layout is "
                          f"{kind}: parallel.dp_shard, tp and pp must be 1); use int4 or adaptive with "
                          "FSDP/HSDP, TP or PP")
    return None


def _check_host_reduce(section: CompressionSection, dims, kind: str, precision: str) -> str | None:
    if dims.dp_replicate == 1:
        return ("compression.host_reduce = true has no effect: it reduces over the dp_replicate axis and "
                "parallel.dp_replicate = 1 (set --parallel.dp_replicate N, e.g. one per node)")
    if kind not in ("ddp", "hsdp") or dims.tp > 1 or dims.pp > 1:
        raise ConfigError(f"config key 'compression.host_reduce' = true works with DDP or HSDP only (layout is "
                          f"{kind} with tp {dims.tp}, pp {dims.pp}: parallel.tp and parallel.pp must be 1); set "
                          "compression.host_reduce = false to compress on the device under TP or PP")
    if section.host_reduce_delay == 1 and precision in ("fp16-mixed", "dynamic"):
        # The loss scale of step t-1's gradient is not the one step t unscales with.
        raise ConfigError(f"config key 'compression.host_reduce_delay' = 1 does not work with precision.policy = "
                          f"{precision!r} (loss scaling would unscale a gradient scaled one step earlier); use "
                          "compression.host_reduce_delay = 0, or precision.policy = 'bf16-mixed' or 'fp32'")
    return None


def build_compressor(section: CompressionSection, dims, group: dist.ProcessGroup | None, device: torch.device,
                     seed: int, log=None, micro_batches: int = 1):
    """The compressor for the dp_replicate ``group`` (None when there is nothing to do).
    With ``host_reduce`` (collective: it makes the host thread's gloo groups), a
    ``HostReduce``; ``micro_batches``: the trainer's ``grad_accum_steps``."""
    if section.host_reduce and dims.dp_replicate > 1 and group is not None:
        from trainforge.compression.host_reduce import HostReduce, host_process_group

        inner = GradientCompressor(section, host_process_group(dims), torch.device("cpu"), seed=seed, log=log)
        # Under HSDP FSDP2's hooks see each micro-batch's reduced shard, not the accumulated one.
        return HostReduce(inner, section.host_reduce_delay, device, micro_batches, per_micro_batch=dims.dp_shard > 1)
    if section.codec == "none" or dims.dp_replicate == 1 or group is None:
        return None
    if section.codec == "powersgd":
        return PowerSGDBaseline(group, section.powersgd_rank, section.warmup_steps)
    return GradientCompressor(section, group, device, seed=seed, log=log)


def attach_to_ddp(model: DistributedDataParallel, compressor, device: torch.device) -> None:
    if isinstance(compressor, PowerSGDBaseline):
        model.register_comm_hook(compressor, _powersgd_hook)
        return
    if getattr(compressor, "delay", None) == 0:  # HostReduce: DDP waits for the host thread's futures
        model.register_comm_hook(compressor, _host_async_hook)
        prime_ddp_buckets(model, compressor, device)
        return
    register_ddp_hook(model, compressor)
    prime_ddp_buckets(model, compressor, device)


def _ddp_hook(compressor, bucket):  # no annotations: DDP compares them to the real types, and
    # ``from __future__ import annotations`` turns them into strings.
    # The collective runs blocking here and the hook returns a finished future: gloo
    # hangs when a second collective is launched from a future callback (>1 bucket).
    out = compressor.all_reduce_mean(f"ddp.{bucket.index()}", bucket.buffer())
    fut: torch.futures.Future[torch.Tensor] = torch.futures.Future()
    fut.set_result(out)
    return fut


def _host_async_hook(reducer, bucket):  # unannotated: see _ddp_hook
    # The host thread runs the collective on its own gloo group, not in a future callback.
    return reducer.reduce_async(f"ddp.{bucket.index()}", bucket.buffer())


def _powersgd_hook(baseline, bucket):  # unannotated: see _ddp_hook
    return baseline.reduce(bucket)


def register_ddp_hook(model: DistributedDataParallel, compressor: GradientCompressor) -> None:
    model.register_comm_hook(compressor, _ddp_hook)


def prime_ddp_buckets(model: DistributedDataParallel, compressor: GradientCompressor,
                      device: torch.device) -> None:
    """Run one forward/backward on a dummy batch without communicating, so DDP fixes its
    bucket layout now. DDP re-buckets once, after its first backward, in gradient-ready
    order; without priming a resumed run's first step would use the initial layout, and
    residuals (keyed by bucket) and chunk boundaries would differ from the uninterrupted
    run's. Weights, RNG and data position are untouched."""
    compressor.bypass = True
    try:
        tokens = torch.zeros(1, 2, dtype=torch.long, device=device)
        model(tokens).float().sum().backward()
    finally:
        compressor.bypass = False
        model.zero_grad(set_to_none=True)


def register_fsdp_hooks(modules: list[tuple[str, nn.Module]], compressor: GradientCompressor) -> None:
    """``modules``: (name, FSDP unit) pairs; the name keys the unit's compression state."""
    for name, module in modules:
        key = f"fsdp.{name or 'root'}"

        def hook(reduce_output: torch.Tensor, key: str = key) -> None:
            reduce_output.copy_(compressor.all_reduce_mean(key, reduce_output))

        module.set_all_reduce_hook(hook)


class PowerSGDBaseline:
    """PyTorch's ``powerSGD_hook`` with byte accounting (not re-implemented).

    Bytes are counted from the algorithm: per bucket, the all-reduces of the P and Q
    factors of each matrix (rank r: (rows + cols) x r values) and of the vectors it
    leaves uncompressed, at ring all-reduce cost; the first ``warmup_steps`` send the
    whole bucket. Its state is not checkpointed: a resumed run restarts its warm-up."""

    needs_single_bucket = True  # it launches a collective from a future callback (gloo hangs otherwise)

    def __init__(self, group: dist.ProcessGroup, rank: int, warmup_steps: int):
        from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as psgd

        self._hook = psgd.powerSGD_hook
        # start_powerSGD_iter >= 2: DDP re-buckets after the first step (PyTorch's note).
        self.state = psgd.PowerSGDState(process_group=group, matrix_approximation_rank=rank,
                                        start_powerSGD_iter=max(2, warmup_steps), use_error_feedback=True,
                                        warm_start=True)
        self.group, self.rank = group, rank
        self.step = 0
        self._bytes, self._ref, self._steps = 0.0, 0.0, 0

    def reduce(self, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        n = self.group.size()
        ref = ring_all_reduce_bytes(bucket.buffer().numel(), n)
        if self.state.iter < self.state.start_powerSGD_iter:
            sent = ref
        else:
            values = 0
            for g in bucket.gradients():
                values += (g.shape[0] + g[0].numel()) * self.rank if g.dim() > 1 else g.numel()
            sent = ring_all_reduce_bytes(values, n)
        self._bytes += sent
        self._ref += ref
        return self._hook(self.state, bucket)

    def end_step(self) -> None:
        self.step += 1
        self._steps += 1

    def window_stats(self) -> dict:
        steps = max(1, self._steps)
        stats = {"wire_bytes_per_step": self._bytes / steps,
                 "wire_ratio_vs_fp32": self._bytes / self._ref if self._ref else 1.0}
        self._bytes, self._ref, self._steps = 0.0, 0.0, 0
        return stats

    def state_dict(self) -> dict:
        return {"step": self.step}

    def load_state_dict(self, state: dict) -> str | None:
        return "powersgd state is not checkpointed: its warm-up restarts on resume"

