"""The CPU AdamW kernel (optim/adamw.cpp) against torch: fp32 moments match torch.optim.AdamW
within 1e-6 over 100 steps on every instruction path and thread count; bf16 moments match the
same math rounded by torch; stochastic rounding keeps a slowly growing second moment where
round-to-nearest stalls; the fallback where the kernel is unusable is torch's fused AdamW."""

from __future__ import annotations

import warnings

import pytest
import torch

from trainforge.optim import cpu_adamw
from trainforge.optim.cpu_adamw import adamw_foreach_, adamw_step_, load_adamw_kernel, reference_adamw_

ISAS = ["scalar", "avx2", "avx512"]
# Sizes: a vector's worth and a tail on every path, and more than one 64 Ki chunk (threads split chunks).
SIZES = [1, 15, 17, 1000, 70_001]
HP = dict(lr=3e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)


@pytest.fixture(scope="module")
def kernel():
    ops = load_adamw_kernel()
    if ops is None:
        pytest.skip("the CPU AdamW kernel did not build (the warning says why)")
    return ops


def _isa(monkeypatch, isa):
    if isa == "avx512" and not torch.backends.cpu.get_cpu_capability().startswith("AVX512"):
        pytest.skip("this CPU has no AVX-512")
    monkeypatch.setenv("TRAINFORGE_CPU_ISA", isa)


def _problem(seed: int, sizes=SIZES):
    gen = torch.Generator().manual_seed(seed)
    params = [torch.randn(n, generator=gen) for n in sizes]
    grads = [[torch.randn(n, generator=gen) * 10 ** torch.empty(n).uniform_(-4, 1, generator=gen) for n in sizes]
             for _ in range(100)]
    return params, grads


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("threads", [1, 2])
def test_fp32_moments_match_torch_adamw_over_100_steps(kernel, monkeypatch, isa, threads):
    _isa(monkeypatch, isa)
    params, grads = _problem(0)
    ref = [torch.nn.Parameter(p.clone()) for p in params]
    opt = torch.optim.AdamW(ref, **HP)  # the default (single-tensor) implementation
    ours = [p.clone() for p in params]
    ms, vs = [torch.zeros_like(p) for p in ours], [torch.zeros_like(p) for p in ours]
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for step, g in enumerate(grads, start=1):
            for p, gi in zip(ref, g):
                p.grad = gi
            opt.step()
            adamw_foreach_(ours, g, ms, vs, step=step, **HP)
    finally:
        torch.set_num_threads(old)
    for p, r in zip(ours, ref):
        torch.testing.assert_close(p, r.detach(), rtol=0, atol=1e-6)
    for m, v, r in zip(ms, vs, ref):
        torch.testing.assert_close(m, opt.state[r]["exp_avg"], rtol=1e-5, atol=1e-7)
        torch.testing.assert_close(v, opt.state[r]["exp_avg_sq"], rtol=1e-5, atol=1e-10)


@pytest.mark.parametrize("isa", ISAS)
def test_bf16_moments_round_to_nearest_like_torch(kernel, monkeypatch, isa):
    # The same fp32 math, the moments rounded by Tensor.to(bfloat16): equal but for an fp32
    # rounding difference that lands a moment on the other side of a bf16 tie (rare, one step).
    _isa(monkeypatch, isa)
    params, grads = _problem(1, sizes=[5000, 33])
    ours, ref = [p.clone() for p in params], [p.clone() for p in params]
    mo, vo = [torch.zeros_like(p, dtype=torch.bfloat16) for p in ours], [torch.zeros_like(p, dtype=torch.bfloat16) for p in ours]
    mr, vr = [m.clone() for m in mo], [v.clone() for v in vo]
    for step, g in enumerate(grads[:30], start=1):
        adamw_foreach_(ours, g, mo, vo, step=step, stochastic_rounding=False, **HP)
        for p, gi, m, v in zip(ref, g, mr, vr):
            reference_adamw_(p, gi, m, v, step=step, stochastic_rounding=False, **HP)
    for a, b in zip(mo + vo, mr + vr):
        assert (a != b).float().mean() < 1e-3
    for p, r in zip(ours, ref):
        torch.testing.assert_close(p, r, rtol=0, atol=1e-5)


@pytest.mark.parametrize("isa", ISAS)
def test_stochastic_rounding_keeps_the_second_moment_growing(kernel, monkeypatch, isa):
    # A constant gradient with beta2 = 0.999: v_t = g^2 (1 - 0.999^t). Round-to-nearest drops
    # every increment below half a bf16 step and stalls near a third of g^2; stochastic rounding
    # tracks the fp32 value on average over the elements.
    _isa(monkeypatch, isa)
    n, steps = 4096, 1500
    g = torch.full((n,), 0.5)
    want = 0.25 * (1 - 0.999 ** steps)  # ~0.194
    got = {}
    for sr in (False, True):
        p = torch.zeros(n)
        m, v = torch.zeros(n, dtype=torch.bfloat16), torch.zeros(n, dtype=torch.bfloat16)
        for step in range(1, steps + 1):
            adamw_step_(p, g, m, v, step=step, lr=0.0, betas=(0.9, 0.999), stochastic_rounding=sr, seed=7)
        got[sr] = v.float().mean().item()
    assert got[False] < 0.8 * want  # nearest even stalls
    assert abs(got[True] - want) < 0.01 * want, got


def test_stochastic_rounding_is_unbiased_and_reproducible(kernel, monkeypatch):
    # One step from zero moments: m = 0.1 g exactly in fp32; the bf16 value is one of the two
    # neighbours, the mean over many elements is the fp32 value, and a rerun gives the same bits.
    x = torch.full((1 << 16,), 1.0 + 3 / 1024)  # between two bf16 values (step 2^-7)
    out = []
    for threads in (1, 2):
        torch.set_num_threads(threads)
        p, m, v = torch.zeros_like(x), torch.zeros(x.numel(), dtype=torch.bfloat16), torch.zeros(x.numel(), dtype=torch.bfloat16)
        adamw_step_(p, x, m, v, step=1, lr=0.0, betas=(0.0, 0.0), seed=3)
        out.append(m.clone())
    torch.set_num_threads(1)
    assert torch.equal(out[0], out[1])
    assert set(out[0].float().unique().tolist()) == {1.0, 1.0078125}
    assert abs(out[0].float().mean().item() - x[0].item()) < 2e-4


def test_bad_buffers_are_refused_by_name(kernel):
    p, g = torch.zeros(8), torch.zeros(8)
    with pytest.raises(RuntimeError, match="params and grads must be float32"):
        adamw_step_(p.double(), g, torch.zeros(8), torch.zeros(8), step=1, lr=1e-3)
    with pytest.raises(RuntimeError, match="same number of elements"):
        adamw_step_(p, g, torch.zeros(7), torch.zeros(8), step=1, lr=1e-3)
    with pytest.raises(ValueError, match="step must be >= 1"):
        adamw_step_(p, g, torch.zeros(8), torch.zeros(8), step=0, lr=1e-3)


def test_an_unusable_kernel_falls_back_to_torch_fused_with_one_warning(monkeypatch):
    # A CPU lacking the forced path stands for any unusable kernel: the update still matches torch.
    monkeypatch.setattr(cpu_adamw, "_build", lambda: None)
    monkeypatch.setattr(cpu_adamw.torch.ops.trainforge_optim, "isa", _raise, raising=False)
    cpu_adamw._warn_once.cache_clear()
    params, grads = _problem(2, sizes=[300])
    ref = [torch.nn.Parameter(p.clone()) for p in params]
    opt = torch.optim.AdamW(ref, **HP)
    ours, ms, vs = [p.clone() for p in params], [torch.zeros(300)], [torch.zeros(300)]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step, g in enumerate(grads[:10], start=1):
            ref[0].grad = g[0]
            opt.step()
            adamw_foreach_(ours, g, ms, vs, step=step, **HP)
    told = [w for w in caught if "CPU AdamW kernel unavailable" in str(w.message)]
    assert len(told) == 1 and "no such path" in str(told[0].message)
    torch.testing.assert_close(ours[0], ref[0].detach(), rtol=0, atol=1e-6)


def _raise():
    raise RuntimeError("no such path on this CPU")


def test_without_a_compiler_the_update_runs_on_torch_fused_and_says_so_once(tmp_path):
    # A fresh cache and no C++ compiler: one warning naming the fix, the update still right;
    # a second process finds the recorded failure and neither rebuilds nor repeats it.
    import os
    import subprocess
    import sys

    code = ("import torch; from trainforge.optim.cpu_adamw import adamw_step_, load_adamw_kernel; "
            "assert load_adamw_kernel() is None; p = torch.ones(100); m, v = torch.zeros(100), torch.zeros(100); "
            "adamw_step_(p, torch.full((100,), 0.5), m, v, step=1, lr=0.1, weight_decay=0.0); "
            "print('P', round(p[0].item(), 5))")
    env = {**os.environ, "TRAINFORGE_KERNEL_CACHE": str(tmp_path), "CXX": str(tmp_path / "no-such-c++")}
    runs = [subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
            for _ in range(2)]
    assert all(r.returncode == 0 and "P 0.9" in r.stdout for r in runs), [r.stderr for r in runs]  # 1 - lr * sign
    told = [line for line in runs[0].stderr.splitlines() if "CPU AdamW kernel not built" in line]
    assert len(told) == 1 and "install a C++ compiler" in told[0] and "fused" in told[0], runs[0].stderr
    assert "CPU AdamW" not in runs[1].stderr
