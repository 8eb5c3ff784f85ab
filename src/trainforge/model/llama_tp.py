"""Tensor-parallel plan of the dense Llama family, as data (torchtitan's Llama plan).

The model is single-device: these dicts only *name* how each submodule splits, and
``parallel/tensor_parallel.py`` turns the names into DTensor styles (``model/tp_plans.py``
tells it which plan belongs to which module type). The vocabulary, relative to the residual
stream between the blocks' matmuls (``(B, T/tp, dim)`` under sequence parallel in a module
that runs on a sequence shard, the whole ``(B, T, dim)`` otherwise):

- ``colwise``: output features split (each rank holds whole heads / a slice of the FFN hidden dim)
- ``rowwise``: input features split; the partial sums are reduced onto the stream
- ``rowwise_from_replicated``: as ``rowwise``, on a replicated input, the output replicated
- ``stream_input``: the module's first input goes from the stream to replicated (one
  all-gather under sequence parallel), so its column-parallel projections share it
- ``norm``: sequence parallel on the stream, or replicated; ``norm_local``: the same,
  returning a plain tensor (a pipeline stage that ends at the final norm)
- ``embedding``: vocab rows split, its output the stream; ``output``: vocab split logits
- ``replicate``, ``replicate_local``: weights replicated (torchtitan's ``NoParallel``),
  output a DTensor or a plain tensor; ``*_partial_grad``: a plain input's or output's gradient
  is this rank's partial sum (the value feeds this rank's heads only)

Imports nothing: it sits at the bottom of ``model/``'s layers.
"""

from __future__ import annotations

ATTENTION = {"wq": "colwise", "wk": "colwise", "wv": "colwise", "wo": "rowwise"}
FEED_FORWARD = {"w1": "colwise", "w2": "rowwise", "w3": "colwise"}
# The block's own modules; its attention and feed-forward bring their own plans.
BLOCK = {"attention": "stream_input", "feed_forward": "stream_input", "attention_norm": "norm", "ffn_norm": "norm"}

# The config sizes these styles split over the TP ranks (``colwise`` heads and hidden units, each
# rank whole ones): parallel.tp must divide each. (config field, why)
SPLIT_SIZES = (("n_heads", "each rank holds whole heads"), ("n_kv_heads", "each rank holds whole heads"),
               ("ffn_hidden_dim", "each rank holds whole hidden units"))


def model_plan(model) -> dict:
    """The ``Transformer``'s own modules. A pipeline stage may lack any of them (they are
    then skipped) and, ending at the norm without the output projection, returns the norm's
    output as a plain tensor. ``trunk_output``: the module whose output is the trunk's last
    full-rate hidden state (what a module that ``reads_trunk_output`` takes)."""
    layers = list(model.layers)
    return {"styles": {"tok_embeddings": "embedding", "norm": "norm" if model.output is not None else "norm_local",
                       "output": "output"},
            "trunk_output": f"layers.{layers[-1]}" if layers else None}
