"""Memory accounting per dtype, and low-precision storage of saved activations
(parity of its gradients against plain fp32)."""

from __future__ import annotations

import torch
from torch import nn

from trainforge.parallel.tensor_parallel import cross_entropy_loss
from trainforge.precision.activations import SavedActivations
from trainforge.precision.casting import apply_precision
from trainforge.precision.memory import bytes_by_dtype, measure_activation_bytes, memory_report, peak_memory
from trainforge.precision.policy import build_policy
from trainforge.precision.section import PrecisionSection


def test_bytes_by_dtype_counts_each_storage_once():
    a = torch.zeros(10)
    b = torch.zeros(8, dtype=torch.bfloat16)
    assert bytes_by_dtype([a, a[2:5], a.view(2, 5), b, None]) == {"fp32": 40, "bf16": 16}


def test_report_of_params_grads_and_adamw_state(debug_model, tokens):
    opt = torch.optim.AdamW(debug_model.parameters(), lr=1e-3)
    cross_entropy_loss(debug_model(tokens[:, :-1]), tokens[:, 1:]).backward()
    opt.step()
    n_params = sum(p.numel() for p in debug_model.parameters())
    n_tensors = len(list(debug_model.parameters()))
    report = memory_report([debug_model], [opt], torch.device("cpu"))
    assert report.params == {"fp32": 4 * n_params}
    assert report.grads == {"fp32": 4 * n_params}
    # exp_avg + exp_avg_sq per element, plus one fp32 step counter per parameter tensor.
    assert report.optimizer_state == {"fp32": 8 * n_params + 4 * n_tensors}
    assert report.peak_bytes > report.tracked_bytes() and "RSS" in report.peak_source
    metrics = report.as_metrics()
    assert metrics["mem_params_fp32_bytes"] == 4 * n_params and metrics["mem_peak_bytes"] == report.peak_bytes
    assert "optimizer_state" in report.format()


def test_master_weights_count_as_optimizer_state(capability):
    model = nn.Sequential(nn.Linear(16, 16, bias=False))
    section = PrecisionSection(policy="bf16-mixed", param_dtype="bf16", fp32_modules="")
    runtime = apply_precision(model, build_policy(section, "cpu", capability=capability(True, False)))
    report = memory_report([model], [], "cpu", master_modules=[runtime.master.module])
    assert report.params == {"bf16": 2 * 256} and report.optimizer_state == {"fp32": 4 * 256}


class SharedInput(nn.Module):
    """Three matmuls save the same input: it must be stored (and counted) once."""

    def __init__(self):
        super().__init__()
        self.a, self.b, self.c = (nn.Linear(64, 64, bias=False) for _ in range(3))

    def forward(self, x):
        return self.a(x) + self.b(x) + self.c(x)


def test_shared_saved_input_is_packed_once():
    model = SharedInput()
    x = torch.randn(32, 64, requires_grad=False)
    plain = measure_activation_bytes(model, lambda: model(x))
    assert plain == {"fp32": 32 * 64 * 4}  # x once; weights are not activations
    packed = measure_activation_bytes(model, lambda: model(x), SavedActivations(model, torch.bfloat16))
    assert packed == {"bf16": 32 * 64 * 2}


def test_slow_bf16_fallback_halves_activation_memory_with_fp32_like_gradients(capability, debug_model, tokens):
    """fp32 compute, bf16 storage of what backward needs: the policy's answer to slow
    bf16 hardware. Parity: gradients match plain fp32 within bf16 rounding (rtol 2e-2)."""
    reference = {n: p.detach().clone() for n, p in debug_model.named_parameters()}
    section = PrecisionSection(policy="bf16-mixed")
    policy = build_policy(section, "cpu", capability=capability(False, False))
    assert policy.compute_dtype == torch.float32 and policy.activation_dtype == torch.bfloat16

    def grads(use_runtime: bool):
        model = type(debug_model)(debug_model.cfg)
        model.load_state_dict(reference, strict=False)
        model.rope_cos.copy_(debug_model.rope_cos)
        model.rope_sin.copy_(debug_model.rope_sin)
        if use_runtime:
            runtime = apply_precision(model, policy)
            with runtime.autocast():
                logits = model(tokens[:, :-1])
            saved = measure_activation_bytes(model, lambda: model(tokens[:, :-1]), runtime.activations)
        else:
            logits = model(tokens[:, :-1])
            saved = measure_activation_bytes(model, lambda: model(tokens[:, :-1]))
        cross_entropy_loss(logits, tokens[:, 1:]).backward()
        return {n: p.grad for n, p in model.named_parameters()}, saved

    plain_grads, plain_saved = grads(False)
    low_grads, low_saved = grads(True)
    assert "bf16" not in plain_saved and low_saved.get("bf16", 0) > 0
    assert plain_saved.get("int64") == low_saved.get("int64")  # token ids (embedding backward) untouched
    floats = [sum(v for k, v in saved.items() if k != "int64") for saved in (plain_saved, low_saved)]
    assert floats[1] < 0.7 * floats[0]
    for name, g in plain_grads.items():
        torch.testing.assert_close(low_grads[name], g, rtol=2e-2, atol=2e-4, msg=name)
        assert low_grads[name].dtype == torch.float32


def test_peak_memory_on_cpu():
    peak, source = peak_memory(torch.device("cpu"))
    assert peak > 10 * 2**20 and "RSS" in source
