"""Tensor-parallel plan of a multi-token prediction module (``mtp.py``), as data
(vocabulary: ``llama_tp.py``).

Depth k runs on its whole sequence of T - k positions, replicated on every rank
(``sequence: whole``): the shift by k positions does not commute with a sequence shard (rank
r's shard of h[:, :T-k] is not a slice of its shard of h), and re-sharding T - k positions
would need padding, since tp cannot divide both T and T - 1. Its block splits heads and the
FFN hidden dim as the main blocks do, with the stream replicated; ``enorm`` / ``hnorm`` /
``norm`` run replicated, and ``proj`` (2 dim -> dim) is row-parallel on the replicated
concatenation (slicing it is free; its input-gradient is then an all-gather of 2 dim, where a
column split's would be an all-reduce). The final ``norm`` returns a replicated DTensor, which
the shared output projection takes without redistributing.

Under sequence parallel the inputs are gathered once per depth (``gather_whole_inputs``):
depth 1's h is the trunk's last hidden state (``reads_trunk_output``: presented as the
Shard(1) DTensor it is, which DTensor all-gathers), and the shifted tokens' embeddings, which
the shared embedding reduce-scatters, are all-gathered back. Inside the module an all-reduce
replaces sequence parallel's all-gather + reduce-scatter (the same bytes); the cost is that
its norms and residual adds run on all T - k positions on every rank, for the few MTP blocks
only.

Imports nothing: it sits at the bottom of ``model/``'s layers.
"""

from __future__ import annotations

MODULE = {
    "styles": {"enorm": "replicate", "hnorm": "replicate", "proj": "rowwise_from_replicated", "norm": "replicate"},
    "sequence": "whole",
    "hooks": [("", "gather_whole_inputs", None)],
    "reads_trunk_output": True,
}
