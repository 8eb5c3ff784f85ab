"""What bf16 autocast keeps for backward: weights recast instead of saved (exact),
one saved copy per cast activation (exact), fp32 modules' saved tensors stored in
bf16 with fp32 compute (parity within bf16 rounding), the loss's saved tensors fp32."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from trainforge.parallel.tensor_parallel import cross_entropy_loss
from trainforge.precision.casting import apply_precision, autocast_context
from trainforge.precision.memory import measure_activation_bytes
from trainforge.precision.policy import build_policy
from trainforge.precision.section import PrecisionSection


def _copy(model: nn.Module) -> nn.Module:
    fresh = type(model)(model.cfg)
    fresh.load_state_dict(model.state_dict(), strict=False)
    fresh.rope_cos.copy_(model.rope_cos)
    fresh.rope_sin.copy_(model.rope_sin)
    return fresh


def _run(debug_model, tokens, capability, **overrides):
    """(loss, grads, bytes saved by the model's forward, bytes saved by forward + loss)."""
    model = _copy(debug_model)
    section = PrecisionSection(policy="bf16-mixed", **overrides)
    section.validate()
    runtime = apply_precision(model, build_policy(section, "cpu", capability=capability(True, False)))
    with runtime.autocast(track_activations=True):
        loss = cross_entropy_loss(model(tokens[:, :-1]), tokens[:, 1:])
    with_loss = dict(runtime.activations.bytes_by_dtype)
    loss.backward()
    with autocast_context(torch.bfloat16, "cpu", cache_enabled=not runtime.activations.recast_weights):
        model_only = measure_activation_bytes(model, lambda: model(tokens[:, :-1]), runtime.activations)
    return loss.detach(), {n: p.grad for n, p in model.named_parameters()}, model_only, with_loss


def test_recast_weights_are_exact_and_save_every_matmul_weight_copy(debug_model, tokens, capability):
    """Recasting in backward is the same rounding of the same weight: loss and gradients
    bit-identical (rtol = atol = 0). Saved bytes drop by exactly the bf16 copies of the
    matmul weights (every Linear; the embedding lookup is not autocast)."""
    loss_k, grads_k, saved_k, _ = _run(debug_model, tokens, capability, recast_weights=False)
    loss_r, grads_r, saved_r, _ = _run(debug_model, tokens, capability)
    torch.testing.assert_close(loss_r, loss_k, rtol=0, atol=0)
    for name, g in grads_k.items():
        torch.testing.assert_close(grads_r[name], g, rtol=0, atol=0, msg=name)
    linear_numel = sum(m.weight.numel() for m in debug_model.modules() if isinstance(m, nn.Linear))
    assert saved_k["bf16"] - saved_r["bf16"] == 2 * linear_numel
    assert saved_k.get("fp32", 0) == saved_r.get("fp32", 0)


def test_recast_refuses_a_weight_changed_before_backward(debug_model, tokens, capability):
    model = _copy(debug_model)
    section = PrecisionSection(policy="bf16-mixed")
    runtime = apply_precision(model, build_policy(section, "cpu", capability=capability(True, False)))
    with runtime.autocast():
        loss = cross_entropy_loss(model(tokens[:, :-1]), tokens[:, 1:])
    with torch.no_grad():
        model.output.weight.add_(1.0)  # the forward used the old value
    with pytest.raises(RuntimeError, match="modified in place"):
        loss.backward()


def test_fp32_module_internals_are_stored_in_bf16_and_the_loss_stays_fp32(debug_model, tokens, capability):
    """auto under bf16 compute: what the model saves is bf16 but for tensors too small to
    cast (the norms' (B, T, 1) reciprocal RMS); the norms still compute in fp32; the loss's log-probabilities stay fp32. Parity against
    keeping them fp32 (activation_dtype = fp32): loss within 1e-3 relative; each gradient
    within 2e-2 relative L2 error (bf16 rounding of the saved inputs; measured <= 7e-3).
    Element-wise checks do not fit: the embedding's rows get sums of tiny terms."""
    loss_f, grads_f, saved_f, loss_saved_f = _run(debug_model, tokens, capability, activation_dtype="fp32")
    loss_b, grads_b, saved_b, loss_saved_b = _run(debug_model, tokens, capability)
    assert saved_f.get("fp32", 0) > 0.2 * saved_f["bf16"]
    assert saved_b.get("fp32", 0) < 0.01 * saved_b["bf16"]
    floats = [sum(v for k, v in s.items() if k != "int64") for s in (saved_f, saved_b)]
    assert floats[1] < 0.85 * floats[0]
    n_logits = tokens[:, 1:].numel() * debug_model.cfg.vocab_size
    assert loss_saved_b["fp32"] >= 4 * n_logits  # cross-entropy's fp32 log-softmax, not packed
    torch.testing.assert_close(loss_b, loss_f, rtol=1e-3, atol=0)
    for name, g in grads_f.items():
        assert grads_b[name].dtype == torch.float32
        assert (grads_b[name] - g).norm() <= 2e-2 * g.norm(), name


class Fanout(nn.Module):
    """One fp32 activation read by three matmuls: autocast casts it three times (as the
    fp32 norm's output feeding wq, wk and wv)."""

    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(64, 64, bias=False)
        self.a, self.b, self.c = (nn.Linear(64, 64, bias=False) for _ in range(3))

    def forward(self, x):
        h = self.inp(x).float() * 2  # (B, T, 64) fp32
        return self.a(h) + self.b(h) + self.c(h)


def test_identical_casts_of_one_activation_are_saved_once(capability):
    model = Fanout()
    x = torch.randn(4, 8, 64)
    section = PrecisionSection(policy="bf16-mixed", fp32_modules="")
    runtime = apply_precision(model, build_policy(section, "cpu", capability=capability(True, False)))
    with runtime.autocast():
        saved = measure_activation_bytes(model, lambda: model(x), runtime.activations)
    # x's bf16 cast (needs no grad: not shared) + h's bf16 cast once for a, b and c.
    assert saved == {"bf16": 2 * 4 * 8 * 64 * 2}
    with runtime.autocast():
        out = model(x)
    out.sum().backward()
    ref = Fanout()
    ref.load_state_dict(model.state_dict())
    with torch.autocast("cpu", dtype=torch.bfloat16):  # autocast's own caching, no hooks
        ref_out = ref(x)
    ref_out.sum().backward()
    torch.testing.assert_close(out, ref_out, rtol=0, atol=0)
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=0, atol=0, msg=name)


def test_an_activation_saved_through_several_views_is_stored_once(capability):
    """fp32 compute with low-precision storage (fp16-mixed where fp16 matmuls are slow):
    each Linear saves its own 2-D view of h, and all three share one fp16 copy of h."""
    model = Fanout()
    x = torch.randn(4, 8, 64)
    section = PrecisionSection(policy="fp16-mixed", fp32_modules="")
    policy = build_policy(section, "cpu", capability=capability(True, False))
    assert policy.compute_dtype == torch.float32 and policy.activation_dtype == torch.float16
    runtime = apply_precision(model, policy)
    with runtime.autocast():
        saved = measure_activation_bytes(model, lambda: model(x), runtime.activations)
    assert saved == {"fp16": 2 * 4 * 8 * 64 * 2}  # x (saved by inp) and h, once each
    with runtime.autocast():
        out = model(x)
    out.sum().backward()
    ref = Fanout()
    ref.load_state_dict(model.state_dict())
    ref(x).sum().backward()
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        # fp16 rounding of the saved x and h (11-bit mantissa): measured <= 2e-4.
        assert (p.grad - q.grad).norm() <= 2e-3 * q.grad.norm(), name
