"""Mixed precision, applied from outside the model. One technique per file:

- ``section.py``        ``[precision]`` config (presets, overrides, thresholds), validated at the edge
- ``hardware.py``       is bf16/fp16 faster than fp32 here? CPU flags + cached measured probe; CUDA support
- ``policy.py``         section + device -> ``PrecisionPolicy`` (resolved dtypes); FSDP2 ``MixedPrecisionPolicy``
- ``casting.py``        ``apply_precision``: parameter storage casts, fp32 module rules, switchable groups, autocast
- ``master_weights.py`` fp32 master copy when parameters are stored in bf16/fp16 (single device / DDP)
- ``activations.py``    saved-for-backward activations: low-precision storage, weights recast in
                        backward instead of kept, one copy per cast, byte counting
- ``loss_scale.py``     fp16 loss scaling (``torch.amp.GradScaler``) with a skipped-step counter
- ``dynamic.py``        controller switching groups between fp16 / bf16 / fp32 with hysteresis
- ``memory.py``         bytes per dtype of params, grads, optimizer state, activations; peak memory

Order in the trainer: ``build_policy`` -> ``apply_precision`` (before TP, activation
checkpointing, compile and FSDP) -> build optimizers (on ``runtime.master.module`` when
there are master weights) -> per step ``runtime.autocast()`` around the forward,
``LossScaler`` around backward/step, ``PrecisionController.observe`` at its interval.
"""

import importlib

# Resolved lazily (PEP 562), so ``trainforge.config`` can import ``precision.section``
# without pulling in torch.distributed or creating an import cycle through this file.
_EXPORTS = {
    "PrecisionRuntime": "casting", "apply_precision": "casting", "autocast_context": "casting",
    "DynamicThresholds": "dynamic", "PrecisionController": "dynamic", "StepSignals": "dynamic",
    "Switch": "dynamic", "build_controller": "dynamic",
    "Capability": "hardware", "detect_capability": "hardware", "resolve_compute_dtype": "hardware",
    "LossScaler": "loss_scale",
    "MemoryReport": "memory", "measure_activation_bytes": "memory", "memory_report": "memory",
    "PrecisionPolicy": "policy", "build_policy": "policy", "fsdp_fp32_modules": "policy",
    "fsdp_fp32_policy": "policy", "fsdp_mixed_precision": "policy",
    "PrecisionSection": "section",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(f"trainforge.precision.{_EXPORTS[name]}"), name)
    raise AttributeError(f"module 'trainforge.precision' has no attribute {name!r}")
