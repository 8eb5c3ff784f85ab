"""Where model families and decoding modes plug into the engine: the one file that names them.

The engine (engine.py) and its generic parts (scheduler, pool set, row states, step kinds,
output processor) name no model family or decoding mode. What a family or a mode adds comes
from here, once, when the engine is built:

- ``choose_step``: the step kind from the engine's options. ``drafter=`` (``speculative.py``)
  picks the speculative step (``speculative_step.py``); without one, the plain decode step
  (``engine_step.DecodeStep``).
- ``model_parts``: what the model's runner brings beside the KV pool. An hourglass model's
  shortened depths (``hourglass_pools.HourglassPools``) are a pool-set member, a row-state
  participant and a per-step decode hook. Latent-attention (MLA) and hourglass caches
  prefill one prompt at a time, so their prompts are not packed.

A new family or mode adds its participant in its own file and one entry here.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from trainforge.infer.engine_config import EngineConfig
from trainforge.infer.engine_step import DecodeHook, DecodeStep, EngineStep
from trainforge.infer.pool_set import PoolMember
from trainforge.infer.row_state import RowState


def choose_step(model, config: EngineConfig, drafter=None, **unknown) -> tuple[EngineStep, dict[str, Any]]:
    """The step kind for ``config`` and the options, and the parts it names for reporting
    (``Engine.drafter``). Raises for combinations the model or the kind does not support."""
    if unknown:
        raise TypeError(f"Engine() got an unexpected keyword argument {next(iter(unknown))!r} (its options: drafter)")
    step: EngineStep
    if drafter is not None:
        from trainforge.infer.speculative_step import SpeculativeStep

        step = SpeculativeStep(drafter, config.num_speculative_tokens, config.compile)
    else:
        step = DecodeStep(config.sync_interval_steps)
    if model.cfg.is_hourglass and (drafter is not None or config.compile):
        from trainforge.errors import ConfigError

        raise ConfigError(f"model.hourglass = {model.cfg.hourglass!r}: an hourglass model decodes with the plain "
                          f"engine step only ({'speculative decoding' if drafter is not None else 'compile'} "
                          "is not supported for it); drop --speculative / --compile")
    return step, {"drafter": drafter}


@dataclass
class ModelParts:
    """What a model adds to the engine beside its KV pool."""

    pool_members: list[PoolMember] = field(default_factory=list)
    row_states: list[RowState] = field(default_factory=list)
    decode_hooks: list[DecodeHook] = field(default_factory=list)
    packs_prompts: bool = True  # whether its prompts may prefill packed in one forward
    named: dict[str, Any] = field(default_factory=dict)  # attributes the engine reports them by


def model_parts(runner) -> ModelParts:
    """The parts the runner's model brings (``runner``: the engine's ``ModelRunner``)."""
    # The model's pools beyond the paged one (``runner.extra_pools``; ``runner.hourglass`` in a
    # runner that still names the one family that has them): an hourglass model's shortened depths.
    extra = getattr(runner, "extra_pools", None)
    if extra is None:
        extra = getattr(runner, "hourglass", None)
    parts = ModelParts(named={"hourglass": extra})
    if extra is not None:
        parts.pool_members.append(extra)
        parts.row_states.append(extra)
        parts.decode_hooks.append(extra.before_decode)
    # Packed prefill needs one paged cache of per-head keys/values; hourglass and latent (MLA)
    # caches prefill one prompt at a time.
    packs = getattr(runner, "packs_prompts", None)
    parts.packs_prompts = packs if packs is not None else extra is None and not runner.cache.latent
    return parts
