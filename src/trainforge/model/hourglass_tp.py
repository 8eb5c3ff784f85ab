"""Tensor-parallel plan of the hourglass trunk (``hourglass.py``), as data (vocabulary:
``llama_tp.py``).

The shortened stages run on their whole, replicated shortened sequence, their blocks split as
usual (heads, FFN hidden dim) with the stream replicated, as the MTP modules run: the shift by
k-1 and the pooling of k neighbours do not commute with a sequence shard, and the shortened
sequence (T/k) is short, so its norms and residual adds cost little replicated. The pool and
up-projections (small) run replicated. Under sequence parallel the outermost shortening
all-gathers its (B, T/tp, dim) input, and its upsampling gathers the residual and hands each
rank its own shard of the result back; inner levels see replicated tensors only. A pipeline
stage holds a level whole or not at all; without the outermost level the hooks are skipped and
the stage's stream never leaves its sequence shard.

Imports nothing: it sits at the bottom of ``model/``'s layers.
"""

from __future__ import annotations


def trunk_plan(trunk) -> dict:
    """``trunk``: a ``HourglassTrunk``. ``whole_sequence_layers``: the model's blocks (names in
    ``Transformer.layers``) that run on a shortened, replicated sequence. ``output_after_layer``:
    the full-rate stream after that block is the outermost upsampling's output, not the block's
    (the block is then a shortened one)."""
    cfg = trunk.cfg
    last_inner = trunk.spans[0][1] - 1 if trunk.spans else None
    return {
        "styles": {"shorten.*.proj": "replicate_local", "upsample.*.proj": "replicate_local"},
        "whole_sequence_layers": [str(i) for i in range(cfg.n_layers) if cfg.layer_stage(i).shorten != 1],
        "hooks": [("shorten.0", "gather_sequence_arg", 0), ("upsample.0", "gather_sequence_arg", 1),
                  ("upsample.0", "shard_sequence_output", None)],
        "output_after_layer": {} if last_inner is None else {str(last_inner): "upsample.0"},
    }


def split_widths(cfg) -> list[tuple[str, int, str]]:
    """(what, size, why) of the narrower stages' feed-forward widths, which their blocks split as
    the full-width ones do: parallel.tp must divide each."""
    ratios = sorted({s.width_ratio for s in cfg.hourglass_stages} - {1})
    return [(f"the feed-forward width of the model.hourglass stages at width_ratio {r}, model.ffn_hidden_dim / {r}",
             cfg.ffn_hidden_dim // r, "each rank holds whole hidden units") for r in ratios]
