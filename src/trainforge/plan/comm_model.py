"""Collectives in the alpha-beta model, and which link each parallel axis' group uses.

Rank placement is the trainer's mesh (``parallel/dims.py``): axes outermost first
``pp, dp_replicate, dp_shard, tp``, ranks numbered row-major, consecutive ranks on one
node. So an axis' group is ``size`` ranks ``stride`` apart, stride = the product of the
inner axes; expert parallelism groups ``ep`` neighbouring data-parallel ranks (stride tp)
and the expert-data-parallel group the ranks holding the same experts (stride tp x ep).

Link of a group. Inside one node (stride x size <= GPUs per node): the intra tier.
Across nodes with m members per node: NCCL runs m rings side by side, each leaving the node
through its own NIC, so the group's bus bandwidth is min(intra, m x inter). One member per
node is the bare inter tier; a whole node's worth (m = 8) is 8 NICs' worth.

Times, for a message of n bytes on a group of k ranks with bus bandwidth B and per-step
latency a (ring bandwidth term, tree-like latency term as NCCL picks for small messages):
all-reduce 2(k-1)/k·n/B + 2·log2(k)·a; all-gather and reduce-scatter (n = the full
tensor) (k-1)/k·n/B + log2(k)·a; all-to-all (n = this rank's data) (k-1)/k·n/B + (k-1)·a;
point-to-point n/B + a.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from trainforge.plan.spec import Cluster, Layout


@dataclass(frozen=True)
class Link:
    bandwidth_bytes_per_s: float
    latency_s: float
    tier: str  # "intra", "inter" or "none" (a group of one)


def group_link(cluster: Cluster, size: int, stride: int) -> Link:
    """The link a group of ``size`` ranks ``stride`` apart uses (module docstring)."""
    if size <= 1:
        return Link(math.inf, 0.0, "none")
    gpn = cluster.gpus_per_node
    if stride * size <= gpn:
        return Link(cluster.intra.bandwidth_bytes_per_s, cluster.intra.latency_s, "intra")
    per_node = max(1, gpn // stride) if stride < gpn else 1
    bw = min(cluster.intra.bandwidth_bytes_per_s, per_node * cluster.inter.bandwidth_bytes_per_s)
    return Link(bw, cluster.inter.latency_s, "inter")


def axis_links(layout: Layout, cluster: Cluster) -> dict[str, tuple[int, Link]]:
    """axis -> (group size, link) for tp, dp_shard, dp_replicate, pp, ep and edp."""
    tp, shard, rep, pp = layout.tp, layout.dp_shard, layout.dp_replicate, layout.pp
    groups = {"tp": (tp, 1), "dp_shard": (shard, tp), "dp_replicate": (rep, tp * shard),
              "pp": (pp, tp * shard * rep), "ep": (layout.ep, tp),
              "edp": (layout.dp // max(1, layout.ep), tp * layout.ep)}
    return {axis: (size, group_link(cluster, size, stride)) for axis, (size, stride) in groups.items()}


def _log2(k: int) -> float:
    return math.ceil(math.log2(k)) if k > 1 else 0.0


def all_reduce_s(n_bytes: float, k: int, link: Link) -> float:
    if k <= 1 or n_bytes <= 0:
        return 0.0
    return 2 * (k - 1) / k * n_bytes / link.bandwidth_bytes_per_s + 2 * _log2(k) * link.latency_s


def all_gather_s(n_bytes: float, k: int, link: Link) -> float:
    """Also a reduce-scatter: ``n_bytes`` is the full (unsharded) tensor."""
    if k <= 1 or n_bytes <= 0:
        return 0.0
    return (k - 1) / k * n_bytes / link.bandwidth_bytes_per_s + _log2(k) * link.latency_s


reduce_scatter_s = all_gather_s


def all_to_all_s(n_bytes: float, k: int, link: Link) -> float:
    """``n_bytes``: what this rank holds before the exchange; (k-1)/k of it leaves."""
    if k <= 1 or n_bytes <= 0:
        return 0.0
    return (k - 1) / k * n_bytes / link.bandwidth_bytes_per_s + (k - 1) * link.latency_s


def p2p_s(n_bytes: float, link: Link) -> float:
    if link.tier == "none" or n_bytes <= 0:
        return 0.0
    return n_bytes / link.bandwidth_bytes_per_s + link.latency_s
