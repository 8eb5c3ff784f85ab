"""The startup summary: what is about to be trained, in words, one line per topic
(model, layout, precision, data, steps, MFU peak). Rank 0 logs it once, when everything
has loaded. Values in, text out: no object's repr (``ParallelDims(...)``) reaches the log.

Sample (one process, ``--model.flavor debug``)::

    model: debug, 0.16M parameters, vocab 512
    flops: 0.85M training FLOPs/token at seq_len 64
    layout: single process, no parallelism (cpu)
    precision: fp32 (params fp32, compute fp32, reduce fp32, optimizer state fp32)
    data: /data/stdlib-v512 (107,597 train tokens); seq_len 64, batch 8 = 512 tokens/step
    steps: 10 (5,120 tokens, 0.05 epochs); lr 0.001 cosine, warmup 5
    mfu peak: 145 GFLOP/s, measured: best of 5 fp32 matmul probes
"""

from __future__ import annotations

from typing import Any

from trainforge.parallel.data_parallel import data_parallel_kind
from trainforge.parallel.dims import AXES, ParallelDims


def layout_text(dims: ParallelDims, device_type: str) -> str:
    """``FSDP2 over 4 ranks, TP 2: 8 ranks (pp 1 x dp_replicate 1 x dp_shard 4 x tp 2, cuda)``."""
    if dims.world_size == 1:
        return f"single process, no parallelism ({device_type})"
    kind = data_parallel_kind(dims)
    parts = {"ddp": [f"DDP over {dims.dp} ranks"], "fsdp": [f"FSDP2 over {dims.dp_shard} ranks"],
             "hsdp": [f"HSDP over {dims.dp_replicate} x {dims.dp_shard} ranks (FSDP2, replicate x shard)"],
             }.get(kind, [])
    parts += [f"{name} {n}" for name, n in (("TP", dims.tp), ("PP", dims.pp), ("EP", dims.ep)) if n > 1]
    axes = " x ".join(f"{axis} {getattr(dims, axis)}" for axis in AXES)
    # The rank count, unless the one data-parallel part already gives it.
    ranks = "" if len(parts) == 1 and kind != "none" else f": {dims.world_size} ranks"
    return f"{', '.join(parts)}{ranks} ({axes}, {device_type})"


def batch_text(tcfg: Any, dp: int, tokens_per_step: int) -> str:
    """``seq_len 64, batch 8 x 2 accum x 4 dp = 4,096 tokens/step`` (factors of 1 left out)."""
    factors = [f"{tcfg.batch_size}"]
    if tcfg.grad_accum_steps > 1:
        factors.append(f"{tcfg.grad_accum_steps} accum")
    if dp > 1:
        factors.append(f"{dp} dp")
    return f"seq_len {tcfg.seq_len}, batch {' x '.join(factors)} = {tokens_per_step:,} tokens/step"


def startup_summary(*, model_name: str, params_text: str, vocab_size: int, dims: ParallelDims, device_type: str,
                    precision_preset: str, precision_text: str, data_label: str, train_tokens: int, tcfg: Any,
                    tokens_per_step: int, start_step: int, peak_text: str, flops_text: str | None = None,
                    lr_text: str | None = None) -> list[str]:
    """The summary's lines. ``tcfg``: the ``[training]`` section; ``params_text``:
    ``ModelConfig.describe_params()``; ``precision_text``: ``PrecisionPolicy.describe()``;
    ``peak_text``: ``PeakFlops.describe()``; ``flops_text``: ``ModelConfig.describe_flops(seq_len)``
    (per stage for an hourglass model), a line of its own after the model's when given; ``lr_text``:
    the LR's batch-size rule in words (``plan.lr_scaling.describe_scaling``), after the steps' line."""
    total_tokens = tcfg.steps * tokens_per_step
    epochs = f", {total_tokens / train_tokens:.2f} epochs" if train_tokens else ""
    resumed = f", from step {start_step}" if start_step else ""
    return [
        f"model: {model_name}, {params_text}, vocab {vocab_size:,}",
        *([f"flops: {flops_text}"] if flops_text else []),
        f"layout: {layout_text(dims, device_type)}",
        f"precision: {precision_preset} ({precision_text})",
        f"data: {data_label} ({train_tokens:,} train tokens); {batch_text(tcfg, dims.dp, tokens_per_step)}",
        f"steps: {tcfg.steps:,} ({total_tokens:,} tokens{epochs}){resumed}; lr {tcfg.lr:g} {tcfg.lr_schedule}, "
        f"warmup {tcfg.warmup_steps}",
        *([lr_text] if lr_text else []),
        f"mfu peak: {peak_text}",
    ]
