"""The batch-size rule for the learning rate (``optimizer.lr_scaling``): the same recipe
at another global batch.

``training.lr`` is the peak LR tuned at a reference global batch
(``optimizer.lr_reference_batch``, in sequences per optimizer step); a run at global batch
``B`` (``batch_size x grad_accum_steps x`` data-parallel ranks) trains at

- ``none``: ``lr`` (today's behaviour: the LR ignores the batch);
- ``linear``: ``lr x B / reference`` (Goyal et al. 2017, "Accurate, Large Minibatch SGD");
- ``sqrt``: ``lr x sqrt(B / reference)`` (the square-root rule usually quoted for Adam:
  Malladi et al. 2022, "On the SDEs and Scaling Rules for Adaptive Gradient Algorithms").

One rule for every place that changes a batch: the trainer's peak LR, and the planner's
and advisor's batch changes (which say the LR they set). It sits in ``plan/`` because the
planner cannot import ``train/``; the trainer imports it from here. Plain floats in and out.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

LR_SCALINGS = ("none", "linear", "sqrt")


@dataclass(frozen=True)
class LRRecipe:
    """``training.lr`` tuned at ``reference_batch`` sequences, scaled by ``rule`` (the
    planner's ``--lr``, ``--lr_scaling``, ``--lr_reference_batch``)."""

    lr: float
    rule: str = "none"
    reference_batch: int = 0

    def at(self, global_batch: int) -> float:
        return scaled_lr(self.lr, self.rule, global_batch, self.reference_batch)

    def describe(self, global_batch: int) -> str:
        return describe_scaling(self.lr, self.rule, global_batch, self.reference_batch)


def lr_factor(rule: str, global_batch: int, reference_batch: int) -> float:
    """The multiplier of ``training.lr`` at ``global_batch`` sequences per step."""
    if rule not in LR_SCALINGS:
        raise ValueError(f"lr scaling {rule!r} is unknown: use one of {list(LR_SCALINGS)}")
    if rule == "none":
        return 1.0
    if reference_batch < 1 or global_batch < 1:
        raise ValueError(f"lr scaling {rule} needs a reference batch and a global batch >= 1, got "
                         f"{reference_batch} and {global_batch}")
    ratio = global_batch / reference_batch
    return ratio if rule == "linear" else math.sqrt(ratio)


def scaled_lr(lr: float, rule: str, global_batch: int, reference_batch: int) -> float:
    """The effective peak LR of ``lr`` (tuned at ``reference_batch``) at ``global_batch``."""
    return lr * lr_factor(rule, global_batch, reference_batch)


def short_lr(x: float) -> str:
    """``4e-03`` -> ``4.0e-3``: the LR as the logs write it."""
    mantissa, exp = f"{x:.2e}".split("e")
    return f"{mantissa.rstrip('0').rstrip('.')}e{int(exp)}"


def describe_scaling(lr: float, rule: str, global_batch: int, reference_batch: int) -> str:
    """The rule in words, e.g. ``lr scaling linear: global batch 32 sequences / reference 8
    = x4: peak lr 1e-3 -> 4e-3``; ``none``: ``lr scaling none: peak lr 1e-3 at any batch``."""
    if rule == "none":
        return f"lr scaling none: peak lr {short_lr(lr)} at any global batch"
    factor = lr_factor(rule, global_batch, reference_batch)
    how = f"global batch {global_batch} sequences / reference {reference_batch}"
    how = f"sqrt({how})" if rule == "sqrt" else how
    return f"lr scaling {rule}: {how} = x{factor:.4g}: peak lr {short_lr(lr)} -> {short_lr(lr * factor)}"


def batch_change_lr(lr: float, rule: str, reference_batch: int, old_global: int, new_global: int) -> tuple[str, bool]:
    """What changing the global batch ``old_global`` -> ``new_global`` (sequences) does to the
    peak LR of a run with ``training.lr = lr`` and this rule, in words, and whether the LR
    follows by itself (a rule is set, or the batch is unchanged). The planner's and advisor's
    batch changes say this."""
    if rule != "none":
        old, new = (scaled_lr(lr, rule, b, reference_batch) for b in (old_global, new_global))
        if old_global == new_global:
            return f"peak lr {short_lr(new)} unchanged (same global batch)", True
        return (f"peak lr {short_lr(old)} -> {short_lr(new)} (optimizer.lr_scaling = {rule}, reference "
                f"{reference_batch} sequences)", True)
    if old_global == new_global:
        return f"peak lr {short_lr(lr)} unchanged (same global batch)", True
    return (f"training.lr {short_lr(lr)} stays as it is (optimizer.lr_scaling = none): the linear rule gives "
            f"{short_lr(scaled_lr(lr, 'linear', new_global, old_global))}, sqrt "
            f"{short_lr(scaled_lr(lr, 'sqrt', new_global, old_global))}; set optimizer.lr_scaling and "
            f"lr_reference_batch = {old_global} to have it follow the batch", False)
