"""The allocation-light decode step of an hourglass model: ``fast_decode.FastDecoder``'s
bound calls for each run of blocks, the trunk's shortenings and upsamplings between them.

``HourglassTrunk.forward`` with an ``HourglassCache`` is the definition; this runs the same
modules in the same order for one token per row. The step is a list of *segments*: a run of
consecutive blocks at one depth, a level's shortening, or its upsampling (``segments``).
Each depth has its own ``DecodeWorkspace``, sized for its stage's width and head dim, and
its own rotary tables (the trunk's at the shortened rate). A run of blocks binds its
modules' ``decode_calls`` once per (rows, context) and replays them, as ``FastDecoder`` does
for a dense model; at depth d >= 1 the rows are those whose token closes a group this step
(the cache chooses them; none: the run is skipped), the context that depth's paged cache's.
The shortenings and upsamplings go through ``HourglassCache.shorten`` / ``upsample`` (the
trunk's modules, a few small allocating ops per level), moving the stream between the
depths' workspaces. Parity with the plain forward: tests/infer/test_hourglass_decode.py.
"""

from __future__ import annotations

import functools
from typing import Callable

import torch
from torch import nn

from trainforge.model.fast_decode import DecodeWorkspace, _gather
from trainforge.model.hourglass_cache import HourglassCache, block_depths
from trainforge.model.hourglass_spec import shortening_spans
from trainforge.model.llama import Transformer, rope_tables_folded


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

    MAX_PLANS = 256  # (segment, rows, context) bindings kept

    def __init__(self, model: Transformer, cache: HourglassCache, tokens: torch.Tensor, positions: torch.Tensor,
                 kernels=None):
        """``kernels``: fused decode ops handed in from outside, as ``FastDecoder``'s (each
        depth's workspace binds them; with ``compile`` each segment's calls become one C++ call)."""
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
        self._plans: dict[tuple, list[Callable[[], None]]] = {}
        # Per level: the mean before a pooling's projection, and an upsampling's projection.
        self._pool_scratch = [torch.empty(full.max_rows, d_out, dtype=self.ws[0].dtype, device=self.ws[0].device)
                              for _, _, d_out, _ in cache.factors]
        self._up_scratch = [torch.empty_like(t) for t in self._pool_scratch]
        # Each depth's context length S, as the C++ attention reads it (FastDecoder's ``_context``).
        self._context = {d: c.context.numpy() if c.context.device.type == "cpu" else c.context
                         for d, c in enumerate(cache.caches) if c is not None}

    @staticmethod
    def supports(model: nn.Module) -> bool:
        """Whether every module of the blocks and the final norm has ``decode_calls``."""
        return all(hasattr(m, "decode_calls") for b in model.layers.values() for m in (
            b, b.attention_norm, b.attention, b.ffn_norm, b.feed_forward)) and hasattr(model.norm, "decode_calls")

    @property
    def nbytes(self) -> int:
        return (sum(ws.nbytes for ws in self.ws.values()) + sum(t.nbytes for t in self._x.values())
                + sum(c.nbytes + s.nbytes for c, s in self.tables.values()))

    def stream(self, depth: int, rows: int) -> torch.Tensor:
        """The residual stream (rows, width) of ``depth``'s workspace."""
        return self.ws[depth]._x[:rows] if depth in self.ws else self._x[depth][:rows]

    def _plan(self, index: int, rows: int, context: int) -> list[Callable[[], None]]:
        """Segment ``index``'s calls for ``rows`` rows over ``context`` slots (``_cached``)."""
        depth = 0 if index == len(self.segments) else self.segments[index][1]
        return self._cached((index, rows), (context,), lambda: self._bind(index, rows, context), [self.ws[depth]])

    def _cached(self, key: tuple, contexts: tuple, bind: Callable[[], tuple[list, bool]],
                workspaces: list[DecodeWorkspace]) -> list[Callable[[], None]]:
        """As ``FastDecoder.plan``: ``bind()``'s calls, compiled when the kernels can, kept under
        ``key`` when no binding read a context (the C++ attention reads S at run time), else
        under ``key + contexts``. ``bind`` returns (calls, whether a binding read a context): a
        workspace's own flag is reset by each ``begin``, so a later binding on the same
        workspace (the head's) would hide an earlier read, and the torch attention's plan,
        bound for one S, would be replayed at another."""
        calls = self._plans.get(key) or self._plans.get(key + contexts)
        if calls is None:
            if len(self._plans) >= self.MAX_PLANS:
                self._plans.pop(next(iter(self._plans)))
            calls, read = bind()
            compile_calls = getattr(workspaces[0].kernels, "compile", None)
            if compile_calls is not None:
                calls = compile_calls(calls)
            self._plans[key + contexts if read else key] = calls
        return calls

    def _bind(self, index: int, B: int, S: int) -> tuple[list[Callable[[], None]], bool]:
        if index == len(self.segments):  # the final norm and the output projection
            return self._head_calls(B), False
        _, depth, blocks = self.segments[index]
        ws = self.ws[depth]
        ws.begin(B, S)
        x = ws.residual()
        calls: list[Callable[[], None]] = []
        for j in blocks:
            calls += self.model.layers[str(j)].decode_calls(ws, x, self.cache.layer(j))
        return calls, ws.context_read

    def _enter(self, depth: int, rows: int, positions: torch.Tensor) -> None:
        """Each row's rotary rows at ``depth`` for its position there (B,)."""
        for call in self._rope_calls(depth, rows, positions):
            call()

    def _bind_uniform(self, B: int, phase: tuple, contexts: dict[int, int]) -> tuple[list[Callable[[], None]], bool]:
        """The whole step as one list of bound calls when every row entering each level shares
        its phase (``HourglassCache.phase``; batch 1 always): the rows at a depth are then all
        B or none, each level's group slot is one index, and the shortenings and upsamplings
        are their modules' ``decode_calls`` into the depths' streams. Compiled, the step is one
        C++ call. The same modules and order as ``step``'s general path."""
        cache, model, p = self.cache, self.model, functools.partial
        ws0 = self.ws[0]
        calls = [_gather(model.tok_embeddings, self.tokens[:B], self.stream(0, B)), *self._rope_calls(0, B,
                                                                                                      self.positions[:B])]
        entered, read = {0}, False
        for kind, k, blocks in self.segments:
            if kind == "blocks":
                if k in entered:
                    ws = self.ws[k]
                    ws.begin(B, contexts.get(k, 0))
                    x = ws.residual()
                    for j in blocks:
                        calls += model.layers[str(j)].decode_calls(ws, x, cache.layer(j))
                    read |= ws.context_read
            elif kind == "shorten" and k in entered:
                slot, due = phase[k]
                group = cache.groups[k][:B]
                calls.append(p(torch.ops.aten.copy_.default, group[:, slot], self.stream(k, B)))
                if due:
                    entered.add(k + 1)
                    calls += self.trunk.shorten[str(k)].decode_calls(ws0, group, self.stream(k + 1, B),
                                                                     self._pool_scratch[k][:B])
                    calls += self._rope_calls(k + 1, B, cache.pos_buf[k][:B])
            elif kind == "upsample" and k in entered:
                inner = cache.inner[k][:B]
                if k + 1 in entered:
                    calls.append(p(torch.ops.aten.copy_.default, inner, self.stream(k + 1, B)))
                calls += self.trunk.upsample[str(k)].decode_calls(ws0, inner, self.stream(k, B), self._up_scratch[k][:B])
        return calls + self._head_calls(B), read

    def _head_calls(self, B: int) -> list[Callable[[], None]]:
        """The final norm and the output projection of rows 0..B-1, at depth 0."""
        ws = self.ws[0]
        ws.begin(B, 0)
        x, (h, _) = ws._x[:B], ws.hidden(B)
        return [*self.model.norm.decode_calls(ws, x, h), ws.linear(self.model.output).bind(h, ws.logits[:B])]

    def _rope_calls(self, depth: int, B: int, positions: torch.Tensor) -> list[Callable[[], None]]:
        """``_enter`` as bound calls: each row's rotary rows at ``depth`` for ``positions`` (B,)."""
        if depth not in self.ws:
            return []
        ws, (cos, sin) = self.ws[depth], self.tables[depth]
        return [functools.partial(torch.ops.aten.index_select.out, cos, 0, positions, out=ws._cos[:B]),
                functools.partial(torch.ops.aten.index_select.out, sin, 0, positions, out=ws._sin[:B])]

    def _uniform_plan(self, B: int, phase: tuple, contexts: dict[int, int]) -> list[Callable[[], None]]:
        """``_bind_uniform``'s calls, per (B, phase) (``_cached``)."""
        return self._cached(("uniform", B, phase), (tuple(sorted(contexts.items())),),
                            lambda: self._bind_uniform(B, phase, contexts), list(self.ws.values()))

    @torch.no_grad()
    def step(self, rows: int, context: int) -> torch.Tensor:
        """One decode step for rows 0..B-1; returns logits (B, V), a view of the workspace."""
        model, cache = self.model, self.cache
        if cache.phase is not None:
            contexts = {0: context}
            for level, ph in enumerate(cache.phase):
                inner = cache.caches[level + 1]
                if ph is not None and ph[1] and inner is not None:
                    contexts[level + 1] = inner.decode_shape[1]
            for d, c in contexts.items():
                self._context[d][0] = c
            for call in self._uniform_plan(rows, cache.phase, contexts):
                call()
            return self.ws[0].logits[:rows]
        n = {0: rows}  # rows at each depth this step
        ctx = {0: context}
        x0 = self.stream(0, rows)
        torch.index_select(model.tok_embeddings.weight, 0, self.tokens[:rows], out=x0)
        self._enter(0, rows, self.positions[:rows])
        for index, (kind, k, _) in enumerate(self.segments):
            if kind == "blocks":
                if n[k]:
                    self._context[k][0] = ctx[k]
                    for call in self._plan(index, n[k], ctx[k]):
                        call()
            elif kind == "shorten":
                h, pos = cache.shorten(k, self.stream(k, n[k])[:, None], self.trunk.shorten[str(k)])
                n[k + 1] = h.shape[0]
                if n[k + 1]:
                    self.stream(k + 1, n[k + 1]).copy_(h[:, 0])
                    self._enter(k + 1, n[k + 1], pos[:, 0])
                    inner = cache.caches[k + 1]
                    ctx[k + 1] = inner.decode_shape[1] if inner is not None else 0
            else:  # upsample
                x = self.stream(k, n[k])
                out = cache.upsample(k, self.stream(k + 1, n[k + 1])[:, None], x[:, None], self.trunk.upsample[str(k)])
                x.copy_(out[:, 0])
        for call in self._plan(len(self.segments), rows, 0):
            call()
        return self.ws[0].logits[:rows]
