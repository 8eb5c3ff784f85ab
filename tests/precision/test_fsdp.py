"""The policy under FSDP2 (one process, world size 1, gloo): blocks gathered in bf16,
fp32-rule modules sharded as their own fp32 units, gradients reduced in fp32."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

from trainforge.parallel.tensor_parallel import cross_entropy_loss
from trainforge.precision.casting import apply_precision
from trainforge.precision.policy import build_policy, fsdp_fp32_modules, fsdp_fp32_policy, fsdp_mixed_precision
from trainforge.precision.section import DEFAULT_FP32_MODULES, PrecisionSection


@pytest.fixture
def mesh():
    if dist.is_initialized():
        pytest.skip("a process group already exists in this process")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield init_device_mesh("cpu", (1,))
    finally:
        dist.destroy_process_group()


def test_fsdp2_keeps_fp32_modules_in_fp32(mesh, capability, debug_model, tokens):
    # layers.1.feed_forward stands in for a router: an fp32 module holding matmuls.
    section = PrecisionSection(policy="bf16-mixed", fp32_modules=DEFAULT_FP32_MODULES + ",layers.1.feed_forward")
    section.validate()
    policy = build_policy(section, "cpu", capability=capability(True, False))
    runtime = apply_precision(debug_model, policy, sharded=True)
    assert runtime.master is None
    for module in fsdp_fp32_modules(debug_model, policy):  # before the blocks that contain them
        fully_shard(module, mesh=mesh, mp_policy=fsdp_fp32_policy(policy))
    for block in debug_model.layers.values():
        fully_shard(block, mesh=mesh, mp_policy=fsdp_mixed_precision(policy))
    fully_shard(debug_model, mesh=mesh, mp_policy=fsdp_mixed_precision(policy))

    seen: dict[str, torch.dtype] = {}
    for fqn, module in debug_model.named_modules():
        if fqn:
            module.register_forward_hook(lambda m, a, out, fqn=fqn: seen.__setitem__(fqn, out.dtype))
    with runtime.autocast():
        logits = debug_model(tokens[:, :-1])
    cross_entropy_loss(logits, tokens[:, 1:]).backward()

    assert seen["layers.0.attention_norm"] == seen["norm"] == torch.float32
    assert seen["layers.1.feed_forward.w1"] == torch.float32
    assert seen["layers.0.feed_forward.w1"] == seen["layers.1.attention.wq"] == torch.bfloat16
    wq = debug_model.layers["0"].attention.wq.weight
    assert isinstance(wq, DTensor) and wq.dtype == torch.float32  # sharded fp32 master weights
    assert wq.grad.dtype == torch.float32  # reduced in reduce_dtype


def test_saved_activations_are_counted_the_same_under_fsdp2(mesh, debug_model, tokens):
    """Sharded parameters are DTensors with no storage of their own: the activation
    counter (and the low-precision packing) works on local shards, and the weights
    FSDP2 gathers for the forward are still not counted as activations."""
    from trainforge.precision.activations import SavedActivations
    from trainforge.precision.memory import measure_activation_bytes

    forward = lambda: debug_model(tokens[:, :-1])  # noqa: E731
    plain = measure_activation_bytes(debug_model, forward)
    packed = measure_activation_bytes(debug_model, forward, SavedActivations(debug_model, torch.bfloat16))
    for block in debug_model.layers.values():
        fully_shard(block, mesh=mesh)
    fully_shard(debug_model, mesh=mesh)
    assert isinstance(debug_model.output.weight, DTensor)
    assert measure_activation_bytes(debug_model, forward) == plain
    assert measure_activation_bytes(debug_model, forward, SavedActivations(debug_model, torch.bfloat16)) == packed
