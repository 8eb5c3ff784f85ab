"""The hourglass spec (``model.hourglass``): which blocks run at which sequence rate and width.

An hourglass model (Nawrot et al. 2022, "Hierarchical Transformers Are More Efficient
Language Models"; the modules are ``hourglass.py``) runs its blocks in *stages*, listed in
the order they run: from the full-rate outside in to the most shortened middle and back out.
Each stage is ``blocks`` transformer blocks at ``shorten`` (the sequence is ``shorten`` times
shorter than the input) and ``width_ratio`` (the stream is ``dim / width_ratio`` wide), both
counted from the model's input, not from the stage before::

    [{blocks = 2}, {blocks = 4, shorten = 2, width_ratio = 2}, {blocks = 2}]      # one shortening
    [{blocks = 1}, {blocks = 1, shorten = 2}, {blocks = 2, shorten = 6, width_ratio = 2},
     {blocks = 1, shorten = 2}, {blocks = 1}]                                     # two (k = 2, then 3)

The stages must mirror each other: the first and last run at the full rate and width (the
embedding, the MTP modules and the output head read them), every step inwards shortens by an
integer k >= 2, and the way out passes the same (shorten, width_ratio) levels in reverse (the
upsampling adds the stream from before the matching shortening, so both sides have one width).
The block counts of mirrored stages may differ; only the middle one must be >= 1.

``ModelConfig`` keeps the spec as its canonical text (``format_spec``): "2@1 4@2/2 2@1" is
2 blocks at rate 1, 4 blocks at 1/2 the tokens and width / 2, then 2 at rate 1. Text, because a
ModelConfig is hashed, compared with a checkpoint's JSON and rebuilt by ``ModelConfig(**meta)``,
and a string survives all three unchanged. Pure Python: the config layer imports it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from trainforge.errors import ConfigError, TrainforgeError

KEY = "model.hourglass"
POOLS = ("mean", "linear")
STAGE_KEYS = ("blocks", "shorten", "width_ratio")


@dataclass(frozen=True)
class HourglassStage:
    blocks: int
    shorten: int = 1  # the input's length / this stage's length
    width_ratio: int = 1  # model dim / this stage's width


def format_spec(stages: tuple[HourglassStage, ...]) -> str:
    """``(HourglassStage(2), HourglassStage(4, 2, 2), HourglassStage(2))`` -> ``"2@1 4@2/2 2@1"``."""
    return " ".join(f"{s.blocks}@{s.shorten}" + (f"/{s.width_ratio}" if s.width_ratio != 1 else "")
                    for s in stages)


_STAGE_TEXT = re.compile(r"(\d+)@(\d+)(?:/(\d+))?")


def parse_spec(text: str, key: str = KEY, error: type[TrainforgeError] = ConfigError) -> tuple[HourglassStage, ...]:
    """The stages of ``format_spec``'s text ("" is no hourglass: ())."""
    stages = []
    for part in text.split():
        m = _STAGE_TEXT.fullmatch(part)
        if m is None:
            raise error(f"config key '{key}' = {text!r}: stage {part!r} is not BLOCKS@SHORTEN or "
                        "BLOCKS@SHORTEN/WIDTH_RATIO (e.g. '2@1 4@2/2 2@1')")
        stages.append(HourglassStage(int(m[1]), int(m[2]), int(m[3] or 1)))
    return tuple(stages)


def stages_from_tables(tables: list[dict], key: str = KEY) -> tuple[HourglassStage, ...]:
    """``[model] hourglass``'s TOML tables -> stages; unknown keys and wrong types name the table."""
    stages = []
    for i, table in enumerate(tables):
        where = f"config key '{key}[{i}]"
        unknown = sorted(set(table) - set(STAGE_KEYS))
        if unknown:
            raise ConfigError(f"{where}' has unknown keys {unknown}: a stage takes {list(STAGE_KEYS)}, e.g. "
                              "{blocks = 4, shorten = 2, width_ratio = 2}")
        if "blocks" not in table:
            raise ConfigError(f"{where}' = {table!r} has no 'blocks': say how many transformer blocks the stage runs")
        values = {k: table.get(k, 1) for k in STAGE_KEYS}
        for k, v in values.items():
            if isinstance(v, bool) or not isinstance(v, int) or v < (0 if k == "blocks" else 1):
                raise ConfigError(f"{where}.{k}' = {v!r}: must be an integer >= {0 if k == 'blocks' else 1}")
        stages.append(HourglassStage(**values))
    return tuple(stages)


def check_spec(stages: tuple[HourglassStage, ...], *, n_layers: int, dim: int, n_heads: int,
               ffn_hidden_dim: int, key: str = KEY, n_layers_key: str = "model.n_layers",
               error: type[TrainforgeError] = ConfigError) -> None:
    """Raise ``error`` naming ``key`` (and the stage) unless ``stages`` is a buildable hourglass
    for this shape (module docstring); ``stages`` () is no hourglass and always passes. The
    key/value heads are kept as they are in every stage (check_shape checked them)."""
    if not stages:
        return
    text = format_spec(stages)

    def bad(why: str) -> TrainforgeError:
        return error(f"config key '{key}' = {text!r}: {why}")

    n = len(stages)
    if n < 3 or n % 2 == 0:
        raise bad(f"{n} stage(s); an hourglass has an odd number >= 3 (full rate, shortened middle, full rate), "
                  "e.g. [{blocks = 2}, {blocks = 4, shorten = 2}, {blocks = 2}]; leave it unset for a dense model")
    for i, s in enumerate(stages):
        if s.blocks < 0 or s.shorten < 1 or s.width_ratio < 1:
            raise bad(f"stage {i}: blocks must be >= 0, shorten and width_ratio >= 1")
    mid = n // 2
    if stages[0].shorten != 1 or stages[0].width_ratio != 1 or stages[-1].shorten != 1 or stages[-1].width_ratio != 1:
        raise bad("the first and last stages must run at the full rate and width (shorten = 1, width_ratio = 1): "
                  "the embedding, the MTP modules and the output head read them")
    for i in range(mid):
        outer, inner = stages[i], stages[i + 1]
        if inner.shorten % outer.shorten or inner.shorten // outer.shorten < 2:
            raise bad(f"stage {i + 1} shortens {inner.shorten}x after stage {i}'s {outer.shorten}x: each step "
                      f"inwards must shorten by an integer k >= 2 (shorten = {2 * outer.shorten}, "
                      f"{3 * outer.shorten}, ...); shorten counts from the input, not from the stage before")
        back = stages[n - 1 - i]
        if (back.shorten, back.width_ratio) != (outer.shorten, outer.width_ratio):
            raise bad(f"stage {n - 1 - i} (shorten {back.shorten}, width_ratio {back.width_ratio}) must mirror "
                      f"stage {i} (shorten {outer.shorten}, width_ratio {outer.width_ratio}): the way out passes "
                      "the levels of the way in, in reverse (the upsampling adds the stream from before the "
                      "matching shortening)")
    if stages[mid].blocks < 1:
        raise bad(f"the middle stage (stage {mid}) has no blocks; give it blocks >= 1")
    for i, s in enumerate(stages):
        r = s.width_ratio
        width = dim // r
        if dim % r or width % n_heads or (width // n_heads) % 2:
            raise bad(f"stage {i}: width_ratio {r} leaves width {dim}/{r} = {dim / r:g}, which must be an "
                      f"integer divisible by model.n_heads = {n_heads} with an even head dim (the stages keep "
                      "the heads and narrow each one); pick a width_ratio that divides dim / (2 * n_heads) = "
                      f"{dim // (2 * n_heads)}")
        if ffn_hidden_dim % r:
            raise bad(f"stage {i}: width_ratio {r} must divide model.ffn_hidden_dim = {ffn_hidden_dim} (a "
                      "stage's feed-forward is ffn_hidden_dim / width_ratio wide)")
    total = sum(s.blocks for s in stages)
    if total != n_layers:
        raise bad(f"its stages hold {total} blocks but {n_layers_key} = {n_layers}: make the blocks add up "
                  f"to {n_layers}, or set {n_layers_key} = {total}")


def check_pool(pool: object, key: str = "model.hourglass_pool", error: type[TrainforgeError] = ConfigError) -> None:
    if pool not in POOLS:
        raise error(f"config key '{key}' = {pool!r}: must be one of {list(POOLS)} (mean of each k positions, or "
                    "a learned linear map of their concatenation)")


def stage_of_layers(stages: tuple[HourglassStage, ...]) -> list[int]:
    """The stage index of each block, in order (blocks are numbered through the stages)."""
    return [i for i, s in enumerate(stages) for _ in range(s.blocks)]


def shortening_spans(stages: tuple[HourglassStage, ...]) -> list[tuple[int, int]]:
    """Per shortening level, outside in: (first, last + 1) of the blocks between the
    shortening and its upsampling (what a pipeline stage must hold whole)."""
    starts = [0]
    for s in stages:
        starts.append(starts[-1] + s.blocks)
    mid = len(stages) // 2
    return [(starts[i + 1], starts[len(stages) - 1 - i]) for i in range(mid)]
