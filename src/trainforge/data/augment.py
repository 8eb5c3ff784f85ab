"""Per-sample augmentation: a registry of seeded transforms, composed in the order of
``[data.augment] transforms`` and applied by the loader's batch assembler.

A sample starts as one window of ``seq_len + 1`` tokens. Two stages:

* ``stream`` transforms rewrite the token window (document shuffling, T5-style span
  corruption, token dropout); a shortened window is padded at the end, and padding
  is never learned (its targets are ``-100``, cross-entropy's ignore index).
* ``pair`` transforms then see (inputs, targets) (token replacement, which corrupts
  inputs only, and the sequence-length curriculum, which truncates both).

Stream transforms must come before pair transforms in the list. Each transform runs
on a sample with probability ``p``. Every sample's RNG is seeded from (seed, augment
seed, epoch, the sample's index in the epoch order): the result does not depend on
timing, threads, or the number of data-parallel ranks, and a resumed run augments
exactly as an uninterrupted one. Other modalities register their own transforms
(and stages) with ``@register``.
"""

from __future__ import annotations

import inspect
import math
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np

from trainforge.errors import ConfigError

IGNORE = -100  # torch.nn.functional.cross_entropy's default ignore_index


@dataclass
class Context:
    """What a transform may know besides the sample: it must not depend on anything else."""

    step: int  # global batch index since the start of training (epoch * batches_per_epoch + position)
    seq_len: int
    vocab_size: int
    eos_id: int


class Transform:
    """Base class. Subclasses set ``stage`` and implement ``__call__``; constructor
    keyword arguments are the config parameters (validated there)."""

    stage = "stream"  # or "pair"
    changes_length = False  # all samples of a batch must agree: such transforms need p = 1

    def __call__(self, *args: Any) -> Any:
        raise NotImplementedError


TRANSFORMS: dict[str, type[Transform]] = {}


def register(name: str) -> Callable[[type[Transform]], type[Transform]]:
    def deco(cls: type[Transform]) -> type[Transform]:
        TRANSFORMS[name] = cls
        return cls
    return deco


def _check(ok: bool, key: str, value: Any, allowed: str) -> None:
    if not ok:
        raise ConfigError(f"config key '{key}' = {value!r} is not allowed: {allowed}")


@register("doc_shuffle")
class DocShuffle(Transform):
    """Permute the documents (end-of-text separated pieces) inside the window."""

    def __call__(self, tokens: np.ndarray, rng: np.random.Generator, ctx: Context) -> np.ndarray:
        cuts = np.flatnonzero(tokens == ctx.eos_id) + 1  # a document keeps its trailing eos
        pieces = np.split(tokens, cuts[cuts < len(tokens)])
        if len(pieces) < 2:
            return tokens
        return np.concatenate([pieces[i] for i in rng.permutation(len(pieces))])


@register("span_corruption")
class SpanCorruption(Transform):
    """T5-style: about ``rate`` of the tokens, in spans of mean length ``mean_span``, are
    replaced by one sentinel each; the sentinels and the removed spans follow at the end
    (``x <s0> y <s1> z ... <s0> span0 <s1> span1``), cut back to the window's length.
    Sentinels are the last ``sentinels`` ids of the vocabulary (T5's convention)."""

    def __init__(self, rate: float = 0.15, mean_span: float = 3.0, sentinels: int = 100):
        self.rate, self.mean_span, self.sentinels = rate, mean_span, sentinels

    def validate(self, key: str) -> None:
        _check(0 < self.rate < 1, f"{key}.rate", self.rate, "a number in (0, 1)")
        _check(self.mean_span >= 1, f"{key}.mean_span", self.mean_span, "a number >= 1")
        _check(isinstance(self.sentinels, int) and self.sentinels >= 1, f"{key}.sentinels", self.sentinels,
               "an integer >= 1")

    def __call__(self, tokens: np.ndarray, rng: np.random.Generator, ctx: Context) -> np.ndarray:
        n = len(tokens)
        n_noise = min(max(int(round(n * self.rate)), 1), n - 1)
        n_spans = min(max(int(round(n_noise / self.mean_span)), 1), n_noise, n - n_noise)
        # Random partitions of the noise and the kept tokens into n_spans non-empty parts each,
        # interleaved keep, noise, keep, noise... (as T5's random_spans_noise_mask).
        noise_len = np.diff(np.r_[0, np.sort(rng.choice(np.arange(1, n_noise), n_spans - 1, replace=False)), n_noise])
        keep_len = np.diff(np.r_[0, np.sort(rng.choice(np.arange(1, n - n_noise), n_spans - 1, replace=False)),
                                 n - n_noise])
        out, tail, at = [], [], 0
        for i in range(n_spans):
            sentinel = ctx.vocab_size - 1 - (i % self.sentinels)
            out.append(tokens[at:at + keep_len[i]])
            at += keep_len[i]
            out.append([sentinel])
            tail.append([sentinel])
            tail.append(tokens[at:at + noise_len[i]])
            at += noise_len[i]
        return np.concatenate(out + tail).astype(np.int64)[:n]


@register("token_dropout")
class TokenDropout(Transform):
    """Delete each token with probability ``rate`` (the window is padded at the end)."""

    def __init__(self, rate: float = 0.1):
        self.rate = rate

    def validate(self, key: str) -> None:
        _check(0 < self.rate < 1, f"{key}.rate", self.rate, "a number in (0, 1)")

    def __call__(self, tokens: np.ndarray, rng: np.random.Generator, ctx: Context) -> np.ndarray:
        return tokens[rng.random(len(tokens)) >= self.rate]


@register("token_replace")
class TokenReplace(Transform):
    """Replace each input token with probability ``rate`` by a uniformly random id; the
    targets stay clean, so the model learns to predict through the noise."""

    stage = "pair"

    def __init__(self, rate: float = 0.1):
        self.rate = rate

    def validate(self, key: str) -> None:
        _check(0 < self.rate < 1, f"{key}.rate", self.rate, "a number in (0, 1)")

    def __call__(self, inputs: np.ndarray, targets: np.ndarray, rng: np.random.Generator,
                 ctx: Context) -> tuple[np.ndarray, np.ndarray]:
        hit = rng.random(len(inputs)) < self.rate
        inputs = inputs.copy()
        inputs[hit] = rng.integers(0, ctx.vocab_size, int(hit.sum()))
        return inputs, targets


@register("seq_curriculum")
class SeqCurriculum(Transform):
    """Short sequences first: the length grows linearly from ``start_len`` to seq_len over
    ``ramp_batches`` batches (rounded down to a multiple of ``multiple``, which bounds the
    number of distinct shapes a compiled model sees). Needs p = 1."""

    stage = "pair"
    changes_length = True

    def __init__(self, start_len: int = 32, ramp_batches: int = 1000, multiple: int = 8):
        self.start_len, self.ramp_batches, self.multiple = start_len, ramp_batches, multiple

    def validate(self, key: str) -> None:
        for name in ("start_len", "ramp_batches", "multiple"):
            v = getattr(self, name)
            _check(isinstance(v, int) and v >= 1, f"{key}.{name}", v, "an integer >= 1")

    def length(self, ctx: Context) -> int:
        frac = min(1.0, ctx.step / self.ramp_batches)
        n = self.start_len + (ctx.seq_len - self.start_len) * frac
        return max(min(self.start_len, ctx.seq_len), min(ctx.seq_len, int(n) // self.multiple * self.multiple))

    def __call__(self, inputs: np.ndarray, targets: np.ndarray, rng: np.random.Generator,
                 ctx: Context) -> tuple[np.ndarray, np.ndarray]:
        n = self.length(ctx)
        return inputs[:n], targets[:n]


def build_transforms(specs: list[dict]) -> list[tuple[Transform, float]]:
    """Validate ``[data.augment] transforms`` and build (transform, p) pairs; ConfigError
    names ``data.augment.transforms[i].<param>`` and what is allowed."""
    out: list[tuple[Transform, float]] = []
    seen_pair = False
    for i, spec in enumerate(specs):
        key = f"data.augment.transforms[{i}]"
        spec = dict(spec)
        name = spec.pop("name", None)
        _check(name in TRANSFORMS, f"{key}.name", name, f"one of {sorted(TRANSFORMS)}")
        p = spec.pop("p", 1.0)
        _check(isinstance(p, (int, float)) and not isinstance(p, bool) and 0 <= p <= 1 and math.isfinite(p),
               f"{key}.p", p, "a probability in [0, 1]")
        cls = TRANSFORMS[name]
        params = [q for q in inspect.signature(cls.__init__).parameters if q != "self"]
        for param, value in spec.items():
            _check(param in params, f"{key}.{param}", value, f"{name} takes name, p and {params}")
        try:
            t = cls(**spec)
        except TypeError as e:
            raise ConfigError(f"config key '{key}': {e}") from None
        if hasattr(t, "validate"):
            t.validate(key)
        if t.changes_length:
            _check(p == 1, f"{key}.p", p, f"1 ({name} changes the sequence length, which all rows of a batch share)")
        if t.stage == "pair":
            seen_pair = True
        elif seen_pair:
            raise ConfigError(f"config key '{key}.name' = {name!r}: a stream transform must come before the pair "
                              "transforms (token_replace, seq_curriculum) in data.augment.transforms")
        out.append((t, float(p)))
    return out


class Augmenter:
    """Applies the configured transforms to one window; see the module docstring."""

    def __init__(self, specs: list[dict], seed: int, augment_seed: int, vocab_size: int, eos_id: int, seq_len: int):
        self.transforms = build_transforms(specs)
        self.seed, self.augment_seed = seed, augment_seed
        self.vocab_size, self.eos_id, self.seq_len = vocab_size, eos_id, seq_len

    @property
    def changes_length(self) -> bool:
        return any(t.changes_length for t, _ in self.transforms)

    def __call__(self, window: np.ndarray, epoch: int, sample_id: int, step: int) -> tuple[np.ndarray, np.ndarray]:
        """(seq_len + 1,) tokens -> (inputs, targets), int64, length seq_len (or the curriculum's)."""
        rng = np.random.default_rng([self.seed, self.augment_seed, epoch, sample_id])
        ctx = Context(step, self.seq_len, self.vocab_size, self.eos_id)
        tokens = window.astype(np.int64)
        n = len(tokens)
        pairs = []
        for t, p in self.transforms:
            if rng.random() >= p:
                continue
            if t.stage == "stream":
                tokens = t(tokens, rng, ctx)
            else:
                pairs.append(t)
        valid = len(tokens)
        padded = np.full(n, self.eos_id, dtype=np.int64)  # (T+1,)
        padded[:valid] = tokens[:n]
        inputs, targets = padded[:-1], padded[1:].copy()
        targets[max(valid - 1, 0):] = IGNORE  # targets beyond the real tokens are not learned
        for t in pairs:
            inputs, targets = t(inputs, targets, rng, ctx)
        return inputs, targets
