"""The decode state of an hourglass trunk (``hourglass.py``): what lets the engine run the
middle stages once every k tokens through the model's own forward.

Per shortening level (factor k over the level outside it) and per sequence row it keeps:

- ``groups[level]`` (rows, k, d_outer): the level's input stream since its last closed group.
  At the outer rate of the level, token t belongs to group ceil(t / k) at slot (t + k - 1) % k:
  group j pools tokens jk-k+1 .. jk (the training forward's shift by k - 1), so group 0 is
  k - 1 zero rows (the shift) and token 0, and token t closes a group when t % k == 0;
- ``inner[level]`` (rows, d_inner): the output of the level's inner blocks at its latest closed
  group, which every token until the next closed group upsamples (token t reads group t // k).

And per *depth* (0: the full-rate blocks, d: the blocks inside d shortenings and no more) an
``AttentionCache`` of that depth's blocks, with its own rate (one entry per ``rate`` tokens, at
positions 0, 1, 2, ... of that rate) and width: the owner (``infer/hourglass_pools.py``) sizes
the paged pools and writes each step's slots, gathers and masks for the rows that run there.

A step is one of two kinds, set by the owner before the forward:

- ``set_prefill(row)``: one sequence's prompt (positions 0..T-1) for engine row ``row``. Each
  level runs as in training; the cache keeps the unfinished group's rows and the last inner
  output.
- ``set_decode(positions)``: one token for each of rows 0..B-1, token positions ``positions``
  (B,) — any mix of phases. At a level, the rows entering it (level 0: all; level l: those
  whose token closed a group of level l - 1) write their row into their group; those whose
  token closes the group are pooled (``Shortening.pool_groups``) and go on to the inner blocks
  at their group's position; the rest skip them. Every entering row then upsamples
  (``Upsampling``) its latest inner output. The shortened blocks thus run on a subset of the
  batch, in a batch of their own: rows at different phases decode together.

The math stays in the modules (``Shortening``, ``Upsampling``, the blocks): this object only
chooses which rows go where and remembers what a later token needs.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

from trainforge.model.attention_cache import AttentionCache, LayerCache
from trainforge.model.hourglass_spec import shortening_spans


def block_depths(cfg) -> list[int]:
    """Per block, the number of shortenings it sits inside (0: full rate)."""
    spans = shortening_spans(cfg.hourglass_stages)
    return [sum(first <= j < end for first, end in spans) for j in range(cfg.n_layers)]


def level_factors(cfg) -> list[tuple[int, int, int, int]]:
    """Per level, outside in: (k, outer rate, d_outer, d_inner); rate = tokens per position."""
    stages = cfg.hourglass_stages
    mid = len(stages) // 2
    return [(inner.shorten // outer.shorten, outer.shorten, cfg.dim // outer.width_ratio, cfg.dim // inner.width_ratio)
            for outer, inner in zip(stages[:mid], stages[1:mid + 1])]


class HourglassCache(AttentionCache):
    """``caches[d]``: the attention cache of the blocks at depth d (layers numbered in block
    order within the depth; None where a depth has no blocks). ``max_rows`` rows of state."""

    def __init__(self, cfg, caches: list[AttentionCache | None], max_rows: int, dtype: torch.dtype,
                 device: torch.device | str):
        super().__init__(cfg.n_layers)
        depths = block_depths(cfg)
        self.caches = caches
        local = [sum(d == depths[j] for j in range(i)) for i, d in enumerate(depths)]
        self._layers = [caches[d].layer(i) for d, i in zip(depths, local)]
        self.factors = level_factors(cfg)
        self.groups = [torch.zeros(max_rows, k, d_out, dtype=dtype, device=device) for k, _, d_out, _ in self.factors]
        self.inner = [torch.zeros(max_rows, d_in, dtype=dtype, device=device) for *_, d_in in self.factors]
        self.device = torch.device(device)
        self._prefill_row: int | None = None
        # Per level, for the decode step: the rows entering it (engine rows, ascending), each
        # one's group slot, the rows among them that close a group (engine rows: as an index,
        # and on the host for the owner), and those rows' positions at the level's inner rate.
        # Row sets that are 0..n-1 are slices: the common case (level 0, and a batch whose rows
        # share a phase) then indexes nothing.
        self._enter: list[torch.Tensor | slice] = []
        self._slot: list[torch.Tensor] = []
        self._due_rows: list[torch.Tensor | slice] = []
        self._due_np: list[np.ndarray] = []
        self._pos: list[torch.Tensor] = []
        # Each level's inner positions live in one buffer per level (``_pos`` are views of it),
        # so a decode step bound once (``hourglass_decode.py``) reads this step's positions.
        self.pos_buf = [torch.zeros(max_rows, dtype=torch.long, device=device) for _ in self.factors]
        # Per level, when every entering row shares one phase: (slot, closes a group), or None
        # where no row enters; ``phase`` is None when some level mixes phases.
        self.phase: tuple[tuple[int, bool] | None, ...] | None = None

    def layer(self, index: int) -> LayerCache:
        return self._layers[index]

    # -- set by the owner -------------------------------------------------------------------

    def set_prefill(self, row: int) -> None:
        """The next forward is the prompt of the sequence in engine row ``row``."""
        self._prefill_row = row

    def set_decode(self, positions: np.ndarray) -> None:
        """The next forward is one token for each of rows 0..B-1 at ``positions`` (B,)."""
        self._prefill_row = None
        t = np.asarray(positions, dtype=np.int64)
        rows = np.arange(len(t))
        self._enter, self._slot, self._due_rows, self._due_np, self._pos = [], [], [], [], []
        phase: list[tuple[int, bool] | None] | None = []
        for level, (k, rate, _, _) in enumerate(self.factors):
            p = t[rows] // rate  # the entering rows' positions at the level's outer rate
            due = np.flatnonzero(p % k == 0)
            slot = (p + k - 1) % k
            self._enter.append(self._index(rows))
            self._slot.append(self._tensor(slot))
            if phase is not None:
                if not len(rows):  # no row reaches this level
                    phase.append(None)
                elif len(rows) == len(t) and (slot == slot[0]).all():  # all rows, one slot: all close or none
                    phase.append((int(slot[0]), len(due) > 0))
                else:
                    phase = None
            rows = rows[due]
            self._due_rows.append(self._index(rows))
            self._due_np.append(rows)
            pos = self.pos_buf[level][:len(rows)]
            pos.copy_(self._tensor(p[due] // k))
            self._pos.append(pos[:, None])  # (B', 1): one token per row
        self.phase = tuple(phase) if phase is not None else None

    def _tensor(self, a: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(np.ascontiguousarray(a)).to(self.device)

    def _index(self, a: np.ndarray) -> torch.Tensor | slice:
        """Indices ``a`` (ascending) as a slice when they are 0..n-1."""
        return slice(0, len(a)) if not len(a) or a[-1] == len(a) - 1 else self._tensor(a)

    def due_rows(self, level: int) -> np.ndarray:
        """Engine rows whose token closes a group of ``level`` this decode step (the rows the
        owner lays out the next depth's cache metadata for, in this order)."""
        return self._due_np[level]

    # -- called by the trunk ----------------------------------------------------------------

    def shorten(self, level: int, x: torch.Tensor, module: nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
        """The level's shortened stream and its positions at the inner rate: a prompt x
        (1, T, d_outer) -> ((1, ceil(T/k), d_inner), (ceil(T/k),)); a decode step x (B_l, 1,
        d_outer) for the entering rows -> ((B', 1, d_inner), (B', 1)) for the rows that close
        a group."""
        k = self.factors[level][0]
        groups = self.groups[level]
        if self._prefill_row is not None:
            T = x.shape[1]
            n = -(-T // k)
            tail = x[0, (n - 1) * k + 1:]  # the next group's rows so far; slots 0.. (class docstring)
            groups[self._prefill_row].zero_()  # group 0's shift rows are zeros
            groups[self._prefill_row, :tail.shape[0]] = tail
            return module(x), torch.arange(n, device=x.device)
        enter = self._enter[level]
        if isinstance(enter, slice):
            groups[enter][torch.arange(x.shape[0], device=x.device), self._slot[level]] = x[:, 0]
        else:
            groups[enter, self._slot[level]] = x[:, 0]
        return module.pool_groups(groups[self._due_rows[level]][:, None]), self._pos[level]

    def upsample(self, level: int, y: torch.Tensor, residual: torch.Tensor, module: nn.Module) -> torch.Tensor:
        """The level's upsampling: y the inner blocks' output (from ``shorten``'s rows),
        residual the stream from before the shortening, (1, T, d_outer) or (B_l, 1, d_outer)."""
        inner = self.inner[level]
        if self._prefill_row is not None:
            inner[self._prefill_row] = y[0, -1]
            return module(y, residual)
        if y.shape[0]:
            inner[self._due_rows[level]] = y[:, 0]
        return module(inner[self._enter[level]][:, None], residual)

    # -- rows -------------------------------------------------------------------------------

    def move_row(self, src: int, dst: int) -> None:
        """Row ``src``'s sequence now sits in row ``dst`` (the engine keeps rows dense)."""
        for t in (*self.groups, *self.inner):
            t[dst] = t[src]

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in (*self.groups, *self.inner))
