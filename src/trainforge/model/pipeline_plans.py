"""How ``parallel/pipeline.py`` cuts a model into stages, as data each family declares (as
``tp_plans.py`` does for tensor parallelism): the pipeline applies a ``StagePlan`` and names
no family. A new family that places modules outside the blocks adds its part here.

A stage is a copy of the model holding a run of blocks (``layers``) and, beside them:

- the dense model's own: ``tok_embeddings`` on the first stage, ``norm`` and ``output`` on the
  last (``stage_plan`` of any config);
- multi-token prediction (``cfg.mtp_depth`` > 0, mtp.py): the MTP modules live on the last
  stage with a copy of ``tok_embeddings`` (same FQN, so checkpoints need no renaming): depth k
  reads the input tokens t + k (k >= 1), which are the targets t + k - 1, so the last stage
  needs nothing more than the targets it already has. Its module is called with
  ``return_hidden=True`` and returns (logits, h), h the last block's output before the final
  norm; the loss runs the MTP chain on h (``train/mtp_loss.py``). The two embedding copies'
  gradients are summed after each backward (``parallel/shared_embedding.py``). Other stages
  hold an empty ``mtp`` ModuleDict, as a model without MTP does;
- an hourglass (``cfg.hourglass``, hourglass.py): level k's shortening and upsampling belong
  to the stage holding the level's first block; ``cfg.pipeline_spans`` keeps the level's
  blocks on that stage (``pipeline.check_stage_starts``).
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class StagePlan:
    """Where the modules outside the blocks go. Names are attribute paths in the model."""

    first: tuple[str, ...] = ("tok_embeddings",)  # only the first stage holds them
    last: tuple[str, ...] = ("norm", "output")  # only the last stage holds them
    # Modules of ``first`` the last stage holds a copy of (same FQN); their gradients are summed
    # over both copies after each backward, so both apply the same update.
    shared: tuple[str, ...] = ()
    # Modules of ``last`` that other stages hold empty (an empty ModuleDict) rather than as None.
    emptied: tuple[str, ...] = ()
    # (block, paths): modules held by the stage holding that block, e.g. a level's shortening.
    with_block: tuple[tuple[int, tuple[str, ...]], ...] = ()
    # Keyword arguments of every call of the last stage's module.
    last_call_kwargs: dict = field(default_factory=dict)
    # The last stage returns (logits, extra) rather than logits (``loss_fn`` receives the pair).
    last_returns_pair: bool = False


def stage_plan(cfg) -> StagePlan:
    """The plan of ``cfg``'s model (a ``ModelConfig``)."""
    last, shared, emptied, kwargs, pair = ("norm", "output"), (), (), {}, False
    if getattr(cfg, "mtp_depth", 0) > 0:
        last, shared, emptied = last + ("mtp",), ("tok_embeddings",), ("mtp",)
        kwargs, pair = {"return_hidden": True}, True
    levels = cfg.pipeline_spans if getattr(cfg, "is_hourglass", False) else ()  # one span per level
    with_block = tuple((first, (f"hourglass.shorten.{level}", f"hourglass.upsample.{level}"))
                       for level, (first, _) in enumerate(levels))
    return StagePlan(last=last, shared=shared, emptied=emptied, with_block=with_block,
                     last_call_kwargs=kwargs, last_returns_pair=pair)


def split_backward_refusal(cfg) -> str | None:
    """Why a schedule that splits the backward into input and weight passes (zbv, dualpipev)
    cannot run ``cfg``'s model over several stages, naming the key to change; None when it can.

    torch 2.13's split backward computes a parameter group's weight gradients from each of its
    meeting points with the stage input; the embedding meets it at every MTP depth's
    concatenation, and depth 2's path back to the embedding crosses depth 1's block, whose saved
    tensors the first of those passes frees ("backward through the graph a second time")."""
    depth = getattr(cfg, "mtp_depth", 0)
    if depth >= 2:
        return (f"torch cannot run over model.mtp_depth = {depth} MTP depths sharing the embedding on the "
                "last stage; use gpipe, 1f1b or interleaved-1f1b, or model.mtp_depth = 1")
    return None
