"""Section + device -> resolved dtypes; FSDP2 mapping."""

from __future__ import annotations

import torch

from trainforge.precision.policy import build_policy, fsdp_fp32_modules, fsdp_fp32_policy, fsdp_mixed_precision
from trainforge.precision.section import PrecisionSection

CPU = torch.device("cpu")


def policy_for(cap, **changes):
    section = PrecisionSection(**changes)
    section.validate()
    return build_policy(section, CPU, capability=cap)


def test_fast_bf16_is_used_as_requested(capability):
    p = policy_for(capability(True, False), policy="bf16-mixed")
    assert (p.param_dtype, p.compute_dtype, p.reduce_dtype) == (torch.float32, torch.bfloat16, torch.float32)
    assert not p.loss_scaling and not p.master_weights and not p.notes
    # What autocast leaves fp32 (norm internals, residual stream) is saved in bf16; fp32 opts out.
    assert p.activation_dtype == torch.bfloat16 and p.recast_weights
    assert policy_for(capability(True, False), policy="bf16-mixed", activation_dtype="fp32").activation_dtype is None
    # Not under fp16 compute (range). Under dynamic, bf16 while no group is at fp32 (casting.py).
    assert policy_for(capability(True, True), policy="fp16-mixed").activation_dtype is None
    d = policy_for(capability(True, False), policy="dynamic")
    assert d.activation_dtype == torch.bfloat16 and d.activation_follows_levels
    d = policy_for(capability(True, False), policy="dynamic", activation_dtype="fp32")
    assert d.activation_dtype is None and not d.activation_follows_levels


def test_slow_bf16_keeps_fp32_compute_but_stores_activations_low(capability):
    p = policy_for(capability(False, False), policy="bf16-mixed", param_dtype="bf16")
    assert p.compute_dtype == torch.float32
    assert p.param_dtype == torch.float32  # bf16 weights would force bf16 matmuls
    assert p.activation_dtype == torch.bfloat16  # the memory saving stays
    assert not p.master_weights
    assert any("slower than fp32" in n for n in p.notes)
    forced = policy_for(capability(False, False), policy="bf16-mixed", param_dtype="bf16", force=True)
    assert (forced.compute_dtype, forced.param_dtype) == (torch.bfloat16, torch.bfloat16)
    assert forced.master_weights and forced.activation_dtype == torch.bfloat16


def test_fp16_enables_loss_scaling(capability):
    assert policy_for(capability(True, True), policy="fp16-mixed").loss_scaling
    assert not policy_for(capability(True, True), policy="bf16-mixed").loss_scaling
    # A GPU without bf16 gets fp16, and with it loss scaling.
    gpu = build_policy(PrecisionSection(policy="bf16-mixed"), CPU, capability=capability(False, True, "cuda"))
    assert gpu.compute_dtype == torch.float16 and gpu.loss_scaling


def test_dynamic_levels_skip_slow_dtypes(capability):
    p = policy_for(capability(True, False), policy="dynamic", dynamic_floor="fp16",
                   dynamic_groups="attn:layers.*.attention")
    assert p.dynamic and p.levels == (torch.bfloat16, torch.float32)
    assert not p.loss_scaling and p.groups == (("attn", ("layers.*.attention",)),)
    both = policy_for(capability(True, True), policy="dynamic", dynamic_floor="fp16")
    assert both.levels == (torch.float16, torch.bfloat16, torch.float32) and both.loss_scaling
    cpu_slow = policy_for(capability(False, False), policy="dynamic")
    assert cpu_slow.levels == (torch.float32,) and cpu_slow.compute_dtype == torch.float32


def test_fsdp_mapping(capability, debug_model):
    mixed = policy_for(capability(True, False), policy="bf16-mixed", reduce_dtype="fp32")
    mp = fsdp_mixed_precision(mixed)
    assert (mp.param_dtype, mp.reduce_dtype) == (torch.bfloat16, torch.float32)
    assert fsdp_fp32_policy(mixed).param_dtype == torch.float32
    fp32_units = fsdp_fp32_modules(debug_model, mixed)
    norms = [debug_model.norm] + [m for b in debug_model.layers.values() for m in (b.attention_norm, b.ffn_norm)]
    assert sorted(map(id, fp32_units)) == sorted(map(id, norms))
    # Dynamic: gather fp32 (a group switched to fp32 needs fp32 weights); nothing extra to shard.
    dyn = policy_for(capability(True, False), policy="dynamic")
    assert fsdp_mixed_precision(dyn).param_dtype is None and fsdp_fp32_modules(debug_model, dyn) == []
