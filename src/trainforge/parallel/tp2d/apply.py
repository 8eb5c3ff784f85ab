"""Apply 2-D (SUMMA) tensor parallelism to a single-device Llama ``Transformer``, from outside.

``apply_tp2d(model, tp_mesh)`` swaps modules in place (``parallelize_module_stack`` calls it
for ``parallel.tp_mode = "2d"``, in 1-D TP's place: step 2 of ``parallel/apply.py``). The tp
ranks form a q x q grid (``grid.py``); rank (i, j) holds batch rows block i (whole
sequences) and hidden block j of the residual stream, X_ij (B/q, T, dim/q):

- ``tok_embeddings`` -> ``Embedding2D``: takes the full (B, T) tokens every tp rank gets,
  looks up batch block i in its hidden block j of the table; no forward communication.
- per block: ``attention_norm`` / ``ffn_norm`` -> ``RMSNorm2D``; ``wq wk wv wo w1 w2 w3`` ->
  ``Linear2D`` (SUMMA; heads split by grid column, so the attention between the projections
  is local: q divides n_heads and n_kv_heads, and grid column j's query heads use exactly its
  KV heads). The attention's and the feed-forward's input is gathered over the grid row once
  (a forward pre-hook, ``row_gather``) and shared by wq / wk / wv and by w1 / w3, whose
  input gradients autograd sums before the one reduce-scatter. ``wo`` and ``w2`` gather
  their own input. ``Attention.forward`` reshapes with -1, so it runs on n_heads / q local
  heads of B/q rows unchanged.
- ``norm`` -> ``RMSNorm2D``; ``output`` -> ``Linear2D`` whose (B/q, T, vocab/q) result is
  returned as the (B, T, vocab) DTensor (Shard(0), Shard(2)) it is, for ``loss.py``'s
  vocab-parallel cross-entropy (``tensor_parallel.cross_entropy_loss`` routes it there).

Under a pipeline (``parallel.pp`` > 1) each stage is split the same way and the stages pass
X_ij (B/m/q, T, dim/q) of a microbatch of B/m sequences as a plain tensor, as 1-D TP passes
its sequence shard: the first stage's ``Embedding2D`` makes it from the microbatch's tokens,
the last stage's output projection consumes it; the schedule infers those local shapes on
its first step. So q must divide each microbatch's rows (``check_tp2d``).

Every parameter becomes a DTensor on the grid's 2-D mesh with the single-device FQN and full
shape, so DCP reshards a checkpoint between 2-D, 1-D and one process, and DTensor's norm
counts each shard once (gradient clipping). What the layout does not cover is refused by
``check_tp2d`` before any collective, naming the key.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard

from trainforge.errors import ConfigError
from trainforge.model.llama import Transformer
from trainforge.model.tp_plans import tp2d_refusal
from trainforge.parallel.tp2d.embedding import Embedding2D
from trainforge.parallel.tp2d.grid import Grid2D, grid_side
from trainforge.parallel.tp2d.norm import RMSNorm2D
from trainforge.parallel.tp2d.summa import Linear2D, row_gather

__all__ = ["apply_tp2d", "check_tp2d"]

_MODE = 'parallel.tp_mode = "2d"'


def check_tp2d(model_config, tp: int, *, batch_size: int | None = None, pp: int = 1, microbatches: int = 1,
               compile: bool = False, loss_chunk_tokens: int = 0) -> None:
    """Raise ``ConfigError``, naming the keys, for a model or layout 2-D TP does not split.
    Pure: no collective, so a bad layout fails on every rank with the same message.
    ``batch_size``: sequences per micro-batch of one dp rank (``training.batch_size``);
    ``microbatches``: the pipeline's (``parallel.microbatches``, resolved), used when ``pp`` > 1:
    each pipeline microbatch's rows are split over the grid rows."""
    q = grid_side(tp)
    c = model_config
    kinds = [tp2d_refusal(c) or (None, ""),
             ("model.tie_embeddings" if c.tie_embeddings else None,
              "tied embeddings (the table is split by hidden over grid columns, the output projection by vocab "
              "and hidden over both grid axes: one parameter cannot hold both)")]
    for key, what in kinds:
        if key is not None:
            raise ConfigError(f"config key '{key}' = {getattr(c, key.split('.')[1])!r} with {_MODE}: 2-D tensor "
                              f"parallelism splits dense Llama blocks only, not {what}; use parallel.tp_mode = "
                              "\"1d\" or a dense model")
    for key, value in (("model.n_heads", c.n_heads), ("model.n_kv_heads", c.n_kv_heads), ("model.dim", c.dim),
                       ("model.ffn_hidden_dim", c.ffn_hidden_dim), ("model.vocab_size", c.vocab_size)):
        if value % q:
            raise ConfigError(f"config key '{key}' = {value} with {_MODE} and parallel.tp = {tp}: the grid side "
                              f"q = {q} must divide it (heads and widths are split over grid columns and rows); "
                              f"change {key} or parallel.tp")
    if batch_size is not None and batch_size % q:
        raise ConfigError(f"config key 'training.batch_size' = {batch_size} with {_MODE} and parallel.tp = {tp}: "
                          f"each data-parallel rank's micro-batch is split into q = {q} blocks of whole sequences "
                          f"(one per grid row); make training.batch_size a multiple of {q}")
    if pp > 1 and batch_size is not None and microbatches > 1 and (batch_size // microbatches) % q:
        # The schedule splits the batch into microbatches first; the first stage's embedding then
        # splits each microbatch's rows over the grid rows, and the stages pass (B/m/q, T, dim/q).
        raise ConfigError(f"config key 'parallel.microbatches' = {microbatches} with training.batch_size = "
                          f"{batch_size}, {_MODE}, parallel.tp = {tp} and parallel.pp = {pp}: each pipeline "
                          f"microbatch of {batch_size // microbatches} sequences is split into q = {q} blocks of "
                          f"whole sequences (one per grid row); make training.batch_size a multiple of "
                          f"parallel.microbatches x q = {microbatches * q}, or use fewer microbatches")
    if compile:
        raise ConfigError(f"config key 'parallel.compile' = true with {_MODE}: the SUMMA collectives are hand-written "
                          "autograd functions on the grid's process groups, not traced by torch.compile here; use "
                          "parallel.compile = false or parallel.tp_mode = \"1d\"")
    if loss_chunk_tokens:
        raise ConfigError(f"config key 'training.loss_chunk_tokens' = {loss_chunk_tokens} with {_MODE}: the 2-D "
                          "logits are already split over the grid (B/q rows, vocab/q columns per rank); use "
                          "training.loss_chunk_tokens = 0")


def apply_tp2d(model: Transformer, tp_mesh: DeviceMesh) -> Grid2D:
    """Split ``model`` (identical on every tp rank: same seed) over the q x q grid of the 1-D
    ``tp_mesh``; mutates it in place (modules swapped, hooks added). Collective over the tp
    ranks (the grid's mesh). ``tok_embeddings`` / ``norm`` / ``output`` may be None.
    Returns the grid.

    Contract for callers: ``model(tokens)`` takes the full (B, T) batch on every tp rank
    (B divisible by q) and returns the logits as a (B, T, vocab) DTensor (Shard(0), Shard(2))
    on the grid's mesh; its loss is ``tensor_parallel.cross_entropy_loss`` under
    ``loss_context(True)``, forward and backward."""
    if tp_mesh.ndim != 1:
        raise ValueError(f"apply_tp2d needs the 1-D tp mesh (mesh['tp']), got {tp_mesh.ndim} dims")
    check_tp2d(model.cfg, tp_mesh.size())
    grid = Grid2D.from_tp_mesh(tp_mesh)
    # The grid's dims flattened once (a group over the tp ranks, registered on the root mesh), so
    # that DTensor reduces a norm Partial over both grid dims (the gradient norm) in one all-reduce
    # instead of two in turn.
    grid.mesh._flatten("tp_grid")
    if model.tok_embeddings is not None:
        model.tok_embeddings = Embedding2D.from_embedding(model.tok_embeddings, grid)
    for block in model.layers.values():
        block.attention_norm = RMSNorm2D.from_rmsnorm(block.attention_norm, grid)
        block.ffn_norm = RMSNorm2D.from_rmsnorm(block.ffn_norm, grid)
        attention, ffn = block.attention, block.feed_forward
        for module, shared, own in ((attention, ("wq", "wk", "wv"), "wo"), (ffn, ("w1", "w3"), "w2")):
            for name in shared:
                setattr(module, name, Linear2D.from_linear(getattr(module, name), grid, input_gathered=True))
            setattr(module, own, Linear2D.from_linear(getattr(module, own), grid))
            module.register_forward_pre_hook(_gather_input(grid))
    if model.norm is not None:
        model.norm = RMSNorm2D.from_rmsnorm(model.norm, grid)
    if model.output is not None:
        model.output = Linear2D.from_linear(model.output, grid)
        model.output.register_forward_hook(_logits_as_dtensor(grid))
    leftover = [n for n, p in model.named_parameters() if not isinstance(p, DTensor)]
    assert not leftover, f"apply_tp2d left plain parameters {leftover}"  # foreach optimizer ops reject a mix
    return grid


def _gather_input(grid: Grid2D):
    """Forward pre-hook of an attention / feed-forward: X_ij (B/q, T, dim/q) -> X_i* (B/q, T, dim),
    once for the projections that share it (the rope tables and the cache pass unchanged)."""
    def hook(module: nn.Module, args: tuple) -> tuple:
        x, *rest = args
        return (row_gather(x, grid), *rest)
    return hook


def _logits_as_dtensor(grid: Grid2D):
    """Forward hook of the output projection: this rank's (B/q, T, vocab/q) block as the
    (B, T, vocab) DTensor (Shard(0), Shard(2)) on the grid's mesh."""
    def hook(module: nn.Module, args: tuple, out: torch.Tensor) -> DTensor:
        return DTensor.from_local(out, grid.mesh, (Shard(0), Shard(out.dim() - 1)), run_check=False)
    return hook
