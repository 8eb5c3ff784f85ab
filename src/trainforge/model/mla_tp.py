"""Tensor-parallel plan of latent attention (``mla.py``), as data (vocabulary: ``llama_tp.py``).

The head-producing projections (``wq`` or ``wq_b``, ``wkv_b``) are column-parallel, so each
rank computes whole heads (the forward derives the head count from their output sizes); the
low-rank projections and their norms (``wq_a``, ``q_norm``, ``wkv_a``, ``kv_norm``) are small
and run replicated. A config has ``wq`` or ``wq_a``/``q_norm``/``wq_b``, not both: entries for
modules an instance lacks are skipped.

``wkv_a``'s output is split inside the forward into the latent (into ``kv_norm`` -> ``wkv_b``)
and the rotary key shared by all heads (concatenated with this rank's plain per-head keys), so
it leaves as a plain tensor. Either part's gradient on a rank covers that rank's heads only: a
partial sum over the TP ranks, kept one across the plain/DTensor boundaries (``partial_grad``)
so it is reduced once, in ``wkv_a``'s backward (its weight gradient arrives Partial, as the
norms' do). From ``wq_a`` through ``q_norm`` into ``wq_b`` the tensors stay DTensors, which
track the partial gradient themselves.

Imports nothing: it sits at the bottom of ``model/``'s layers.
"""

from __future__ import annotations

ATTENTION = {
    "wq": "colwise",
    "wq_a": "replicate", "q_norm": "replicate", "wq_b": "colwise",
    "wkv_a": "replicate_local_partial_grad", "kv_norm": "replicate_partial_grad", "wkv_b": "colwise",
    "wo": "rowwise",
}

# Latent attention has no separate KV heads (one latent and one rotary key serve all heads), so its
# plan splits the query heads only; the feed-forward's sizes are the dense block's.
SPLIT_SIZES = (("n_heads", "each rank holds whole heads"), ("ffn_hidden_dim", "each rank holds whole hidden units"))
