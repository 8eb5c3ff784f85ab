"""Where ``parallel/`` finds a module's tensor-parallel plan: module type -> the plan its family
declares as data beside its modules (``llama_tp.py``, ``mla_tp.py``, ``mtp_tp.py``,
``hourglass_tp.py``; the vocabulary is in ``llama_tp.py``). A new family adds its plan module and
a line here; ``parallel/tensor_parallel.py``, which applies plans, names no family.

A plan is a dict (or a function of the module returning one, for what depends on the config):

- ``styles``: {submodule name or fnmatch pattern, relative to the module: style name}
- ``sequence``: ``"whole"`` when the module runs on the whole, replicated sequence even under
  sequence parallel (its submodules with it)
- ``whole_sequence_layers``: blocks of the model's ``layers`` that run so
- ``hooks``: [(submodule, hook name, argument)], installed under sequence parallel only
- ``reads_trunk_output`` / ``trunk_output`` / ``output_after_layer``: which module's output is
  the trunk's last full-rate hidden state, and who reads it
"""

from __future__ import annotations

from typing import Any

from torch import nn

from trainforge.model import hourglass_tp, llama_tp, mla_tp, mtp_tp
from trainforge.model.hourglass import HourglassTrunk
from trainforge.model.llama import Attention, Transformer, TransformerBlock
from trainforge.model.mla import MLA
from trainforge.model.mtp import MTPModule
from trainforge.model.swiglu import FeedForward

PLANS: dict[type[nn.Module], Any] = {
    Transformer: llama_tp.model_plan,
    TransformerBlock: {"styles": llama_tp.BLOCK},
    Attention: {"styles": llama_tp.ATTENTION},
    FeedForward: {"styles": llama_tp.FEED_FORWARD},
    MLA: {"styles": mla_tp.ATTENTION},
    MTPModule: mtp_tp.MODULE,
    HourglassTrunk: hourglass_tp.trunk_plan,
}


def tp_plan(module: nn.Module) -> dict[str, Any] | None:
    """``module``'s plan, or None when its type has none (its parameters are then split only
    by an enclosing module's plan, or left alone)."""
    plan = PLANS.get(type(module))
    return plan(module) if callable(plan) else plan


def tp_split_sizes(cfg) -> list[tuple[str, int, str]]:
    """(what, size, why) for every config size the plans of ``cfg``'s model split over the TP
    ranks: ``parallel.tp`` must divide each (``parallel/dims.py`` checks, before any collective)."""
    family = mla_tp if getattr(cfg, "is_mla", False) else llama_tp
    rules = [(f"model.{name}", getattr(cfg, name), why) for name, why in family.SPLIT_SIZES]
    if getattr(cfg, "is_hourglass", False):
        rules += hourglass_tp.split_widths(cfg)
    return rules


def tp_refusal(cfg) -> str | None:
    """Why ``cfg``'s model has no tensor-parallel plan, or None when it has one."""
    if getattr(cfg, "is_moe", False):
        return ("tensor parallelism of mixture-of-experts blocks is not supported (the TP plans shard dense "
                "feed-forwards); use parallel.tp = 1 and split the experts with parallel.ep")
    return None


def tp2d_refusal(cfg) -> tuple[str, str] | None:
    """(config key, what) for the first part of ``cfg``'s model that 2-D tensor parallelism
    (``parallel/tp2d/``, which splits dense blocks only) has no plan for, or None."""
    kinds = [("model.n_routed_experts", getattr(cfg, "is_moe", False), "mixture-of-experts blocks"),
             ("model.kv_lora_rank", getattr(cfg, "is_mla", False), "latent attention (MLA)"),
             ("model.hourglass", getattr(cfg, "is_hourglass", False), "hourglass stages"),
             ("model.mtp_depth", getattr(cfg, "mtp_depth", 0) > 0, "multi-token prediction")]
    return next(((key, what) for key, present, what in kinds if present), None)
