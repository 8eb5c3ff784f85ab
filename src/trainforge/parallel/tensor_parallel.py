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
  Latent attention (MLA) has its own attention plan (``_mla_plan``): the head projections
  split as above, the low-rank ones replicated.
- ``norm``: as the block norms; ``output``: ColwiseParallel, vocab sharded. With loss
  parallel the logits stay a Shard(-1) DTensor and the cross-entropy is computed on the
  shards (never materialising (B, T, vocab) on one rank); otherwise they are all-gathered
  into an ordinary replicated tensor.
- ``mtp`` (multi-token prediction, model/mtp.py; ``_mtp_plan``): depth k runs on its whole
  sequence of T - k positions, replicated on every rank. Its block is split like the main
  ones (heads, FFN hidden dim) with the stream Replicate, as without sequence parallel;
  ``enorm`` / ``hnorm`` / ``norm`` run replicated and ``proj`` is row-parallel. Its logits
  come from the shared ``output``, vocab-sharded like the main ones, so each depth's loss is
  the same loss-parallel cross-entropy. Why replicated: the shift by k positions does not
  commute with a sequence shard (rank r's shard of h[:, :T-k] is not a slice of its shard of
  h), and re-sharding T - k positions would need padding, since tp cannot divide both T and
  T - 1. The gather is paid once per depth: depth 1's h is the slice of the trunk's output
  (the last block's, or an hourglass's outermost upsampling's when its last stage has no
  blocks), presented as the Shard(1) DTensor it is, which DTensor all-gathers, and the
  shifted tokens' embeddings, which the shared embedding reduce-scatters, are all-gathered
  back. Inside the module an all-reduce replaces sequence parallel's all-gather +
  reduce-scatter (the same bytes); the cost is that its norms and residual adds run on all
  T - k positions on every rank, for the few MTP blocks only. Without sequence parallel
  every tensor involved is already replicated and the hooks are not installed.
- ``hourglass`` (model/hourglass.py; ``_parallelize_hourglass``): the shortened stages run
  on their whole, replicated shortened sequence, their blocks split as above with the stream
  Replicate (as the MTP modules'); the pool and up-projections run replicated. Under sequence
  parallel the outermost shortening all-gathers its input and its upsampling hands each rank
  its own sequence shard back, because the shift by k-1 and the pooling of k neighbours do
  not commute with a sequence shard.

Nothing here is hand-written communication: every collective comes from DTensor. Every
parameter becomes a DTensor (foreach ops reject a mix of Tensors and DTensors). Gradients
do not always arrive in their parameter's placement: the norms' are Partial (the all-reduce
runs lazily, in the first op that needs the value, e.g. clipping or the optimizer) and the
embedding's is Replicate (each rank holds the full (vocab, dim) gradient); FSDP2 redistributes
them itself, a plain optimizer pays the deferred reductions.

Contract for callers (trainer, pipeline stages):

- With sequence parallel the token count T must be divisible by ``tp`` (checked on the
  model's forward; the MTP depths' T - k positions need not be), and activations passed
  *between pipeline stages* are the local sequence shard (B, T/tp, dim): a stage without
  ``tok_embeddings`` takes, and one without ``output`` returns, that shard as a plain tensor.
- The loss is computed as ``with loss_context(lp): loss = cross_entropy_loss(logits,
  targets); loss.backward()`` -- loss parallel needs the backward inside the context.
"""

from __future__ import annotations

import contextlib

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
    tensor, replicated over the TP ranks. The same holds for the MTP depths' logits
    (B, T-k, vocab) of ``model(tokens, mtp=True)``.
    """
    if tp_mesh.ndim != 1:
        raise ValueError(f"apply_tensor_parallel needs a 1-D mesh (mesh['tp']), got {tp_mesh.ndim} dims")
    tp = tp_mesh.size()
    check_tensor_parallel(model.cfg, tp)
    tied = (model.cfg.tie_embeddings and model.tok_embeddings is not None and model.output is not None
            and model.output.weight is model.tok_embeddings.weight)

    # Layout of the residual stream between the blocks' matmuls: (B, T/tp, dim) or (B, T, dim).
    stream = Shard(1) if sequence_parallel else Replicate()

    top: dict[str, object] = {}
    if model.tok_embeddings is not None:
        top["tok_embeddings"] = RowwiseParallel(input_layouts=Replicate(), output_layouts=stream)
    if model.norm is not None:
        # Returned as a plain tensor when this stage ends at the norm (no output projection).
        top["norm"] = _norm_style(sequence_parallel, use_local_output=model.output is None)
    if model.output is not None:
        top["output"] = ColwiseParallel(input_layouts=stream,
                                        output_layouts=Shard(-1) if loss_parallel else Replicate(),
                                        use_local_output=not loss_parallel)
    if top:
        parallelize_module(model, tp_mesh, top)

    # Block inputs: only x is a tensor to lay out; cos/sin (T, head_dim) stay plain
    # replicated tensors and the attention cache is None in training. Redistributing x to Replicate once here
    # (an all-gather with SP, a no-op otherwise) lets wq/wk/wv (w1/w3) share one DTensor
    # input, so their input-gradients are summed locally and all-reduced/reduce-scattered once.
    for name, block in model.layers.items():
        # An hourglass model's shortened blocks run on the whole, replicated shortened sequence
        # (_parallelize_hourglass), as without sequence parallel.
        sp = sequence_parallel and model.cfg.layer_stage(int(name)).shorten == 1
        parallelize_module(block, tp_mesh, _block_plan(block, model.cfg.is_mla, sp))
    if getattr(model, "hourglass", None) is not None:
        _parallelize_hourglass(model.hourglass, tp_mesh, sequence_parallel)
    mtp = getattr(model, "mtp", None) or {}
    for module in mtp.values():
        # Replicated sequence, split matmuls (see _mtp_plan); the block as without SP.
        parallelize_module(module, tp_mesh, _mtp_plan(module, model.cfg.is_mla))
        if sequence_parallel:
            module.register_forward_pre_hook(_replicate_mtp_inputs(tp_mesh))
    if mtp and sequence_parallel and model.layers:
        # The trunk's last (B, T/tp, dim) shard, presented as the (B, T, dim) Shard(1) DTensor it
        # is, so Transformer.mtp_hidden's shift h[:, :T-1] slices the global sequence. The final
        # norm (SequenceParallel) takes the DTensor as it took the shard.
        _last_full_rate_module(model).register_forward_hook(_sequence_shard_output(tp_mesh))

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


def _block_plan(block: nn.Module, mla: bool, sequence_parallel: bool) -> dict[str, ParallelStyle]:
    """A ``TransformerBlock``'s plan: heads and the FFN hidden dim split, the residual stream
    between the matmuls Shard(1) (sequence parallel) or Replicate."""
    stream = Shard(1) if sequence_parallel else Replicate()
    return {
        "attention": PrepareModuleInput(input_layouts=(stream, None, None, None),
                                        desired_input_layouts=(Replicate(), None, None, None)),
        **(_mla_plan(block.attention) if mla else {
            "attention.wq": ColwiseParallel(),
            "attention.wk": ColwiseParallel(),
            "attention.wv": ColwiseParallel(),
        }),
        "attention.wo": RowwiseParallel(output_layouts=stream),
        "feed_forward": PrepareModuleInput(input_layouts=(stream,), desired_input_layouts=(Replicate(),)),
        "feed_forward.w1": ColwiseParallel(),
        "feed_forward.w2": RowwiseParallel(output_layouts=stream),
        "feed_forward.w3": ColwiseParallel(),
        "attention_norm": _norm_style(sequence_parallel),
        "ffn_norm": _norm_style(sequence_parallel),
    }


def _mtp_plan(module: nn.Module, mla: bool) -> dict[str, ParallelStyle]:
    """A multi-token prediction module (model/mtp.py) on its whole, replicated sequence of
    T - k positions: ``enorm`` / ``hnorm`` / ``norm`` replicated; ``proj`` (2 dim -> dim)
    row-parallel, each rank multiplying its slice of the concatenation and the partial sums
    all-reduced (slicing a replicated input is free; its input-gradient is then an
    all-gather of 2 dim, where a column split's would be an all-reduce); the block with the
    main blocks' split of heads and FFN hidden dim, its stream replicated as without
    sequence parallelism. The final ``norm`` returns a Replicate DTensor, which the shared
    ``output`` projection (planned for a Shard(1) input) takes without redistributing."""
    return {"enorm": _ReplicateParallel(), "hnorm": _ReplicateParallel(),
            "proj": RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate()),
            "norm": _ReplicateParallel(),
            **{f"block.{name}": style for name, style in _block_plan(module.block, mla, False).items()}}


def _replicate_mtp_inputs(tp_mesh: DeviceMesh):
    """Forward pre-hook of an MTP module under sequence parallel: its inputs as plain,
    replicated (B, T - k, dim) tensors. h: depth 1 gets the main model's hidden state as the
    DTensor the shift sliced (``_sequence_shard_output``); deeper depths the replicated
    output of the depth before. emb: the shared embedding reduce-scattered the T - k rows
    over the ranks (unevenly when tp does not divide T - k), so it is gathered back."""
    def hook(module, args):
        h, emb, *rest = args
        if isinstance(h, DTensor):
            h = h.redistribute(placements=(Replicate(),)).to_local()
        emb = DTensor.from_local(emb, tp_mesh, (Shard(1),), run_check=False, shape=h.shape,
                                 stride=(h.shape[1] * h.shape[2], h.shape[2], 1)).full_tensor()
        return (h, emb, *rest)
    return hook


def _last_full_rate_module(model: nn.Module) -> nn.Module:
    """The module whose output is the trunk's last full-rate hidden state: the last block, or,
    in an hourglass whose last stage has no blocks, the outermost upsampling (the last block is
    then a shortened one, its output the replicated shortened sequence). A pipeline stage ends
    at the full rate (pipeline.check_hourglass_split), so its last block closes the outermost
    level or none; the upsampling's own hook (``_shard_sequence_output``) runs first and hands
    this one the sequence shard."""
    last = next(reversed(model.layers.keys()))
    trunk = getattr(model, "hourglass", None)
    if trunk is not None and trunk.spans and trunk.spans[0][1] - 1 == int(last):
        return trunk.upsample["0"]
    return model.layers[last]


def _sequence_shard_output(tp_mesh: DeviceMesh):
    """Forward hook: a block's local (B, T/tp, dim) output as the (B, T, dim) Shard(1) DTensor."""
    def hook(module, args, out):
        return out if isinstance(out, DTensor) else DTensor.from_local(out, tp_mesh, (Shard(1),), run_check=False)
    return hook


def _parallelize_hourglass(trunk: nn.Module, tp_mesh: DeviceMesh, sequence_parallel: bool) -> None:
    """An hourglass trunk (model/hourglass.py): its shortened stages run replicated, on the
    whole shortened sequence on every rank, with their blocks' heads and FFN hidden dim split
    as usual (stream Replicate, as the MTP modules run). Why: the shift by k-1 and the pooling
    of k neighbours do not commute with a sequence shard, and the shortened sequence (T/k) is
    short, so its norms and residual adds cost little replicated. The pool and up-projections
    (small) run replicated. Under sequence parallel the outermost shortening all-gathers its
    (B, T/tp, dim) input, and its upsampling gathers the residual and hands each rank its own
    shard of the result back; inner levels see replicated tensors only. Every collective is
    DTensor's, so the backward is its too."""
    for module in (*trunk.shorten.values(), *trunk.upsample.values()):
        if module.proj is not None:
            parallelize_module(module.proj, tp_mesh, _ReplicateParallel(use_local_output=True))
    if not sequence_parallel or "0" not in trunk.shorten:
        # Without the outermost level (a pipeline stage holding only full-rate blocks; a stage
        # holds a level whole or not at all) the stage's stream never leaves its sequence shard.
        return
    trunk.shorten["0"].register_forward_pre_hook(_gather_sequence_arg(tp_mesh, 0))
    trunk.upsample["0"].register_forward_pre_hook(_gather_sequence_arg(tp_mesh, 1))
    trunk.upsample["0"].register_forward_hook(_shard_sequence_output(tp_mesh))


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


def _mla_plan(attention: nn.Module) -> dict[str, ParallelStyle]:
    """Latent attention (model/mla.py): the head-producing projections (``wq`` or ``wq_b``,
    ``wkv_b``) are column-parallel, so each rank computes whole heads (the forward derives
    the head count from their output sizes); the low-rank projections and their norms
    (``wq_a``, ``q_norm``, ``wkv_a``, ``kv_norm``) are small and run replicated.

    ``wkv_a``'s output is split inside the forward into the latent (into ``kv_norm`` ->
    ``wkv_b``) and the rotary key shared by all heads (concatenated with this rank's plain
    per-head keys), so it leaves as a plain tensor. Either part's gradient on a rank covers
    that rank's heads only: a partial sum over the TP ranks. ``partial_grad`` keeps it one
    across the plain/DTensor boundaries, so it is reduced once, by DTensor, in ``wkv_a``'s
    backward (its weight gradient arrives Partial, as the norms' do)."""
    if hasattr(attention, "wq"):
        query = {"attention.wq": ColwiseParallel()}
    else:
        # DTensors from wq_a through q_norm into wq_b: DTensor tracks the partial gradient itself.
        query = {"attention.wq_a": _ReplicateParallel(), "attention.q_norm": _ReplicateParallel(),
                 "attention.wq_b": ColwiseParallel()}
    return {**query,
            "attention.wkv_a": _ReplicateParallel(use_local_output=True, partial_grad=True),
            "attention.kv_norm": _ReplicateParallel(partial_grad=True),
            "attention.wkv_b": ColwiseParallel()}


def _norm_style(sequence_parallel: bool, use_local_output: bool = False) -> ParallelStyle:
    if sequence_parallel:
        return SequenceParallel(use_local_output=use_local_output)
    return _ReplicateParallel(use_local_output=use_local_output)


class _ReplicateParallel(ParallelStyle):
    """A module run replicated (a norm without sequence parallel, MLA's low-rank projections):
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
