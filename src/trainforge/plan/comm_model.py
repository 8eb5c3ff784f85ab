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

Measured clusters (``probe.MeasuredCluster``) carry the probe's own alpha-beta fit per op and
group size (gloo's all-reduce, all-gather, reduce-scatter and ring send/recv, timed with as
many groups at once as the layout has): a group of such a cluster prices those ops by their
own fit (``Link.fits``), not by the one tier that best explains them all. Why: on gloo the
ops differ by more than the formulas allow (its reduce-scatter costs an all-reduce, and
more: 5.2 ms + 1.7 ns/byte against the all-gather's 1.7 ms + 1.0 ns/byte on 4 processes
of a 2-vCPU guest), and a step issues dozens of them. Such a group also carries ``sync_s``: what a blocking
collective costs beyond that where every rank computed just before it (a core gone idle
waking, the ranks' jitter), which the cost model adds per collective it counts.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Mapping

from trainforge.plan.spec import Cluster, Layout


@dataclass(frozen=True)
class Link:
    bandwidth_bytes_per_s: float
    latency_s: float
    tier: str  # "intra", "inter" or "none" (a group of one)
    # op -> the probe's fit (alpha_s, beta_s_per_byte) for this group size; None: the formulas
    fits: Mapping[str, Any] | None = field(default=None, compare=False)
    # What one blocking collective adds where the ranks computed just before it, beyond its time
    # back to back (the probe's ``sync_s``; 0 without a measurement).
    sync_s: float = 0.0


def _fitted(link: Link, op: str, n_bytes: float) -> float | None:
    fit = link.fits.get(op) if link.fits else None
    return fit.alpha_s + fit.beta_s_per_byte * n_bytes if fit is not None else None


def group_link(cluster: Cluster, size: int, stride: int) -> Link:
    """The link a group of ``size`` ranks ``stride`` apart uses (module docstring)."""
    if size <= 1:
        return Link(math.inf, 0.0, "none")
    gpn = cluster.gpus_per_node
    if stride * size <= gpn:
        measured = getattr(cluster, "collectives", None) or {}
        fits = {op: by_size[size] for op, by_size in measured.items() if size in by_size}
        sync = (getattr(cluster, "sync_s", None) or {}).get(size, 0.0)
        return Link(cluster.intra.bandwidth_bytes_per_s, cluster.intra.latency_s, "intra", fits or None, sync)
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
    fitted = _fitted(link, "all_reduce", n_bytes)
    if fitted is not None:
        return fitted
    return 2 * (k - 1) / k * n_bytes / link.bandwidth_bytes_per_s + 2 * _log2(k) * link.latency_s


def _ring_half_s(op: str, n_bytes: float, k: int, link: Link) -> float:
    if k <= 1 or n_bytes <= 0:
        return 0.0
    fitted = _fitted(link, op, n_bytes)
    if fitted is not None:
        return fitted
    return (k - 1) / k * n_bytes / link.bandwidth_bytes_per_s + _log2(k) * link.latency_s


def all_gather_s(n_bytes: float, k: int, link: Link) -> float:
    """``n_bytes`` is the full (gathered) tensor."""
    return _ring_half_s("all_gather", n_bytes, k, link)


def reduce_scatter_s(n_bytes: float, k: int, link: Link) -> float:
    """``n_bytes`` is the full (unsharded) tensor; the formula is the all-gather's."""
    return _ring_half_s("reduce_scatter", n_bytes, k, link)


def all_to_all_s(n_bytes: float, k: int, link: Link) -> float:
    """``n_bytes``: what this rank holds before the exchange; (k-1)/k of it leaves."""
    if k <= 1 or n_bytes <= 0:
        return 0.0
    return (k - 1) / k * n_bytes / link.bandwidth_bytes_per_s + (k - 1) * link.latency_s


def p2p_s(n_bytes: float, link: Link) -> float:
    if link.tier == "none" or n_bytes <= 0:
        return 0.0
    fitted = _fitted(link, "send_recv", n_bytes)
    if fitted is not None:
        return fitted
    return n_bytes / link.bandwidth_bytes_per_s + link.latency_s
