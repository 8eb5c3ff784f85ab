"""2-D (SUMMA) tensor parallelism in the cost model: when a layout may use it, what it sends
and what that costs on the layout's links, and the panels it keeps for backward.

Which layouts (``tp2d_problem``: ``parallel/tp2d/apply.py``'s ``check_tp2d``, the trainer's
own check, its message). ``tp_mode = "2d"`` needs tp = q x q with q >= 2, a dense Llama model
with untied embeddings (no MoE, latent attention, hourglass stages or MTP modules), no
``torch.compile``, and q dividing the heads, the KV heads, dim, ffn_hidden_dim, the
vocabulary (each grid column holds whole heads and a 1/q block of every width) and the
sequences of one micro-step, and under a pipeline of each of its microbatches (each grid row
takes whole sequences). Under a pipeline the collectives below run per microbatch, the
embedding's on the first stage only and the head's and loss's on the last.

Traffic (``comm``). The collectives are ``comm_bytes.summa_block_collectives`` per block
and ``comm_bytes.summa_edge_collectives`` for the embedding, final norm, output projection and
loss (the lists whose sums are ``comm_bytes.py``'s byte counts, so the planner and that count
cannot drift apart): per SUMMA matmul an all-gather of the activation panel X_i* over the grid
row (q neighbouring ranks) and of each weight panel W_*j over the grid column (q ranks q
apart), their reduce-scatters in backward, the norms' all-reduces, the embedding table's
gradient summed over the column, the loss's per-token all-reduces over the row. Each is priced
by ``comm_model`` on the link its group uses (``group_link(cluster, q, 1)`` for a row,
``group_link(cluster, q, q)`` for a column: on 8-GPU nodes a tp 16 grid keeps its rows inside
a node and sends its columns across nodes); a block's forward ones twice under activation
checkpointing. The bytes are the activation dtype's, weight panels too (an assumption: weights
cast to the compute dtype before they are gathered, as FSDP2's mixed precision gathers them;
the loss's sums are float32).

Memory (``panel_bytes``). Forward keeps X_i* (N/q x d_in) and W_*j (d_in x d_out/q) of every
matmul for backward: per block and microbatch, beyond the activation shards the memory model
already counts per token / tp, tokens x (1/q - 1/tp) x (3 dim + ffn) x a for the four gathered
inputs and the block's weights / q x a for its panels; the output projection's likewise.

Compute is the same FLOPs / tp as 1-D (each rank multiplies (N/q x d_in) by (d_in x d_out/q)).
"""

from __future__ import annotations

from dataclasses import dataclass

from trainforge.errors import ConfigError
from trainforge.model.config import ModelConfig
from trainforge.parallel.tp2d.apply import check_tp2d
from trainforge.parallel.tp2d.comm_bytes import BlockShape, summa_block_collectives, summa_edge_collectives
from trainforge.parallel.tp2d.grid import grid_side
from trainforge.plan import comm_model as cm
from trainforge.plan.spec import Cluster

TP_MODES = ("1d", "2d")


def tp2d_problem(cfg: ModelConfig, tp: int, microstep_seqs: int, pp: int, microbatches: int, compiled: bool) -> str:
    """Why 2-D TP of degree ``tp`` cannot run ``cfg`` with ``microstep_seqs`` sequences per
    micro-step of a data-parallel rank, ``pp`` stages of ``microbatches`` pipeline microbatches,
    ``compiled`` blocks: the trainer's own ``check_tp2d`` message, or ""."""
    try:
        check_tp2d(cfg, tp, batch_size=microstep_seqs, pp=pp, microbatches=microbatches, compile=compiled)
    except ConfigError as e:
        return str(e).removeprefix("config key ")
    return ""


@dataclass(frozen=True)
class Comm:
    """2-D TP collectives of one micro-step on one rank: ``seconds`` on their links, ``sync_s``
    (each one's link ``sync_s``, summed), ``sent_bytes`` per rank (the ring model) and those of
    the blocks alone, ``block_sent_bytes``."""
    seconds: float
    sync_s: float
    sent_bytes: float
    block_sent_bytes: float


def comm(cfg: ModelConfig, microstep_seqs: int, seq_len: int, n_blocks: int, tp: int, elem_bytes: int,
         cluster: Cluster, recompute: bool, embedding: bool = True, head: bool = True) -> Comm:
    """Price ``n_blocks`` blocks' and the edges' collectives for one micro-step (module
    docstring); ``recompute``: activation checkpointing repeats the blocks' forward ones."""
    q = grid_side(tp)
    shape = BlockShape(microstep_seqs, seq_len, cfg.dim, cfg.ffn_hidden_dim, cfg.n_heads, cfg.n_kv_heads)
    links = {"row": cm.group_link(cluster, q, 1), "col": cm.group_link(cluster, q, q)}
    price = {"all_gather": cm.all_gather_s, "reduce_scatter": cm.reduce_scatter_s, "all_reduce": cm.all_reduce_s}
    block = [(c, n_blocks * (2 if recompute and c.phase == "forward" else 1))
             for c in summa_block_collectives(shape, tp, elem_bytes)]
    edges = [(c, 1) for c in summa_edge_collectives(shape.tokens, cfg.dim, cfg.vocab_size, q, elem_bytes,
                                                    embedding=embedding, head=head)]
    seconds = sum(k * price[c.op](c.n_bytes, c.group_size, links[c.group]) for c, k in block + edges)
    sync = sum(k * links[c.group].sync_s for c, k in block + edges)
    block_sent = sum(k * c.sent_bytes for c, k in block)
    return Comm(seconds, sync, block_sent + sum(c.sent_bytes for c, _ in edges), block_sent)


def panel_bytes(cfg: ModelConfig, block_params: float, microstep_tokens: int, tp: int, elem_bytes: int,
                head: bool = False) -> float:
    """Bytes one block (``head``: the output projection) keeps for backward per micro-step
    beyond its activation shards: the gathered X_i* and W_*j panels (module docstring)."""
    q = grid_side(tp)
    if head:
        return (microstep_tokens * (1 / q - 1 / tp) * cfg.dim + cfg.dim * cfg.vocab_size / q) * elem_bytes
    inputs = microstep_tokens * (1 / q - 1 / tp) * (3 * cfg.dim + cfg.ffn_hidden_dim)
    return (inputs + block_params / q) * elem_bytes
