"""Tensor parallelism (Megatron-style) with sequence and loss parallelism, via DTensor.

``apply_tensor_parallel`` rewrites a single-device ``Transformer`` in place with
``torch.distributed.tensor.parallel.parallelize_module``, following torchtitan's Llama plan:

- ``tok_embeddings``: RowwiseParallel (vocab rows sharded). Its partial sums are
  reduce-scattered over the sequence (sequence parallel) or all-reduced (not).
- per block: ``wq/wk/wv`` and ``w1/w3`` ColwiseParallel (each rank holds whole heads and
  a slice of the FFN hidden dim), ``wo/w2`` RowwiseParallel; with sequence parallel the
  norms are SequenceParallel, so between the blocks' matmuls the residual stream is
  (B, T/tp, dim) on each rank and norms / residual adds run on a 1/tp slice of the tokens.
  Without it the stream is the full (B, T, dim) on every rank and the norms run replicated.
- ``norm``: as the block norms; ``output``: ColwiseParallel, vocab sharded. With loss
  parallel the logits stay a Shard(-1) DTensor and the cross-entropy is computed on the
  shards (never materialising (B, T, vocab) on one rank); otherwise they are all-gathered
  into an ordinary replicated tensor.

Each model family declares which of these its modules take, as data beside its modules
(``model/llama_tp.py`` holds the vocabulary; ``model/tp_plans.py`` maps module types to plans).
This file applies plans and names no family: it turns style names into DTensor styles,
decides per module whether it runs on a sequence shard or, as a plan may declare
(``sequence: whole``), on the whole replicated sequence, and installs the hooks a plan names
(gathering a sequence shard before a module, handing shards back after one) under sequence
parallel. A module that reads the trunk's last hidden state on the whole sequence gets it as
the Shard(1) DTensor it is (``reads_trunk_output``), which DTensor all-gathers.

Nothing here is hand-written communication: every collective comes from DTensor. Every
parameter becomes a DTensor (foreach ops reject a mix of Tensors and DTensors). Gradients
do not always arrive in their parameter's placement: the norms' are Partial (the all-reduce
runs lazily, in the first op that needs the value, e.g. clipping or the optimizer) and the
embedding's is Replicate (each rank holds the full (vocab, dim) gradient); FSDP2 redistributes
them itself, a plain optimizer pays the deferred reductions.

Contract for callers (trainer, pipeline stages):

- With sequence parallel the token count T must be divisible by ``tp`` (checked on the
  model's forward; a whole-sequence module's shorter sequences need not be), and activations passed
  *between pipeline stages* are the local sequence shard (B, T/tp, dim): a stage without
  ``tok_embeddings`` takes, and one without ``output`` returns, that shard as a plain tensor.
- The loss is computed as ``with loss_context(lp): loss = cross_entropy_loss(logits,
  targets); loss.backward()`` -- loss parallel needs the backward inside the context.
"""

from __future__ import annotations

import contextlib
from fnmatch import fnmatchcase
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_module
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    loss_parallel,
    parallelize_module,
)

from trainforge.errors import ConfigError
from trainforge.model.config import ModelConfig
from trainforge.model.llama import Transformer
from trainforge.model.tp_plans import tp_plan
from trainforge.parallel.dims import ParallelDims

__all__ = ["apply_tensor_parallel", "check_tensor_parallel", "cross_entropy_loss", "loss_context"]


def check_tensor_parallel(model_config: ModelConfig, tp_degree: int) -> None:
    """Raise ``ConfigError`` naming ``parallel.tp`` when the model cannot be split ``tp_degree``
    ways (heads, KV heads and FFN hidden dim must divide). Pure: no collective, so a bad
    layout fails on every rank with the same message."""
    if tp_degree < 1:
        raise ConfigError(f"config key 'parallel.tp' = {tp_degree}: must be >= 1")
    # A one-stage, tp-only layout: check_model's TP conditions are the ones that apply.
    ParallelDims(pp=1, dp_replicate=1, dp_shard=1, tp=tp_degree, world_size=tp_degree).check_model(model_config)


def apply_tensor_parallel(model: Transformer, tp_mesh: DeviceMesh, *, sequence_parallel: bool = True,
                          loss_parallel: bool = True) -> None:
    """Shard ``model``'s parameters over the 1-D ``tp_mesh`` and install the input/output
    redistribution hooks. Mutates ``model`` in place (parameters become DTensors).

    Call on a model whose weights are identical on every TP rank (same seed): parameters
    are scattered from TP rank 0. ``tok_embeddings`` / ``norm`` / ``output`` may be None
    (pipeline stages); their parts of the plan are skipped. Tied embeddings are supported:
    the embedding and output projection both shard the vocab dim (Shard(0)), so one DTensor
    parameter serves both and the tie is restored after sharding.

    With ``loss_parallel`` the model returns logits as a DTensor sharded on the vocab dim;
    use ``loss_context`` / ``cross_entropy_loss``. Otherwise it returns a plain (B, T, vocab)
    tensor, replicated over the TP ranks. The same holds for the logits of every module that
    shares the output projection.
    """
    if tp_mesh.ndim != 1:
        raise ValueError(f"apply_tensor_parallel needs a 1-D mesh (mesh['tp']), got {tp_mesh.ndim} dims")
    tp = tp_mesh.size()
    check_tensor_parallel(model.cfg, tp)
    tied = (model.cfg.tie_embeddings and model.tok_embeddings is not None and model.output is not None
            and model.output.weight is model.tok_embeddings.weight)

    plans = _collect_plans(model)
    whole = _whole_sequence_paths(model, plans)
    for path, module, plan in plans:
        # A module on the whole, replicated sequence (and everything inside it) lays out the
        # stream Replicate, as without sequence parallel.
        sp = sequence_parallel and not _inside(path, whole)
        styles = {}
        for name, style in plan.get("styles", {}).items():
            for target in _targets(module, name):
                styles[target] = _style(style, sp, loss_parallel)
        if styles:
            parallelize_module(module, tp_mesh, styles)
    if sequence_parallel:
        for path, module, plan in plans:
            for name, hook, arg in plan.get("hooks", ()):
                for target in _targets(module, name):
                    _install_hook(module.get_submodule(target), hook, arg, tp_mesh)
        if any(plan.get("reads_trunk_output") for _, _, plan in plans) and model.layers:
            # The trunk's last (B, T/tp, dim) shard, presented as the (B, T, dim) Shard(1) DTensor it
            # is, so a shift such as h[:, :T-1] slices the global sequence. The final norm
            # (SequenceParallel) takes the DTensor as it took the shard. Installed after the
            # plans' own hooks: a module that hands shards back runs its hook first.
            _trunk_output_module(model, plans).register_forward_hook(_sequence_shard_output(tp_mesh))

    if tied:
        # parallelize_module registered a fresh Parameter on each module; both are the same
        # Shard(0) split of the same rows, so re-share one of them.
        model.output.weight = model.tok_embeddings.weight

    if sequence_parallel and model.tok_embeddings is not None:
        model.register_forward_pre_hook(_sequence_divisible_hook(tp))
    elif sequence_parallel:
        # A later pipeline stage receives its local sequence shard (B, T/tp, dim), but
        # Transformer.forward slices the rope tables by the input's dim 1. Presenting the
        # input as a Shard(1) DTensor makes that dim the global T; the blocks then get the
        # plain local shard back, as they do after a sharded embedding.
        model.register_forward_pre_hook(_wrap_sequence_shard(tp_mesh))
        for block in model.layers.values():
            block.register_forward_pre_hook(_unwrap_sequence_shard)


def _gather_whole_inputs(tp_mesh: DeviceMesh):
    """Forward pre-hook of a whole-sequence module taking (h, emb, ...) under sequence
    parallel: both as plain, replicated (B, T', dim) tensors. h: the trunk's hidden state as
    the DTensor a shift sliced (``_sequence_shard_output``), or already a replicated tensor
    (the output of a whole-sequence module before). emb: embeddings the shared embedding
    reduce-scattered over the ranks (unevenly when tp does not divide T'), gathered back."""
    def hook(module, args):
        h, emb, *rest = args
        if isinstance(h, DTensor):
            h = h.redistribute(placements=(Replicate(),)).to_local()
        emb = DTensor.from_local(emb, tp_mesh, (Shard(1),), run_check=False, shape=h.shape,
                                 stride=(h.shape[1] * h.shape[2], h.shape[2], 1)).full_tensor()
        return (h, emb, *rest)
    return hook


def _sequence_shard_output(tp_mesh: DeviceMesh):
    """Forward hook: a block's local (B, T/tp, dim) output as the (B, T, dim) Shard(1) DTensor."""
    def hook(module, args, out):
        return out if isinstance(out, DTensor) else DTensor.from_local(out, tp_mesh, (Shard(1),), run_check=False)
    return hook


def _gather_sequence_arg(tp_mesh: DeviceMesh, index: int):
    """Forward pre-hook: argument ``index``, a (B, T/tp, dim) sequence shard (plain or the
    Shard(1) DTensor a later pipeline stage's input is), as the full (B, T, dim) tensor."""
    def hook(module, args):
        x = args[index]
        if not isinstance(x, DTensor):
            x = DTensor.from_local(x, tp_mesh, (Shard(1),), run_check=False)
        return (*args[:index], x.full_tensor(), *args[index + 1:])
    return hook


def _shard_sequence_output(tp_mesh: DeviceMesh):
    """Forward hook: a replicated (B, T, dim) output -> this rank's (B, T/tp, dim) shard."""
    def hook(module, args, out):
        return DTensor.from_local(out, tp_mesh, (Replicate(),), run_check=False).redistribute(
            tp_mesh, (Shard(1),)).to_local()
    return hook


def _collect_plans(model: nn.Module) -> list[tuple[str, nn.Module, dict[str, Any]]]:
    """(path, module, plan) of every module of ``model`` whose type has a plan, outside in."""
    return [(path, m, plan) for path, m in model.named_modules() if (plan := tp_plan(m)) is not None]


def _whole_sequence_paths(model: nn.Module, plans) -> set[str]:
    """Paths of the modules that run on the whole, replicated sequence (the plans' ``sequence:
    whole`` and ``whole_sequence_layers``)."""
    whole = {path for path, _, plan in plans if plan.get("sequence") == "whole"}
    for _, _, plan in plans:
        whole |= {f"layers.{name}" for name in plan.get("whole_sequence_layers", ()) if name in model.layers}
    return whole


def _inside(path: str, roots: set[str]) -> bool:
    return any(path == r or path.startswith(r + ".") for r in roots)


def _targets(module: nn.Module, name: str) -> list[str]:
    """The submodules of ``module`` a plan entry names: ``""`` (the module itself), a dotted
    name, or an fnmatch pattern. A name this instance lacks (another variant's projection, a
    part a pipeline stage dropped, a projection set to None) names none."""
    if name == "":
        return [""]
    names = [n for n, _ in module.named_modules() if n]
    if any(c in name for c in "*?["):
        return [n for n in names if fnmatchcase(n, name)]
    return [name] if name in names else []


def _style(name: str, sequence_parallel: bool, loss_parallel: bool) -> ParallelStyle:
    """The DTensor style a plan's style name stands for (vocabulary: ``model/llama_tp.py``),
    for a module whose residual stream is a sequence shard (``sequence_parallel``) or whole."""
    stream = Shard(1) if sequence_parallel else Replicate()
    if name == "colwise":
        return ColwiseParallel()
    if name == "rowwise":
        return RowwiseParallel(output_layouts=stream)
    if name == "rowwise_from_replicated":
        return RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate())
    if name == "stream_input":
        return _StreamInput(stream)
    if name in ("norm", "norm_local"):
        return _norm_style(sequence_parallel, use_local_output=name == "norm_local")
    if name == "embedding":
        return RowwiseParallel(input_layouts=Replicate(), output_layouts=stream)
    if name == "output":
        return ColwiseParallel(input_layouts=stream, output_layouts=Shard(-1) if loss_parallel else Replicate(),
                               use_local_output=not loss_parallel)
    replicate = {"replicate": {}, "replicate_local": {"use_local_output": True},
                 "replicate_partial_grad": {"partial_grad": True},
                 "replicate_local_partial_grad": {"use_local_output": True, "partial_grad": True}}
    if name in replicate:
        return _ReplicateParallel(**replicate[name])
    raise ValueError(f"tensor-parallel plan style {name!r} is not one parallel/tensor_parallel.py applies "
                     "(model/llama_tp.py lists them)")


def _install_hook(module: nn.Module, hook: str, arg: Any, tp_mesh: DeviceMesh) -> None:
    """A plan's named hook (installed under sequence parallel only)."""
    if hook == "gather_sequence_arg":
        module.register_forward_pre_hook(_gather_sequence_arg(tp_mesh, arg))
    elif hook == "shard_sequence_output":
        module.register_forward_hook(_shard_sequence_output(tp_mesh))
    elif hook == "gather_whole_inputs":
        module.register_forward_pre_hook(_gather_whole_inputs(tp_mesh))
    else:
        raise ValueError(f"tensor-parallel plan hook {hook!r} is not one parallel/tensor_parallel.py installs")


def _trunk_output_module(model: nn.Module, plans) -> nn.Module:
    """The module whose output is the trunk's last full-rate hidden state: the model plan's
    ``trunk_output`` (its last block), unless a plan says another module's output follows
    that block (``output_after_layer``: the block then runs on a
    replicated shorter sequence). A pipeline stage ends at the full rate, so its last block
    closes such a module's span or none."""
    path = next(plan["trunk_output"] for p, _, plan in plans if p == "" and plan.get("trunk_output"))
    last = path.rsplit(".", 1)[1]
    for p, module, plan in plans:
        after = plan.get("output_after_layer", {})
        if last in after and after[last] in dict(module.named_modules()):
            return module.get_submodule(after[last])
    return model.get_submodule(path)


class _StreamInput(PrepareModuleInput):
    """The module's first input from the stream's layout to Replicate (an all-gather under
    sequence parallel), as ``PrepareModuleInput`` does; the other inputs (rotary tables, a
    cache) pass through untouched, whatever their number. Redistributing once here lets the
    column-parallel projections share one DTensor input, so their input-gradients are summed
    locally and all-reduced / reduce-scattered once."""

    def __init__(self, stream):
        super().__init__(input_layouts=(stream,), desired_input_layouts=(Replicate(),))

    def _prepare_input_fn(self, inputs, device_mesh):
        first, *rest = inputs if isinstance(inputs, tuple) else (inputs,)
        return (self._prepare_input_arg(first, device_mesh, self.input_layouts[0], self.desired_input_layouts[0]),
                *rest)


def _norm_style(sequence_parallel: bool, use_local_output: bool = False) -> ParallelStyle:
    if sequence_parallel:
        return SequenceParallel(use_local_output=use_local_output)
    return _ReplicateParallel(use_local_output=use_local_output)


class _ReplicateParallel(ParallelStyle):
    """A module run replicated (a norm without sequence parallel, small low-rank projections):
    it computes on the full, replicated input, but its weights still become Replicate
    DTensors. Left plain tensors, they would make the parameter list a mix of Tensors and
    DTensors, which foreach ops reject
    (``clip_grad_norm_``: "got mixed torch.Tensor and DTensor"). torchtitan's ``NoParallel``.

    ``partial_grad``: the gradient of a plain input or output is each rank's partial sum
    (the value feeds this rank's heads only), not the full gradient: a plain input's
    gradient is handed back unreduced, and a plain output's is taken as Partial."""

    def __init__(self, *, use_local_output: bool = False, partial_grad: bool = False):
        super().__init__()
        self.use_local_output = use_local_output
        self.partial_grad = partial_grad

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        def input_fn(mod, inputs, mesh):
            x, *rest = inputs
            if not isinstance(x, DTensor):
                x = (_ReplicatePartialGrad.apply(x, mesh) if self.partial_grad
                     else DTensor.from_local(x, mesh, (Replicate(),), run_check=False))
            return (x, *rest)

        def output_fn(mod, output, mesh):
            if not self.use_local_output:
                return output
            return output.to_local(grad_placements=(Partial(),) if self.partial_grad else None)

        # No partition_fn: distribute_module replicates every parameter from rank 0.
        return distribute_module(module, device_mesh, input_fn=input_fn, output_fn=output_fn)


class _ReplicatePartialGrad(torch.autograd.Function):
    """A plain tensor, identical on the TP ranks -> a Replicate DTensor, whose gradient goes
    back as this rank's local partial sum. (``DTensor.from_local`` would all-reduce a Partial
    gradient into the full one, which a Partial ``to_local`` upstream would count tp times.)"""

    @staticmethod
    def forward(ctx, x: torch.Tensor, mesh: DeviceMesh) -> DTensor:
        return DTensor.from_local(x, mesh, (Replicate(),), run_check=False)

    @staticmethod
    def backward(ctx, grad: DTensor):
        if grad.placements[0].is_partial():
            return grad.to_local(), None
        # Replicated (DTensor reduced it already; compiled backwards do): an equal share per
        # rank sums to it. (Redistributing to Partial instead is refused under torch.compile.)
        return grad.to_local() / grad.device_mesh.size(), None


def _wrap_sequence_shard(tp_mesh: DeviceMesh):
    def hook(module, args):
        h, *rest = args
        if not isinstance(h, DTensor):
            h = DTensor.from_local(h, tp_mesh, (Shard(1),), run_check=False)
        return (h, *rest)
    return hook


def _unwrap_sequence_shard(module, args):
    h, *rest = args
    return (h.to_local() if isinstance(h, DTensor) else h, *rest)


def _sequence_divisible_hook(tp: int):
    def hook(module, args):
        tokens = args[0]
        if tokens.shape[1] % tp:
            # Shard(1) activations are rebuilt from local shards assuming equal sizes, so an
            # uneven split would silently give wrong shapes downstream.
            raise ValueError(
                f"sequence parallel needs the sequence length ({tokens.shape[1]} tokens) to be divisible by "
                f"parallel.tp = {tp}; change training.seq_len, or apply tensor parallel with "
                "sequence_parallel=False (e.g. for incremental decoding)")
    return hook


def loss_context(enabled: bool) -> contextlib.AbstractContextManager:
    """``torch.distributed.tensor.parallel.loss_parallel()`` when ``enabled``, else a no-op.
    Both the loss computation and its ``backward()`` must run inside it."""
    return loss_parallel() if enabled else contextlib.nullcontext()


def cross_entropy_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean token cross-entropy of logits (B, T, vocab) against targets (B, T), in fp32.

    ``logits`` is either a plain tensor or, under ``loss_context(True)``, a DTensor sharded on
    the vocab dim (Shard(-1)); then each rank reduces its own vocab slice and only (B*T,)
    statistics cross ranks. 2-D TP's logits (a DTensor on the grid's 2-D mesh, batch rows split
    too) go to ``tp2d.loss.cross_entropy_2d``. ``targets`` is a plain tensor, identical on the TP ranks.
    Returns a plain scalar tensor (the same value on every TP rank), still attached to the
    graph, so callers can scale, accumulate and ``.item()`` it like any loss."""
    if isinstance(logits, DTensor) and logits.device_mesh.ndim > 1:
        # 2-D tensor parallelism's logits: batch rows split over grid rows as well (tp2d/loss.py).
        from trainforge.parallel.tp2d.loss import cross_entropy_2d

        return cross_entropy_2d(logits, targets)
    # (B, T, V) -> (B*T, V): cross_entropy's class dim is 1, and the flattened logits stay
    # sharded on the (now last) vocab dim.
    loss = F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(0, 1))
    if isinstance(loss, DTensor):
        # Replicated scalar: the local value is the full loss; to_local's backward re-wraps
        # the gradient as a replicated DTensor for the loss-parallel backward.
        loss = loss.to_local()
    return loss
