"""The allocation-light decode step of an hourglass model: ``fast_decode.FastDecoder``'s
bound calls for each run of blocks, the trunk's shortenings and upsamplings between them.

``HourglassTrunk.forward`` with an ``HourglassCache`` is the definition; this runs the same
modules in the same order for one token per row. The step walks the trunk's *segments*
(``segments``): a run of consecutive blocks at one depth, a level's shortening, or its
upsampling. Each depth has its own ``DecodeWorkspace``, sized for its stage's width and head
dim, and its own rotary tables (the trunk's at the shortened rate). At depth d >= 1 the rows
are those whose token closes a group this step (the cache chooses them; none: the depth's
blocks are skipped), the context that depth's paged cache's.

The walk (``_bind``) is written once and bound once per step shape, then replayed
(``decode_plans.PlanCache``; compiled into C++ call programs where the kernels can). A step
is one of two shapes, told apart by ``HourglassCache.phase``:

- uniform: every row entering a level shares its phase (batch 1 always). The rows at a depth
  are all B or none, each level's group slot is one index, and the shortenings and
  upsamplings are their modules' ``decode_calls`` into the depths' streams: compiled, the
  whole step is one C++ call.
- mixed: rows at different phases. The shortenings and upsamplings go through
  ``HourglassCache.shorten`` / ``upsample`` (the trunk's modules, a few small allocating ops
  per level), which write each row's group slot and pool the rows that close a group; the
  blocks at a depth run on those rows only.

Parity with the plain forward, both shapes, float and block-quantised weights:
tests/infer/test_hourglass_decode.py.
"""

from __future__ import annotations

import functools
from typing import Callable

import torch
from torch import nn

from trainforge.model.decode_plans import PlanCache
from trainforge.model.decode_workspace import DecodeWorkspace, rope_tables_folded
from trainforge.model.fast_decode import blocks_have_decode_calls, embedding_call
from trainforge.model.hourglass_cache import HourglassCache, block_depths
from trainforge.model.hourglass_spec import shortening_spans
from trainforge.model.llama import Transformer

Calls = list[Callable[[], None]]


def segments(cfg) -> list[tuple[str, int, list[int]]]:
    """The trunk's order as ("blocks", depth, [block indices]), ("shorten", level, []) and
    ("upsample", level, []), outside in and back out (``HourglassTrunk.forward``'s walk)."""
    spans, depths = shortening_spans(cfg.hourglass_stages), block_depths(cfg)
    out: list[tuple[str, int, list[int]]] = []
    for j in range(cfg.n_layers):
        out += [("shorten", level, []) for level, (first, _) in enumerate(spans) if first == j]
        if out and out[-1][0] == "blocks" and out[-1][1] == depths[j]:
            out[-1][2].append(j)
        else:
            out.append(("blocks", depths[j], [j]))
        out += [("upsample", level, []) for level in reversed(range(len(spans))) if spans[level][1] - 1 == j]
    return out


class HourglassDecoder:
    """``FastDecoder``'s interface (``step``, ``nbytes``) for an hourglass ``model`` over
    ``cache`` (its depth caches are ``PagedCache``s the owner sets up each step)."""

    MAX_PLANS = 256  # step shapes whose bound calls are kept
    one_token_rows = False  # a row carries the trunk's open groups (``decoders.py``)

    def __init__(self, model: Transformer, cache: HourglassCache, tokens: torch.Tensor, positions: torch.Tensor,
                 kernels=None):
        """``kernels``: fused decode ops handed in from outside, as ``FastDecoder``'s (each
        depth's workspace binds them; with ``compile`` each run of operator calls of a step
        becomes one C++ call)."""
        cfg = model.cfg
        self.model, self.cache, self.tokens, self.positions = model, cache, tokens, positions
        self.trunk = model.hourglass
        depths = block_depths(cfg)
        full = cache.caches[0]
        self.ws: dict[int, DecodeWorkspace] = {}
        self.tables: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        for d in sorted(set(depths) | {0}):  # depth 0 embeds and projects even with no full-rate block
            c = cache.caches[d]
            self.ws[d] = DecodeWorkspace(model, full.max_rows, c.context_slots,
                                         cfg.stage_config(depths.index(d)) if d else cfg, kernels=kernels)
            cos, sin = (model.rope_cos, model.rope_sin) if d == 0 else (
                getattr(self.trunk, f"rope_cos_{d - 1}"), getattr(self.trunk, f"rope_sin_{d - 1}"))
            self.tables[d] = rope_tables_folded(cos, sin, self.ws[d].dtype)
        # A shortening level with no blocks of its own (an empty intermediate stage) passes
        # the stream through: its depth still needs a stream buffer of its width.
        self._x = {level + 1: torch.empty(full.max_rows, d_in, dtype=self.ws[0].dtype, device=self.ws[0].device)
                   for level, (*_, d_in) in enumerate(cache.factors) if level + 1 not in self.ws}
        self.segments = segments(cfg)
        self._plans = PlanCache(self.MAX_PLANS, getattr(kernels, "compile", None))
        # Per level: the mean before a pooling's projection, and an upsampling's projection.
        self._pool_scratch = [torch.empty(full.max_rows, d_out, dtype=self.ws[0].dtype, device=self.ws[0].device)
                              for _, _, d_out, _ in cache.factors]
        self._up_scratch = [torch.empty_like(t) for t in self._pool_scratch]
        # Each depth's context length S, as the C++ attention reads it (FastDecoder's ``_context``).
        self._context = {d: c.context.numpy() if c.context.device.type == "cpu" else c.context
                         for d, c in enumerate(cache.caches) if c is not None}

    @staticmethod
    def supports(model: nn.Module) -> bool:
        """Whether ``model`` has an hourglass trunk and every module of its blocks and its final
        norm has ``decode_calls``."""
        return getattr(model, "hourglass", None) is not None and blocks_have_decode_calls(model)

    def rows_step(self, rows: int, context_slots: int, positions: torch.Tensor, last_logits_only: bool = False):
        """Refused (``one_token_rows``: a row carries the trunk's open groups)."""
        raise NotImplementedError("an hourglass model's tokens run in sequence: each row carries its open groups")

    @property
    def nbytes(self) -> int:
        return (sum(ws.nbytes for ws in self.ws.values()) + sum(t.nbytes for t in self._x.values())
                + sum(c.nbytes + s.nbytes for c, s in self.tables.values()))

    def stream(self, depth: int, rows: int) -> torch.Tensor:
        """The residual stream (rows, width) of ``depth``'s workspace."""
        return self.ws[depth]._x[:rows] if depth in self.ws else self._x[depth][:rows]

    @torch.no_grad()
    def step(self, rows: int, context: int) -> torch.Tensor:
        """One decode step for rows 0..B-1 (the cache's ``set_decode`` done by its owner);
        returns logits (B, V), a view of the workspace."""
        cache, phase = self.cache, self.cache.phase
        n, ctx = {0: rows}, {0: context}  # rows and context slots at each depth this step
        for level in range(len(cache.factors)):
            if phase is not None:
                n[level + 1] = rows if phase[level] is not None and phase[level][1] else 0
            else:
                n[level + 1] = len(cache.due_rows(level))
            inner = cache.caches[level + 1]
            if n[level + 1] and inner is not None:
                ctx[level + 1] = inner.decode_shape[1]
        for d, c in ctx.items():
            self._context[d][0] = c  # read by the C++ attention of plans bound for every length
        key = ("uniform", rows, phase) if phase is not None else ("mixed", rows, tuple(n.values()))
        for call in self._plans.get(key, (tuple(ctx.items()),), lambda: self._bind(n, ctx, phase)):
            call()
        return self.ws[0].logits[:rows]

    def _bind(self, n: dict[int, int], ctx: dict[int, int], phase: tuple | None) -> tuple[Calls, bool]:
        """The step's calls for ``n[d]`` rows at depth d over ``ctx[d]`` slots, and whether a
        binding read a context length (``PlanCache.get``): the embedding, then the trunk's
        segments in order, then the final norm and the output projection."""
        B = n[0]
        calls = [embedding_call(self.model.tok_embeddings, self.tokens[:B], self.stream(0, B)),
                 *self._rope_calls(0, B, self.positions[:B])]
        read = False
        for kind, k, blocks in self.segments:
            if not n[k]:  # no row reaches this depth this step
                continue
            if kind == "blocks":
                ws = self.ws[k]
                ws.begin(n[k], ctx.get(k, 0))
                x = ws.residual()
                for j in blocks:
                    calls += self.model.layers[str(j)].decode_calls(ws, x, self.cache.layer(j))
                read |= ws.context_read
            elif kind == "shorten":
                calls += self._shorten_calls(k, n[k], n[k + 1], phase)
            else:
                calls += self._upsample_calls(k, n[k], n[k + 1], phase)
        return calls + self._head_calls(B), read

    def _shorten_calls(self, level: int, rows: int, inner_rows: int, phase: tuple | None) -> Calls:
        """Level ``level``'s shortening for the ``rows`` rows entering it; ``inner_rows`` of
        them close a group and go on inside, with their rotary rows at the inner depth."""
        cache, module = self.cache, self.trunk.shorten[str(level)]
        if phase is not None:  # one slot for every row: a copy, then the pool as bound calls
            slot, due = phase[level]
            group = cache.groups[level][:rows]
            calls: Calls = [functools.partial(torch.ops.aten.copy_.default, group[:, slot], self.stream(level, rows))]
            if due:
                calls += module.decode_calls(self.ws[0], group, self.stream(level + 1, rows),
                                             self._pool_scratch[level][:rows])
        else:
            calls = [functools.partial(self._shorten_rows, level, rows, inner_rows)]
        if inner_rows:
            calls += self._rope_calls(level + 1, inner_rows, cache.pos_buf[level][:inner_rows])
        return calls

    def _shorten_rows(self, level: int, rows: int, inner_rows: int) -> None:
        """The mixed step's shortening: the cache writes each row's group slot and pools the
        rows that close a group (``HourglassCache.shorten``), which enter the inner stream."""
        h, _ = self.cache.shorten(level, self.stream(level, rows)[:, None], self.trunk.shorten[str(level)])
        if inner_rows:
            self.stream(level + 1, inner_rows).copy_(h[:, 0])

    def _upsample_calls(self, level: int, rows: int, inner_rows: int, phase: tuple | None) -> Calls:
        """Level ``level``'s upsampling for its ``rows`` entering rows: each adds the inner
        output of its latest closed group, this step's for the ``inner_rows`` that closed one."""
        if phase is None:
            return [functools.partial(self._upsample_rows, level, rows, inner_rows)]
        inner = self.cache.inner[level][:rows]
        calls: Calls = [functools.partial(torch.ops.aten.copy_.default, inner, self.stream(level + 1, rows))] \
            if inner_rows else []
        return calls + self.trunk.upsample[str(level)].decode_calls(self.ws[0], inner, self.stream(level, rows),
                                                                     self._up_scratch[level][:rows])

    def _upsample_rows(self, level: int, rows: int, inner_rows: int) -> None:
        """The mixed step's upsampling (``HourglassCache.upsample``)."""
        x = self.stream(level, rows)
        out = self.cache.upsample(level, self.stream(level + 1, inner_rows)[:, None], x[:, None],
                                  self.trunk.upsample[str(level)])
        x.copy_(out[:, 0])

    def _head_calls(self, B: int) -> Calls:
        """The final norm and the output projection of rows 0..B-1, at depth 0."""
        ws = self.ws[0]
        ws.begin(B, 0)
        x, (h, _) = ws._x[:B], ws.hidden(B)
        return [*self.model.norm.decode_calls(ws, x, h), ws.linear(self.model.output).bind(h, ws.logits[:B])]

    def _rope_calls(self, depth: int, B: int, positions: torch.Tensor) -> Calls:
        """Each row's rotary rows at ``depth`` for ``positions`` (B,), as bound calls."""
        if depth not in self.ws:
            return []
        ws, (cos, sin) = self.ws[depth], self.tables[depth]
        return [functools.partial(torch.ops.aten.index_select.out, cos, 0, positions, out=ws._cos[:B]),
                functools.partial(torch.ops.aten.index_select.out, sin, 0, positions, out=ws._sin[:B])]
