"""Mixed precision through the real trainer: the default policy installs nothing, the
hardware probe decides what runs on this CPU, an fp16 overflow skips its step, resume
is exact with loss-scaler / master-weight / controller state, dynamic switches are
recorded with their reasons, memory is reported per dtype."""

from __future__ import annotations

import os
import re
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file

from tests.conftest import needs_cpu_compile
from trainforge.config import load_config
from trainforge.errors import ConfigError
from trainforge.model import ModelConfig, build_model
from trainforge.monitor.catalog import MEASURED_KEYS
from trainforge.precision.hardware import CACHE_FILE, cpu_capability, read_cpuinfo
from trainforge.precision.policy import build_policy
from trainforge.precision.section import PrecisionSection
from trainforge.train import checkpoint as ckpt
from trainforge.monitor.jsonl import read_jsonl
from trainforge.train.mixed_precision import check_precision_layout
from trainforge.train.trainer import Trainer

BASE = ["--model.flavor", "debug", "--training.batch_size", "4", "--training.seq_len", "32",
        "--training.log_interval", "1", "--training.warmup_steps", "2", "--training.val_batches", "2",
        "--sample.max_new_tokens", "0"]
# bf16 is fast on CPUs with avx512_bf16/amx; elsewhere `force` keeps these tests about the
# technique, not the fallback (the debug model is small enough either way).
BF16 = ["--precision.policy", "bf16-mixed", "--precision.force", "true"]
FP16 = ["--precision.policy", "fp16-mixed", "--precision.force", "true"]


def config(data, *extra):
    return load_config(None, [*BASE, "--data.path", str(data), *extra])


def fit(cfg, run_dir, resume=False, stop_at=None):
    class StopAt:
        def on_step_end(self, trainer, step):
            if step == stop_at:
                trainer.request_stop("test interruption")

    t = Trainer(cfg, run_dir, resume=resume, callbacks=[StopAt()] if stop_at else None, progress=False)
    try:
        return t.fit()
    finally:
        t.close()


def records(run_dir):
    return [r for r in read_jsonl(run_dir / "metrics.jsonl") if "loss" in r]


def checkpoint(run_dir, step):
    path = run_dir / "checkpoints" / f"step_{step:07d}"
    return load_file(path / "model.safetensors"), ckpt.load_train_state(path)


def model_config(run_dir, step) -> ModelConfig:
    return ModelConfig(**ckpt.read_meta(run_dir / "checkpoints" / f"step_{step:07d}")["model_config"])


def test_default_policy_is_plain_fp32_and_installs_nothing(tmp_path, small_data, monkeypatch):
    """The default costs nothing: no probe, no hooks, no autocast, no scaler state."""
    monkeypatch.setenv("TRAINFORGE_CACHE", str(tmp_path / "cache"))
    # The monitor's own step hooks (forward timing) are not precision's: off here.
    t = Trainer(config(small_data, "--monitor.enabled", "false"), tmp_path / "run", progress=False)
    mp = t.mp
    assert t.cfg.precision.policy == "fp32" and not mp.policy.low_precision
    assert mp.runtime.compute_dtypes == {"model": torch.float32} and mp.runtime.fp32_modules == []
    assert all(not m._forward_pre_hooks and not m._forward_hooks for m in t.model.modules())
    assert mp.master is None and t.opt_parts is t.model_parts
    assert not mp.scaler.enabled and mp.controller is None
    # No saved-tensor hooks either: no packing, no weight recast.
    assert mp.runtime.activations.store_dtype is None and not mp.runtime.activations.recast_weights
    t.train_step()
    assert mp.state_dict() is None  # fp32 checkpoints keep their exact contents
    assert not (tmp_path / "cache" / CACHE_FILE).exists()  # fp32 needs no hardware probe
    t.close()


def test_hardware_probe_decides_what_runs_on_this_cpu(tmp_path):
    """Measured once and cached; the policy follows the measurement. On x86 with the
    flags, oneDNN's bf16 kernels are faster than fp32; without avx512_fp16/amx_fp16 the
    fp16 matmul falls back to kernels ~20x slower (AMD EPYC with avx512_bf16: bf16 ~0.5x the
    fp32 time, fp16 ~22x). With avx512_fp16 the measurement decides: on a Sapphire Rapids
    guest (avx512_fp16, no amx_fp16) torch 2.13's fp16 matmul measured 1.18x fp32, so slow."""
    cap = cpu_capability(tmp_path)
    assert (tmp_path / CACHE_FILE).is_file()

    def no_measure(dtype):
        raise AssertionError("cached: must not probe again")

    assert cpu_capability(tmp_path, measure=no_measure) == cap
    _, flags = read_cpuinfo()
    for name in ("bf16", "fp16"):
        s = cap.support[name]
        print(f"{cap.name}: {s.reason} -> {'fast' if s.fast else 'slow'}")
        assert s.fast == (s.slowdown <= 1.0)
    # x86 with oneDNN's AVX-512 kernels, unless ATen / oneDNN are held below AVX-512 by environment
    # (an AVX2-only machine emulated: the flags remain, the kernels that use them do not run).
    held = os.environ.get("ATEN_CPU_CAPABILITY", "").lower() in ("avx2", "default") or \
        os.environ.get("ONEDNN_MAX_CPU_ISA", "").upper().startswith(("AVX2", "SSE"))
    if flags is not None and "avx512f" in flags and not held:
        assert cap.support["bf16"].fast == bool({"avx512_bf16", "amx_bf16"} & flags)
        fp16_flags = bool({"avx512_fp16", "amx_fp16"} & flags)
        assert cap.support["fp16"].native == fp16_flags
        assert fp16_flags or not cap.support["fp16"].fast  # no native kernels: never fast
    for preset, dtype in (("bf16-mixed", torch.bfloat16), ("fp16-mixed", torch.float16)):
        policy = build_policy(PrecisionSection(policy=preset), "cpu", capability=cap)
        if cap.is_fast(dtype):
            assert policy.compute_dtype == dtype
            assert policy.activation_dtype == (torch.bfloat16 if dtype == torch.bfloat16 else None)
        else:  # warned, fp32 compute, activations still stored low
            assert policy.compute_dtype == torch.float32 and policy.activation_dtype == dtype
            assert any("slower than fp32" in n for n in policy.notes)
        assert policy.loss_scaling == (policy.compute_dtype == torch.float16)


def test_fp16_overflow_skips_the_step_halves_the_scale_and_keeps_the_weights(tmp_path, small_data):
    # 2**40 x a loss gradient of ~1/128 per logit exceeds fp16's 65504 in the first
    # backward cast: every step overflows until the scale has come down ~25 halvings.
    cfg = config(small_data, *FP16, "--precision.loss_scale_init", str(2.0**40), "--training.steps", "3",
                 "--training.val_interval", "0")
    summary = fit(cfg, tmp_path / "run")
    initial = build_model(model_config(tmp_path / "run", 3), seed=cfg.training.seed).state_dict()
    recs = records(tmp_path / "run")
    assert [r["skipped_steps"] for r in recs] == [1, 2, 3]
    assert [r["loss_scale"] for r in recs] == [2.0**39, 2.0**38, 2.0**37]
    assert all(r["grad_norm"] is None for r in recs)  # inf: written as null
    weights, state = checkpoint(tmp_path / "run", 3)
    for name, w in weights.items():
        assert torch.equal(w, initial[name]), name
    assert summary["final_val_loss"] == summary["first_val_loss"]
    assert state["precision"]["scaler"]["scaler"]["scale"] == 2.0**37  # checkpointed (weights_only load)
    assert state["precision"]["scaler"]["skipped_steps"] == 3


RESUME_CASES = {
    # The scale oscillates between 2**19 and 2**20 (overflow, growth after 2 clean steps):
    # resume must restore the scale and the growth tracker.
    "fp16-loss-scale": [*FP16, "--precision.loss_scale_init", str(2.0**20),
                        "--precision.loss_scale_growth_steps", "2"],
    "bf16-params-fp32-master": [*BF16, "--precision.param_dtype", "bf16"],
    # Interrupted at step 5 with one step buffered for the controller (interval 4).
    "dynamic": ["--precision.policy", "dynamic", "--precision.force", "true",
                "--precision.dynamic_interval_steps", "4", "--precision.dynamic_grad_norm_max", "0.5",
                "--precision.dynamic_min_dwell_steps", "0", "--precision.dynamic_calm_steps", "3",
                "--precision.dynamic_groups", "attn:layers.*.attention"],
}


@pytest.mark.parametrize("case", list(RESUME_CASES))
def test_interrupted_and_resumed_run_is_bit_identical(tmp_path, small_data, case):
    cfg = lambda: config(small_data, *RESUME_CASES[case], "--training.steps", "12",  # noqa: E731
                         "--checkpoint.interval", "6", "--training.val_interval", "6")
    fit(cfg(), tmp_path / "a")
    assert fit(cfg(), tmp_path / "b", stop_at=5)["step"] == 5
    fit(cfg(), tmp_path / "b", resume=True)
    strip = lambda rs: [{k: v for k, v in r.items() if k not in ("tokens_per_s", "mfu", "data_io_wait_frac")  # noqa: E731
                         and k not in MEASURED_KEYS and not k.startswith(("mem_", "peak_"))}
                        for r in rs if "checkpoint" not in r]
    a, b = read_jsonl(tmp_path / "a" / "metrics.jsonl"), read_jsonl(tmp_path / "b" / "metrics.jsonl")
    assert strip(a) == strip(b)  # losses, grad norms, scales, switches: every record
    (wa, sa), (wb, sb) = checkpoint(tmp_path / "a", 12), checkpoint(tmp_path / "b", 12)
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)
    assert sa.get("precision") == sb.get("precision")
    if case == "fp16-loss-scale":
        assert 0 < sa["precision"]["scaler"]["skipped_steps"] < 12
    if case == "bf16-params-fp32-master":
        assert all(w.dtype == torch.float32 for w in wa.values())  # the master weights are saved
    if case == "dynamic":
        assert any("precision_switch" in r for r in a)


def test_dynamic_switches_are_recorded_with_their_reasons(tmp_path, small_data):
    """Up on trouble (a gradient-norm limit every step exceeds), then, resumed with the
    limit off, down again after the calm steps: each switch is a metrics record with its
    reason, and the records of later steps name the precision in use."""
    run_dir = tmp_path / "run"
    dyn = ["--precision.policy", "dynamic", "--precision.force", "true", "--precision.dynamic_interval_steps", "2",
           "--precision.dynamic_min_dwell_steps", "0", "--precision.dynamic_calm_steps", "2",
           "--training.val_interval", "0"]
    fit(config(small_data, *dyn, "--training.steps", "4", "--precision.dynamic_grad_norm_max", "0.001"), run_dir)
    fit(config(small_data, *dyn, "--training.steps", "10", "--precision.dynamic_grad_norm_max", "0"), run_dir,
        resume=True)
    all_records = read_jsonl(run_dir / "metrics.jsonl")
    switches = [r for r in all_records if "precision_switch" in r]
    assert [(s["step"], s["precision_switch"]) for s in switches] == [(2, "model bf16 -> fp32"),
                                                                     (6, "model fp32 -> bf16")]
    assert re.fullmatch(r"gradient norm [\d.]+ above 0\.001", switches[0]["reason"])
    assert switches[1]["reason"] == "2 calm steps (needed 2)"
    in_use = {r["step"]: r["precision"]["model"] for r in records(run_dir)}
    assert in_use == {1: "bf16", 2: "bf16", 3: "fp32", 4: "fp32", 5: "fp32", 6: "fp32", 7: "bf16", 8: "bf16",
                      9: "bf16", 10: "bf16"}


@pytest.mark.slow
@needs_cpu_compile
def test_compiled_bf16_mixed_matches_eager(tmp_path, small_data):
    """parallel.compile under bf16-mixed (fp32 rule wrappers traced by dynamo, saved-tensor
    hooks on): same losses as eager within 2e-4 relative (measured ~1e-5: compiled kernels
    fuse and reorder bf16/fp32 ops), same checkpoint keys. Slow: compiling costs ~20 s."""
    fit(config(small_data, *BF16, "--training.steps", "3"), tmp_path / "eager")
    fit(config(small_data, *BF16, "--training.steps", "3", "--parallel.compile", "true"), tmp_path / "compiled")
    eager, compiled = records(tmp_path / "eager"), records(tmp_path / "compiled")
    assert [r["step"] for r in eager] == [r["step"] for r in compiled] == [1, 2, 3]
    torch.testing.assert_close(torch.tensor([r["loss"] for r in compiled]),
                               torch.tensor([r["loss"] for r in eager]), rtol=2e-4, atol=0)
    assert checkpoint(tmp_path / "compiled", 3)[0].keys() == checkpoint(tmp_path / "eager", 3)[0].keys()


def test_memory_is_reported_per_dtype(tmp_path, small_data):
    """bf16 weights with fp32 master copies: parameters in bf16 (norms fp32 by rule), the
    master counted as optimizer state, saved activations mostly bf16."""
    fit(config(small_data, *BF16, "--precision.param_dtype", "bf16", "--training.steps", "2"), tmp_path / "run")
    r = records(tmp_path / "run")[-1]
    n_params = model_config(tmp_path / "run", 2).num_params()
    norm_params = 64 * (2 * 2 + 1)  # dim x (2 norms per block x 2 blocks + final)
    assert r["precision"] == {"model": "bf16"}
    assert r["mem_params_bf16_bytes"] == 2 * (n_params - norm_params)
    assert r["mem_params_fp32_bytes"] == 4 * norm_params
    # fp32 master weights + AdamW's two moments (+ one step counter per tensor).
    assert 12 * n_params < r["mem_optimizer_state_fp32_bytes"] < 12 * n_params + 1024
    assert r["mem_grads_fp32_bytes"] == 4 * n_params  # moved onto the master copy
    assert r["mem_activations_bf16_bytes"] > 0 and r["mem_activations_fp32_bytes"] > 0  # norms, loss: fp32
    assert r["mem_peak_bytes"] > r["mem_tracked_bytes"] > 0


@pytest.mark.parametrize("dims, kind, match", [
    ((1, 2), "none", "precision.param_dtype"),  # tp=2 without FSDP: no master weights there
    ((2, 1), "none", "precision.param_dtype"),  # pp=2 likewise
])
def test_low_precision_params_need_fsdp_under_tp_or_pp(capability, dims, kind, match):
    section = PrecisionSection(policy="bf16-mixed", param_dtype="bf16")
    policy = build_policy(section, "cpu", capability=capability(True, False))
    with pytest.raises(ConfigError, match=match):
        check_precision_layout(policy, SimpleNamespace(pp=dims[0], tp=dims[1]), kind)
    note = check_precision_layout(policy, SimpleNamespace(pp=dims[0], tp=dims[1]), "fsdp")
    assert "FSDP2 keeps the sharded parameters" in note
