"""Make a model ready for the engine, from outside: the inference module swaps, in order.

``prepare_model(model, fuse=True, quant_kernel=None)`` puts the model in eval mode, applies
the fusion rules (``fusion.py``: QKV, gate+up, add+RMSNorm, then row-block linears on
CPU) and builds every quantised layer's kernel form (``quantize.pack_quantized``), then sets the
block kernels' prefetch by whether the weights fit the CPU's cache (``cpu_kernels/residency.py``). Fusion
runs first because quantised layers concatenate only before packing. The engine
(``engine.py``) takes the model as it is and never changes it; ``describe_model`` reports
what was applied.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from trainforge.infer.cpu_kernels import residency
from trainforge.infer.fusion import fuse_model, row_block_linears
from trainforge.infer.quantize import QuantExperts, QuantLinear, pack_quantized
from trainforge.model.fused import FusedAttention, FusedFeedForward, FusedTransformerBlock


@torch.no_grad()
def prepare_model(model: nn.Module, fuse: bool = True, quant_kernel: str | None = None) -> nn.Module:
    """Mutates and returns ``model``: eval mode, fused (``fuse``), quantised layers packed
    for ``quant_kernel`` (None = each layer's own choice)."""
    model.eval()
    if fuse:
        fuse_model(model)
        if model.tok_embeddings.weight.device.type == "cpu":
            row_block_linears(model)
    pack_quantized(model, quant_kernel)
    residency.apply(model)
    return model


def describe_model(model: nn.Module) -> dict[str, Any]:
    """{"fusions": {qkv, gate_up, add_norm: count}, "quant_kernels": {kernel: count}}: the
    inference swaps ``model`` carries (read only); quantised experts count as "<kernel> (experts)"."""
    kinds = {"qkv": FusedAttention, "gate_up": FusedFeedForward, "add_norm": FusedTransformerBlock}
    mods = list(model.modules())
    fusions = {k: sum(isinstance(m, cls) for m in mods) for k, cls in kinds.items()}
    kernels: dict[str, int] = {}
    for m in mods:
        if isinstance(m, (QuantLinear, QuantExperts)):
            name = (m.kernel_name or "unpacked") + (" (experts)" if isinstance(m, QuantExperts) else "")
            kernels[name] = kernels.get(name, 0) + 1
    return {"fusions": fusions if any(fusions.values()) else {}, "quant_kernels": kernels}
