"""Quantisation-aware training: the linear layers `trainforge quantize` would quantise run
their forward on fake-quantised weights, so training adapts the float weights to the grid
they will be served on.

Why hand-written: torchao's QAT (``QATConfig``) is the ecosystem's tool, but torchao is not
a dependency (and its CPU paths were unusable with our torch: ``infer/quantize/int4.py``).
More to the point, the fake quantiser here *is* the export grid: it calls
``quantize_int8``/``dequantize_int8`` and ``quantize_int4``/``dequantize_int4`` of
``quant_formats/`` (the grids ``trainforge quantize`` and ``--quantize`` store), so the weights a
QAT run trains against equal the dequantised weights it is served with, bit for bit (fp32
parameters), and the two grids cannot drift apart.

Technique. ``FakeQuant`` is a straight-through estimator: forward returns
dequantise(quantise(w)), backward passes the gradient to ``w`` unchanged. There is no clamp
to mask: both grids take their range from the weights themselves (int8: per-row absmax;
int4: per-group min/max), so no weight ever falls outside it and the clipped-STE variant
would be the same function. The scales get no gradient (not LSQ).

Applied from outside (house rule 1): ``apply_qat`` binds an instance-level ``forward`` on
each target ``nn.Linear`` (``F.linear`` of the fake-quantised weight: the same math as
``nn.Linear.forward``), ``remove_qat`` deletes it. Parameters, their names and the state
dict are untouched (a parametrization would rename them), and ``type(m) is nn.Linear``
still holds, so ``linear_names`` finds the same layers at export. The swap happens inside
the module's own call, after FSDP2's pre-forward hook of the enclosing block has
all-gathered the parameters, so the fake quantiser always sees whole weight rows (both
grids are per row or per row-group anyway, so a row shard would give the same values);
DDP never shards. Tensor parallelism (column/row shards of one matrix), pipeline stages
and ``parallel.compile`` are refused by ``check_qat`` (untested here), as are MoE models: the routed experts are a
grouped GEMM in ``GroupedExperts.forward``, which a forward swap cannot reach without a
second definition of its math, and leaving them float would make the served (quantised)
experts differ from the trained ones.

Which layers: ``linear_names(model)`` (routers' gates and MLA's ``wkv_b`` stay float, as in
quantize); int4 layers whose in_features ``group_size`` does not divide stay float and are
listed, as ``quantize_state_dict`` skips them. The token embedding stays float; a tied
output projection is fake-quantised as its own matrix, as quantize stores it.

``QATComponent`` switches fake quantisation on for every step from ``qat.start_step``
(counted in completed optimizer steps: the step that takes the run from ``start_step`` to
``start_step + 1`` is the first QAT step; a validation at step >= ``start_step`` measures the
fake-quantised model). Whether it is on is a function of the step alone, re-derived on
load and rollback, so a run resumed across ``start_step`` matches an uninterrupted one.
The scheme is recorded in every checkpoint's ``meta.json`` (the resolved config's
``qat`` table); ``infer/quantize/qat_meta.qat_scheme_of`` reads it for generate/serve/export.
"""

from __future__ import annotations

import types
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import nn

from trainforge.errors import ConfigError
from trainforge.quant_formats.int4 import dequantize_int4, quantize_int4
from trainforge.quant_formats.int8 import dequantize_int8, quantize_int8
from trainforge.quant_formats.layers import linear_names
from trainforge.train.component import Component


def fake_quantize(w: torch.Tensor, scheme: str, group_size: int = 128) -> torch.Tensor:
    """dequantise(quantise(w)) on the export grid, in ``w``'s dtype (no autograd: see ``FakeQuant``)."""
    if scheme == "int8":
        out = dequantize_int8(*quantize_int8(w))
    elif scheme == "int4":
        out = dequantize_int4(*quantize_int4(w, group_size))
    else:
        raise ValueError(f"qat scheme {scheme!r}: use int8 or int4")
    return out.to(w.dtype)


class FakeQuant(torch.autograd.Function):
    """Straight-through estimator: forward is ``fake_quantize``, backward the identity."""

    @staticmethod
    def forward(ctx, w: torch.Tensor, scheme: str, group_size: int) -> torch.Tensor:
        return fake_quantize(w, scheme, group_size)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, None, None


def fake_quantize_activations(x: torch.Tensor) -> torch.Tensor:
    """``x`` as the CPU int8 kernel sees it when serving (``infer/quantize/int8.py``'s fbgemm
    dynamic linear): quantised per tensor to 7 bits (0..127) with an asymmetric zero point
    chosen from x's range, dequantised. torch's own ``fake_quantize_per_tensor_affine``, on the
    parameters ``_choose_qparams_per_tensor(x, reduce_range=True)`` gives, the ones the dynamic
    kernel picks: its output matches the served layer within 1.2e-5 (64 x 128, |y| ~ 90,
    measured), and its gradient is the straight-through one, zero where x was clipped."""
    scale, zero_point = torch._choose_qparams_per_tensor(x.detach().float(), True)
    return torch.fake_quantize_per_tensor_affine(x, scale, zero_point, 0, 127)


def qat_targets(model: nn.Module, scheme: str, group_size: int) -> tuple[list[str], dict[str, str]]:
    """(the linears QAT fake-quantises, {skipped layer: why}): ``quantize_state_dict``'s choice."""
    names, skipped = [], {}
    for name in linear_names(model):
        k = model.get_submodule(name).in_features
        if scheme == "int4" and k % group_size:
            skipped[name] = f"in_features {k} is not a multiple of group_size {group_size}"
        else:
            names.append(name)
    return names, skipped


def _fake_quant_forward(scheme: str, group_size: int, activations: str = "none") -> Callable:
    def forward(self: nn.Linear, x: torch.Tensor) -> torch.Tensor:
        if activations == "int8":
            x = fake_quantize_activations(x)
        return F.linear(x, FakeQuant.apply(self.weight, scheme, group_size), self.bias)
    forward.qat = (scheme, group_size, activations)  # marks ours: remove_qat deletes only these
    return forward


def apply_qat(model: nn.Module, scheme: str, group_size: int = 128, activations: str = "none"
              ) -> tuple[list[str], dict[str, str]]:
    """Fake-quantise the forward of every target linear of ``model`` (mutated): its weight on
    the export grid, and with ``activations = "int8"`` its input as the int8 kernel quantises
    it; returns ``qat_targets``. Idempotent for the same scheme."""
    names, skipped = qat_targets(model, scheme, group_size)
    fwd = _fake_quant_forward(scheme, group_size, activations)
    for name in names:
        m = model.get_submodule(name)
        own = m.__dict__.get("forward")
        if own is not None and getattr(getattr(own, "__func__", None), "qat", None) is None:
            raise ValueError(f"{name} already has an instance-level forward (a precision.fp32_modules rule?); "
                             "QAT binds its own: leave QAT layers out of precision.fp32_modules")
        m.forward = types.MethodType(fwd, m)
    return names, skipped


def remove_qat(model: nn.Module) -> None:
    """Restore the plain forward of every layer ``apply_qat`` changed."""
    for m in model.modules():
        own = m.__dict__.get("forward")
        if own is not None and getattr(getattr(own, "__func__", None), "qat", None) is not None:
            del m.forward


def qat_active(model: nn.Module) -> bool:
    return any(getattr(getattr(m.__dict__.get("forward"), "__func__", None), "qat", None) is not None
               for m in model.modules())


def check_qat(qcfg: Any, dims: Any, model_config: Any, compile: bool = False) -> None:
    """Refuse, naming the key, what QAT does not serve (before anything is allocated)."""
    if not qcfg.enabled:
        return
    if compile:
        # The swap happens mid-run (at start_step); a block compiled before it would keep
        # running the graph it traced without fake quantisation, unless dynamo's guards see it.
        raise ConfigError(f"config key 'qat.scheme' = {qcfg.scheme!r}: QAT with parallel.compile = true is not "
                          "supported (fake quantisation is switched on mid-run, under a graph compiled before); "
                          "set parallel.compile = false")
    if dims.tp > 1:
        raise ConfigError(f"config key 'qat.scheme' = {qcfg.scheme!r}: QAT with tensor parallelism "
                          f"(parallel.tp = {dims.tp}) is not supported (a column/row shard of a matrix does not "
                          "hold whole int4 groups / int8 rows); use parallel.tp = 1 with data parallelism "
                          "(DDP or FSDP2), or qat.scheme = none")
    if dims.pp > 1:
        raise ConfigError(f"config key 'qat.scheme' = {qcfg.scheme!r}: QAT with pipeline parallelism "
                          f"(parallel.pp = {dims.pp}) is not supported yet; use parallel.pp = 1 with data "
                          "parallelism, or qat.scheme = none")
    if model_config.is_moe:
        raise ConfigError(f"config key 'qat.scheme' = {qcfg.scheme!r}: QAT of MoE models is not supported (the "
                          "routed experts would be trained float but served quantised); use a dense model.flavor, "
                          "or qat.scheme = none and `trainforge quantize` after training")


class QATComponent(Component):
    """Fake quantisation on the loop's model parts from ``qat.start_step`` on. State: the
    scheme it trained with (a resume under another grid after QAT began is reported)."""

    name = "qat"

    def __init__(self, qcfg: Any, model_parts: list[nn.Module], log: Callable[[str], None] | None = None):
        self.cfg, self.parts, self.log = qcfg, model_parts, log
        self.active = False
        skipped: dict[str, str] = {}
        for part in model_parts:
            skipped.update(qat_targets(part, qcfg.scheme, qcfg.group_size)[1])
        if skipped and log is not None:
            log(f"qat: {len(skipped)} layer(s) stay float (as trainforge quantize leaves them): "
                + "; ".join(f"{k}: {v}" for k, v in skipped.items()))
        self._sync(0)  # start_step 0: the step-0 validation already measures the fake-quantised model

    def _sync(self, step: int) -> None:
        want = step >= self.cfg.start_step
        if want == self.active:
            return
        for part in self.parts:
            if want:
                apply_qat(part, self.cfg.scheme, self.cfg.group_size, self.cfg.activations)
            else:
                remove_qat(part)
        self.active = want

    def on_step_start(self, loop: Any) -> None:
        self._sync(loop.step)

    def on_step_end(self, loop: Any, step: int) -> None:
        self._sync(step)  # before this step's validation and checkpoint

    def on_load(self, loop: Any) -> None:
        self._sync(loop.step)  # resume or rollback: on or off as at that step

    def state_dict(self) -> dict[str, Any]:
        return {"scheme": self.cfg.scheme, "group_size": self.cfg.group_size, "start_step": self.cfg.start_step,
                "activations": self.cfg.activations}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        saved = (state["scheme"], state["group_size"])
        if saved != (self.cfg.scheme, self.cfg.group_size) and self.log is not None:
            self.log(f"qat: the checkpoint trained with scheme {saved[0]} group_size {saved[1]}; this run continues "
                     f"with {self.cfg.scheme} group_size {self.cfg.group_size}")
