"""The CPU AdamW update as plain functions over flat host buffers (``adamw.cpp``: AVX-512 / AVX2 /
scalar paths, threads over the elements, fp32 or bf16 moments), with torch's fused CPU AdamW as
the fallback where the kernel does not build.

    adamw_step_(params, grads, exp_avg, exp_avg_sq, step=t, lr=lr, betas=(b1, b2), eps=eps,
                weight_decay=wd)          # one flat buffer each, updated in place
    adamw_foreach_(...)                   # the same over lists of tensors (one call, one thread pool)

Both mutate ``params``, ``exp_avg`` and ``exp_avg_sq`` and return None. ``step`` is the step
being taken (1 on the first update, as torch's bias correction counts). Moments in bfloat16 are
rounded once per step, stochastically by default (``stochastic_rounding``): round-to-nearest
loses every increment below half a bf16 step, so a second moment with beta2 = 0.999 stalls at
about a third of its value; stochastic rounding keeps it unbiased. The random bits are a hash of
(``seed``, tensor, element), so a step is reproducible and the same at any thread count.

Hand-written: torch's fused CPU AdamW (``torch._fused_adamw_``) keeps moments in the parameters'
dtype and has no stochastic rounding; DeepSpeed's ``cpu_adam`` builds with its own toolchain and
carries no bf16-moment path. ``TRAINFORGE_CPU_ISA=avx2|avx512|scalar`` forces an instruction path
(read on every call), as for the decode kernels.
"""

from __future__ import annotations

import functools
import warnings
from pathlib import Path
from typing import Sequence

import torch

from trainforge.log import get_logger
from trainforge.native import build as native

_DIR = Path(__file__).parent
_SOURCES = [_DIR / "adamw.cpp"]
_NAME = "trainforge_cpu_adamw"
# Each multiply and add rounded on its own, as torch's AdamW rounds them: fused multiply-adds
# would differ from it by an ulp a step, ~4e-6 on weights of magnitude 2-4 after 100 steps.
_CFLAGS = ("-ffp-contract=off",)
# What the fallback costs, for the one line that reports a failed build (bench/cpu_adamw.py).
_FALLBACK_COST = ("the CPU AdamW update runs on torch's fused kernel (fp32 moments) or on torch ops "
                  "(bf16 moments, several times slower)")


def cache_dir() -> Path:
    return native.cache_entry([*_SOURCES, Path(__file__)])


@functools.cache
def _build() -> str | None:
    """None when the kernel is loaded, else the reason (one attempt per process)."""
    return native.build(_SOURCES, _NAME, cache_dir(), announce=get_logger().info, what="CPU AdamW kernel",
                        fallback_cost=_FALLBACK_COST, duration="~15 s", cflags=_CFLAGS)


@functools.cache
def _warn_once(reason: str) -> None:
    warnings.warn(f"trainforge CPU AdamW kernel unavailable ({reason}); the update runs on torch's fused "
                  "CPU AdamW", RuntimeWarning, stacklevel=4)


def load_adamw_kernel():
    """The ``torch.ops.trainforge_optim`` namespace, or None where the kernel is unusable (a failed
    build is reported by ``native.build`` once per cache; a forced instruction path this CPU lacks
    warns once here)."""
    return native.usable_ops(_build(), "trainforge_optim", _warn_once)


def step_seed(seed: int, step: int, stream: int = 0) -> int:
    """The rounding seed of one step: distinct per (seed, step, stream), the same on resume."""
    return (seed * 0x9E3779B97F4A7C15 + step * 0xBF58476D1CE4E5B9 + stream * 0x94D049BB133111EB) & (2**63 - 1)


def adamw_foreach_(params: Sequence[torch.Tensor], grads: Sequence[torch.Tensor], exp_avgs: Sequence[torch.Tensor],
                   exp_avg_sqs: Sequence[torch.Tensor], *, step: int, lr: float, betas: tuple[float, float],
                   eps: float, weight_decay: float, stochastic_rounding: bool = True, seed: int = 0) -> None:
    """One AdamW step over lists of contiguous CPU tensors: ``params`` and ``grads`` float32,
    the moments all float32 or all bfloat16, each quadruple of one size. Mutates ``params``,
    ``exp_avgs`` and ``exp_avg_sqs``. ``lr`` / ``weight_decay``: this step's values (a schedule's)."""
    if not params:
        return
    if step < 1:
        raise ValueError(f"adamw step must be >= 1 (the step being taken), got {step}")
    beta1, beta2 = betas
    bc1, bc2 = 1 - beta1 ** step, 1 - beta2 ** step
    ops = load_adamw_kernel()
    if ops is not None:
        ops.adamw_(list(params), list(grads), list(exp_avgs), list(exp_avg_sqs), lr, beta1, beta2, eps, weight_decay,
                   bc1, bc2, step_seed(seed, step), stochastic_rounding)
    elif exp_avgs[0].dtype == torch.float32:
        steps = [torch.tensor(float(step)) for _ in params]
        torch._fused_adamw_(list(params), list(grads), list(exp_avgs), list(exp_avg_sqs), [], steps, lr=lr,
                            beta1=beta1, beta2=beta2, weight_decay=weight_decay, eps=eps, amsgrad=False,
                            maximize=False)
    else:
        gen = torch.Generator().manual_seed(step_seed(seed, step))
        for p, g, m, v in zip(params, grads, exp_avgs, exp_avg_sqs):
            reference_adamw_(p, g, m, v, step=step, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay,
                             stochastic_rounding=stochastic_rounding, generator=gen)


def adamw_step_(params: torch.Tensor, grads: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor, *,
                step: int, lr: float, betas: tuple[float, float] = (0.9, 0.95), eps: float = 1e-8,
                weight_decay: float = 0.0, stochastic_rounding: bool = True, seed: int = 0) -> None:
    """One AdamW step on flat host buffers (``params`` / ``grads`` float32, the moments float32 or
    bfloat16, all 1-D contiguous CPU tensors of one length), in place; what optimizer offload and
    CPU training run. See ``adamw_foreach_``."""
    adamw_foreach_([params], [grads], [exp_avg], [exp_avg_sq], step=step, lr=lr, betas=betas, eps=eps,
                   weight_decay=weight_decay, stochastic_rounding=stochastic_rounding, seed=seed)


def round_to_bf16(x: torch.Tensor, stochastic: bool, generator: torch.Generator | None = None) -> torch.Tensor:
    """fp32 -> bf16, to nearest even or stochastically (16 random bits added below the kept ones)."""
    if not stochastic:
        return x.to(torch.bfloat16)
    bits = x.contiguous().view(torch.int32)
    noise = torch.randint(0, 1 << 16, x.shape, dtype=torch.int32, generator=generator)
    out = ((bits + noise) >> 16).to(torch.int16).view(torch.bfloat16)
    return torch.where(torch.isnan(x), x.to(torch.bfloat16), out)


def reference_adamw_(p: torch.Tensor, g: torch.Tensor, m: torch.Tensor, v: torch.Tensor, *, step: int, lr: float,
                     betas: tuple[float, float], eps: float, weight_decay: float, stochastic_rounding: bool,
                     generator: torch.Generator | None = None) -> None:
    """The kernel's math in torch ops (torch's single-tensor AdamW order), moments of any float
    dtype computed in fp32: the fallback for bf16 moments and the tests' reference."""
    beta1, beta2 = betas
    m32, v32 = m.float(), v.float()
    p.mul_(1 - lr * weight_decay)
    m32.lerp_(g, 1 - beta1)
    v32.mul_(beta2).addcmul_(g, g, value=1 - beta2)
    denom = (v32.sqrt() / (1 - beta2 ** step) ** 0.5).add_(eps)
    p.addcdiv_(m32, denom, value=-lr / (1 - beta1 ** step))
    if m.dtype == torch.bfloat16:
        m.copy_(round_to_bf16(m32, stochastic_rounding, generator).view(m.shape))
        v.copy_(round_to_bf16(v32, stochastic_rounding, generator).view(v.shape))
    else:
        m.copy_(m32)
        v.copy_(v32)
