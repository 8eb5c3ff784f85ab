"""apply_precision: named modules run in fp32, the rest in the compute dtype (observed
with forward hooks on the real model); groups switch; master weights keep small updates."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from trainforge.parallel.tensor_parallel import cross_entropy_loss
from trainforge.precision.casting import apply_precision, autocast_context
from trainforge.precision.policy import build_policy
from trainforge.precision.section import DEFAULT_FP32_MODULES, PrecisionSection

CPU = torch.device("cpu")


def make_policy(cap, **changes):
    section = PrecisionSection(**changes)
    section.validate()
    return build_policy(section, CPU, capability=cap)


def record_output_dtypes(model: nn.Module) -> dict[str, torch.dtype]:
    seen: dict[str, torch.dtype] = {}
    for fqn, module in model.named_modules():
        if fqn:
            module.register_forward_hook(lambda m, a, out, fqn=fqn: seen.__setitem__(fqn, out.dtype))
    return seen


def test_named_modules_run_in_fp32_the_rest_in_bf16(capability, debug_model, tokens):
    # Pure bf16 weights make the residual stream bf16, so a norm left alone would compute in
    # bf16; layers.1.feed_forward is added to the default rules to see a Linear kept in fp32.
    policy = make_policy(capability(True, False), policy="bf16-mixed", param_dtype="bf16",
                         fp32_modules=DEFAULT_FP32_MODULES + ",layers.1.feed_forward")
    runtime = apply_precision(debug_model, policy)
    seen = record_output_dtypes(debug_model)
    with runtime.autocast():
        logits = debug_model(tokens[:, :-1])
        inside = cross_entropy_loss(logits, tokens[:, 1:])
    loss = cross_entropy_loss(logits, tokens[:, 1:])
    assert inside.dtype == torch.float32  # fp32 whether or not the trainer computes it under autocast

    norms = [f for f, m in debug_model.named_modules() if type(m).__name__ == "RMSNorm"]
    assert len(norms) == 5
    for fqn in norms:
        assert seen[fqn] == torch.float32, fqn
        assert debug_model.get_submodule(fqn).weight.dtype == torch.float32, fqn
    for name in ("w1", "w2", "w3"):
        assert seen[f"layers.1.feed_forward.{name}"] == torch.float32
        assert seen[f"layers.0.feed_forward.{name}"] == torch.bfloat16
    for layer in ("0", "1"):
        for name in ("wq", "wk", "wv", "wo"):
            assert seen[f"layers.{layer}.attention.{name}"] == torch.bfloat16
    assert seen["output"] == torch.bfloat16 and debug_model.output.weight.dtype == torch.bfloat16
    assert debug_model.rope_cos.dtype == torch.float32  # buffers are never cast: rotary stays fp32
    assert loss.dtype == torch.float32 and torch.isfinite(loss)
    loss.backward()
    assert debug_model.layers["0"].ffn_norm.weight.grad.dtype == torch.float32
    assert debug_model.layers["0"].attention.wq.weight.grad.dtype == torch.bfloat16


def test_without_the_rules_the_norm_would_run_in_bf16(capability, debug_model, tokens):
    """The control for the test above: same weights, no fp32 rules."""
    policy = make_policy(capability(True, False), policy="bf16-mixed", param_dtype="bf16", fp32_modules="")
    runtime = apply_precision(debug_model, policy)
    seen = record_output_dtypes(debug_model)
    with runtime.autocast():
        debug_model(tokens[:, :-1])
    assert seen["layers.0.attention_norm"] == torch.bfloat16
    assert debug_model.norm.weight.dtype == torch.bfloat16


def test_groups_switch_between_steps(capability, debug_model, tokens):
    policy = make_policy(capability(True, False), policy="dynamic", dynamic_groups="attn:layers.*.attention")
    runtime = apply_precision(debug_model, policy)
    assert runtime.group_modules["attn"] == ["layers.0.attention", "layers.1.attention"]
    params = runtime.group_parameters()
    attn = [p for b in debug_model.layers.values() for p in b.attention.parameters()]
    assert sorted(map(id, params["attn"])) == sorted(map(id, attn))
    assert len(params["model"]) + len(attn) == len(list(debug_model.parameters()))
    seen = record_output_dtypes(debug_model)

    def forward():
        seen.clear()
        with runtime.autocast():
            debug_model(tokens[:, :-1])
        return seen["layers.0.attention.wq"], seen["layers.0.feed_forward.w1"]

    # Saved activations: bf16 storage while every group is low, as computed once one is fp32.
    assert forward() == (torch.bfloat16, torch.bfloat16)
    assert runtime.activations.store_dtype == torch.bfloat16
    runtime.set_compute_dtype("attn", "fp32")
    assert forward() == (torch.float32, torch.bfloat16)
    assert runtime.activations.store_dtype is None
    runtime.set_compute_dtype("model", torch.float32)
    runtime.set_compute_dtype("attn", "bf16")
    assert forward() == (torch.bfloat16, torch.float32)
    assert runtime.activations.store_dtype is None
    runtime.set_compute_dtype("model", "bf16")
    assert runtime.activations.store_dtype == torch.bfloat16
    assert seen["layers.0.attention"] == torch.float32  # a bf16 group hands fp32 back to an fp32 model
    with pytest.raises(KeyError, match="unknown precision group"):
        runtime.set_compute_dtype("mlp", "fp32")


class Boom(nn.Module):
    def forward(self, x):
        raise RuntimeError("boom")


def test_autocast_state_restored_when_an_fp32_module_raises(capability):
    model = nn.Sequential(nn.Linear(4, 4), Boom())
    runtime = apply_precision(model, make_policy(capability(True, False), policy="bf16-mixed",
                                                 fp32_modules="Boom"))
    assert runtime.fp32_modules == ["1"]
    with autocast_context(torch.bfloat16, "cpu"):
        with pytest.raises(RuntimeError, match="boom"):
            model(torch.randn(2, 4))
        assert torch.is_autocast_enabled("cpu")  # the hook turned it off; it must be back on
        assert model[0](torch.randn(2, 4)).dtype == torch.bfloat16


def test_rules_keep_parameter_names_follow_deep_copies_and_come_off(capability, debug_model, tokens):
    """The fp32 rule wraps ``forward`` in place: no wrapper module in the state-dict keys;
    a deep copy (a pipeline stage) runs its own norm under the rule; ``remove`` restores."""
    import copy

    keys = list(debug_model.state_dict())
    runtime = apply_precision(debug_model, make_policy(capability(True, False), policy="bf16-mixed"))
    assert "norm" in runtime.fp32_modules and list(debug_model.state_dict()) == keys
    stage = copy.deepcopy(debug_model)
    x = torch.randn(2, 4, 64, dtype=torch.bfloat16)
    with autocast_context(torch.bfloat16, "cpu"):
        ruled = stage.norm(x)
        runtime.remove()
        assert "forward" not in debug_model.norm.__dict__ and stage.norm.forward.__self__ is stage.norm
        # The copy's rule ran: x cast to fp32 first, so nothing inside was rounded to bf16.
        torch.testing.assert_close(ruled, debug_model.norm(x.float()), rtol=0, atol=0)
        assert not torch.equal(debug_model.norm(x), ruled)  # no rule: RMSNorm rounds back to bf16


def test_master_weights_keep_updates_bf16_would_round_away(capability):
    """lr * grad = 1e-3 on a weight of 1.0: below bf16's resolution (2**-7), so pure bf16
    weights never move; with fp32 master weights ten steps move them by 0.01."""
    def train(optimizer_state_dtype):
        model = nn.Sequential(nn.Linear(8, 8, bias=False))
        nn.init.ones_(model[0].weight)
        policy = make_policy(capability(True, False), policy="bf16-mixed", param_dtype="bf16",
                             optimizer_state_dtype=optimizer_state_dtype, fp32_modules="")
        runtime = apply_precision(model, policy)
        assert model[0].weight.dtype == torch.bfloat16
        master = runtime.master
        params = master.module.parameters() if master else model.parameters()
        opt = torch.optim.SGD(params, lr=1e-3)
        for _ in range(10):
            model[0].weight.grad = torch.ones_like(model[0].weight)
            if master:
                master.grads_to_master()
            opt.step()
            opt.zero_grad(set_to_none=True)
            if master:
                master.master_to_model()
        return model[0].weight.float(), master

    pure, no_master = train("bf16")
    assert no_master is None and torch.equal(pure, torch.ones(8, 8))
    mixed, master = train("fp32")
    assert master.module[0].weight.dtype == torch.float32
    torch.testing.assert_close(master.module[0].weight, torch.full((8, 8), 0.99), rtol=0, atol=1e-6)
    assert torch.equal(mixed, torch.full((8, 8), 0.99).bfloat16().float())  # 0.98828125
