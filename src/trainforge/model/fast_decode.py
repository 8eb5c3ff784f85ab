"""The allocation-free decode step: the model's forward for one token per row, run as a
list of ``out=`` / in-place calls into a workspace allocated once.

Each module writes its own fast path beside its ``forward`` (``decode_calls`` on
``RMSNorm``, ``Attention``, ``FeedForward``, ``TransformerBlock`` in ``llama.py``, the fused
kinds in ``fused.py``, the paged attention in ``attention_cache.py``), from the same
parameters, with a parity test against the forward (tests/test_fast_decode.py). This file
holds ``FastDecoder``, which binds every module's calls once per decode shape (B rows, S
context slots) and runs them: a step then dispatches only compute ops, ~40 per layer, and allocates nothing in float32 (``count_allocations`` in
the engine tests). A MoE block's feed-forward contributes its own forward as one call
(data-dependent routing: it allocates; ``MoE.decode_calls``). A model whose modules lack
``decode_calls`` decodes through its plain forward instead (``FastDecoder.supports``).
Kernels handed in from outside may ``compile`` the bound calls (the CPU kernels make each run
of operator calls one C++ call); a binding that never reads the context length serves every
length, so a step is bound once per row count, not once per block of tokens (the plans are
kept in ``decode_plans.PlanCache``). The buffers, ``LinearInto`` and the in-place rotary sit
below the modules (``decode_workspace.py``), since every module's ``decode_calls`` binds
into them.
"""

from __future__ import annotations

import functools
from typing import Callable

import torch
from torch import nn

from trainforge.model.attention_cache import PagedCache
from trainforge.model.decode_plans import PlanCache
from trainforge.model.decode_workspace import DecodeWorkspace, LinearInto, rope_tables_folded
from trainforge.model.llama import Transformer

__all__ = ["FastDecoder", "FastMTPStep", "blocks_have_decode_calls", "embedding_call"]


def blocks_have_decode_calls(model: nn.Module) -> bool:
    """Whether every module of every block, and the final norm, has ``decode_calls``."""
    return all(hasattr(m, "decode_calls") for b in model.layers.values() for m in (
        b, b.attention_norm, b.attention, b.ffn_norm, b.feed_forward)) and hasattr(model.norm, "decode_calls")


def embedding_call(embedding: nn.Module, tokens: torch.Tensor, out: torch.Tensor) -> Callable[[], None]:
    """The step's embedding lookup of ``tokens`` (B,) into ``out`` (B, dim): the module's own
    ``bind_gather`` when it has one (a quantised table dequantises only the rows; the model layer
    knows it only by that method), else a row gather of the float table."""
    bind = getattr(embedding, "bind_gather", None)
    if bind is not None:
        return bind(tokens, out)
    return functools.partial(torch.ops.aten.index_select.out, embedding.weight, 0, tokens, out=out)


class FastDecoder:
    """Runs ``model``'s decode step over a ``PagedCache`` for rows 0..B-1, reading each row's
    token from ``tokens`` and position from ``positions`` (buffers the owner fills). Does not
    modify the model."""

    MAX_PLANS = 64  # decode shapes whose bound calls are kept
    one_token_rows = True  # a row holds nothing but its pool slots (``decoders.py``)

    def __init__(self, model: Transformer, cache: PagedCache, tokens: torch.Tensor, positions: torch.Tensor,
                 kernels=None, last_logits_only: bool = False, rope: tuple[torch.Tensor, torch.Tensor] | None = None):
        """``kernels``: see ``DecodeWorkspace``. ``last_logits_only``: a step projects only its
        last row and returns logits (1, V) (a prompt run as rows, ``ModelRunner.prefill``).
        ``rope``: another decoder's folded tables (``rope_cos``, ``rope_sin``), shared instead
        of folding a copy."""
        self.model, self.cache = model, cache
        self.tokens, self.positions = tokens, positions
        self.last_logits_only = last_logits_only
        self.ws = DecodeWorkspace(model, cache.max_rows, cache.context_slots, kernels=kernels,
                                  logit_rows=1 if last_logits_only else None)
        self._own_rope = rope is None
        # A row's position is below the cache's context slots: the tables stop there (the model's
        # run to max_seq_len; the folded sine is a copy).
        n = min(cache.context_slots, model.rope_cos.shape[0])
        self.rope_cos, self.rope_sin = rope if rope is not None else \
            rope_tables_folded(model.rope_cos[:n], model.rope_sin[:n], self.ws.dtype)
        self._plans = PlanCache(self.MAX_PLANS, getattr(kernels, "compile", None))
        # The cache's context tensor, written each step (through numpy on CPU: a tensor write costs ~2 us).
        self._context = cache.context.numpy() if cache.context.device.type == "cpu" else cache.context
        self.plan(1, 1)  # binds every linear now (``linears`` lists them)

    @staticmethod
    def supports(model: nn.Module) -> bool:
        """Whether every module on the decode path has ``decode_calls`` and the blocks run one
        after another (a model with a trunk between them, ``hourglass_decode.py``, has its own
        decoder: ``decoders.make_decoder`` chooses)."""
        if getattr(model, "hourglass", None) is not None:
            return False
        return blocks_have_decode_calls(model)

    def rows_step(self, rows: int, context_slots: int, positions: torch.Tensor,
                  last_logits_only: bool = False) -> FastDecoder:
        """A step of its own over ``rows`` one-token rows of this model (a speculative
        verification's B x T tokens, a short prompt's T tokens): its own cache metadata and
        tokens over the same pool, the workspace sized for it, the rotary tables shared.
        ``positions`` (rows,): the buffer its rows read their positions from."""
        cache = PagedCache(self.cache.k, self.cache.v, rows, context_slots)
        tokens = torch.zeros(rows, dtype=torch.long, device=self.tokens.device)
        return FastDecoder(self.model, cache, tokens, positions, self.ws.kernels, last_logits_only=last_logits_only,
                           rope=(self.rope_cos, self.rope_sin))

    @property
    def linears(self) -> dict[int, LinearInto]:
        """The linears a step runs (id(module) -> LinearInto)."""
        return self.ws.linears

    @property
    def nbytes(self) -> int:
        return self.ws.nbytes + (self.rope_cos.nbytes + self.rope_sin.nbytes if self._own_rope else 0)

    def plan(self, rows: int, context: int) -> list[Callable[[], None]]:
        """The bound calls of a step of ``rows`` rows over ``context`` slots, kept per shape: under
        (rows, None) when no call read the context (they then serve every S: rebinding and
        compiling every block of tokens cost ~5 ms, ~0.3 ms a step), else (rows, context). With
        kernels that can ``compile`` (the C++ call program), the calls are compiled once here."""
        return self._plans.get((rows,), (context,), lambda: (self._bind(rows, context), self.ws.context_read))

    def _bind(self, B: int, S: int) -> list[Callable[[], None]]:
        ws, model, p = self.ws, self.model, functools.partial
        ws.begin(B, S)
        x = ws.residual()
        h, _ = ws.hidden(B)
        pos = self.positions[:B]
        calls = [embedding_call(model.tok_embeddings, self.tokens[:B], x),
                 p(torch.ops.aten.index_select.out, self.rope_cos, 0, pos, out=ws._cos[:B]),
                 p(torch.ops.aten.index_select.out, self.rope_sin, 0, pos, out=ws._sin[:B])]
        for name, block in model.layers.items():
            calls += block.decode_calls(ws, x, self.cache.layer(int(name)))
        calls += model.norm.decode_calls(ws, x, h)
        last = B - 1 if self.last_logits_only else 0
        calls.append(ws.linear(model.output).bind(h[last:], ws.logits[:B - last]))
        return calls

    def step(self, rows: int, context: int) -> torch.Tensor:
        """One decode step; returns logits (B, V), or (1, V) with ``last_logits_only``, a view
        of the workspace."""
        calls = self.plan(rows, context)
        self._context[0] = context  # read by calls bound for every S
        for call in calls:
            call()
        return self.ws.logits[:1 if self.last_logits_only else rows]

    def hidden(self, rows: int) -> torch.Tensor:
        """The last step's final residual stream (B, dim): the last block's output before the
        final norm (``forward(..., return_hidden=True)``'s h), a view of the workspace."""
        return self.ws._x[:rows]


class FastMTPStep:
    """``Transformer.mtp_step(depth, ...)`` for one token per row as an allocation-free
    step (``MTPModule.decode_calls``), over ``cache`` (a ``PagedCache`` whose layer
    ``layer`` holds the depth's keys/values). The owner fills ``tokens``, ``positions`` and
    the cache's metadata, and ``x[:B]`` with the previous depth's hidden states before the
    first step; each step leaves this depth's hidden states in ``x``, so repeated steps
    chain the module on its own output (a speculative drafter's recurrence)."""

    def __init__(self, model: Transformer, depth: int, cache: PagedCache, layer: int = 0):
        self.model, self.module, self.cache, self.layer = model, model.mtp[str(depth - 1)], cache, layer
        self.ws = ws = DecodeWorkspace(model, cache.max_rows, cache.context_slots)
        R, d = cache.max_rows, model.cfg.dim
        f = dict(dtype=ws.dtype, device=ws.device)
        self.tokens = torch.zeros(R, dtype=torch.long, device=ws.device)
        self.positions = torch.zeros(R, dtype=torch.long, device=ws.device)
        self.x, self._emb, self._pair = ws._x, torch.empty(R, d, **f), torch.empty(R, 2 * d, **f)
        self.rope_cos, self.rope_sin = rope_tables_folded(model.rope_cos, model.rope_sin, ws.dtype)
        self._plans = PlanCache(FastDecoder.MAX_PLANS)

    @staticmethod
    def supports(model: nn.Module, depth: int = 1) -> bool:
        m = model.mtp[str(depth - 1)]
        b = m.block
        return all(hasattr(n, "decode_calls") for n in (m.enorm, m.hnorm, m.norm, b, b.attention_norm, b.attention,
                                                         b.ffn_norm, b.feed_forward))

    @property
    def nbytes(self) -> int:
        return self.ws.nbytes + sum(t.nbytes for t in (self.tokens, self.positions, self._emb, self._pair,
                                                        self.rope_cos, self.rope_sin))

    def _bind(self, B: int, S: int) -> list[Callable[[], None]]:
        ws, model, p = self.ws, self.model, functools.partial
        ws.begin(B, S)
        h, _ = ws.hidden(B)
        pos = self.positions[:B]
        calls = [embedding_call(model.tok_embeddings, self.tokens[:B], self._emb[:B]),
                 p(torch.index_select, self.rope_cos, 0, pos, out=ws._cos[:B]),
                 p(torch.index_select, self.rope_sin, 0, pos, out=ws._sin[:B])]
        calls += self.module.decode_calls(ws, self.x[:B], self._emb[:B], self._pair[:B], self.cache.layer(self.layer))
        calls += self.module.norm.decode_calls(ws, self.x[:B], h)
        calls.append(ws.linear(model.output).bind(h, ws.logits[:B]))
        return calls

    def step(self, rows: int, context: int) -> torch.Tensor:
        """One step; returns logits (B, V), a view of the workspace."""
        # Kept per context length even where no binding reads it, as before: this step's owner
        # writes no ``context`` tensor.
        for call in self._plans.get((rows, context), (), lambda: (self._bind(rows, context), False)):
            call()
        return self.ws.logits[:rows]
