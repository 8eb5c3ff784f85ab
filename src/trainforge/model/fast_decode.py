"""The allocation-free decode step: the model's forward for one token per row, run as a
list of ``out=`` / in-place calls into a workspace allocated once.

Each module writes its own fast path beside its ``forward`` (``decode_calls`` on
``RMSNorm``, ``Attention``, ``FeedForward``, ``TransformerBlock`` in ``llama.py``, the fused
kinds in ``fused.py``, the paged attention in ``attention_cache.py``), from the same
parameters, with a parity test against the forward (tests/test_fast_decode.py). This file
holds what they share: ``LinearInto`` (a linear into a preallocated output),
``DecodeWorkspace`` (the buffers) and ``FastDecoder``, which binds every module's calls
once per decode shape (B rows, S context slots) and runs them: a step then dispatches only
compute ops, ~40 per layer, and allocates nothing in float32 (``count_allocations`` in
the engine tests). A MoE block's feed-forward contributes its own forward as one call
(data-dependent routing: it allocates; ``MoE.decode_calls``). A model whose modules lack
``decode_calls`` decodes through its plain forward instead (``FastDecoder.supports``).
Kernels handed in from outside may ``compile`` the bound calls (the CPU kernels make each run
of operator calls one C++ call); a binding that never reads the context length serves every
length, so a step is bound once per row count, not once per block of tokens.

Float linears run through ``LinearInto``: a few-row GEMM is memory-bound and MKL runs it
on one thread (it streamed ~12 GB/s at 1 or 2 threads on this machine), so the weight's
rows are split into ``split`` blocks (views, no copy) and multiplied with one ``bmm``,
whose batch OpenMP spreads over the threads (~22 GB/s on 2). Same dot products, same
results. A module with its own ``out=`` kernel (quantised layers, the C++ GEMV linear that
``infer/`` swaps in) binds it through its ``bind_into(x, out)``.
"""

from __future__ import annotations

import functools
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from trainforge.model.attention_cache import PagedCache
from trainforge.model.decode_plans import PlanCache
from trainforge.model.llama import RopeInto, Transformer, rope_tables_folded


class LinearInto:
    """out = mod(x) for x (M, K) into a preallocated ``out`` (see the module docstring)."""

    MAX_ROWS = 64  # above this the GEMM has work enough for MKL's own threading

    def __init__(self, mod: nn.Module, split: int, scratch: torch.Tensor | None):
        self.mod = mod
        # A module with its own out= kernel (quantised layers, the C++ GEMV swapped in for inference)
        # binds it itself; a plain float linear gets the row-block bmm below.
        self.float = isinstance(mod, nn.Linear) and mod.bias is None and not hasattr(mod, "bind_into")
        if self.float:
            w = mod.weight.detach()
            n, k = w.shape
            self.wt = w.t()
            self.split = split if split > 1 and n % split == 0 and w.device.type == "cpu" else 1
            self.blocks = w.view(self.split, n // self.split, k).transpose(1, 2)  # (split, K, N/split)
            self.scratch = scratch

    def bind(self, x: torch.Tensor, out: torch.Tensor, scratch: torch.Tensor | None = None) -> Callable[[], None]:
        """A no-argument call computing out = mod(x) for these very tensors (views made now)."""
        if not self.float:
            return self.mod.bind_into(x, out) if hasattr(self.mod, "bind_into") else \
                functools.partial(self.mod.forward_into, x, out)
        m, k = x.shape
        if self.split == 1 or m > self.MAX_ROWS:
            return functools.partial(torch.mm, x, self.wt, out=out)
        if m == 1:  # (split, 1, N/split) is out's own layout
            return functools.partial(torch.bmm, x.expand(self.split, 1, k), self.blocks,
                                     out=out.view(self.split, 1, -1))
        n_part = out.shape[1] // self.split
        tmp = (self.scratch if scratch is None else scratch)[:self.split * m * n_part].view(self.split, m, n_part)
        xe, dst, src = x.expand(self.split, m, k), out.view(m, self.split, n_part), tmp.transpose(0, 1)

        def call() -> None:
            torch.bmm(xe, self.blocks, out=tmp)
            dst.copy_(src)
        return call

    def __call__(self, x: torch.Tensor, out: torch.Tensor, scratch: torch.Tensor | None = None) -> None:
        self.bind(x, out, scratch)()


class RowBlockLinear(nn.Linear):
    """``nn.Linear`` (same ``weight``, same name) whose product for at most
    ``LinearInto.MAX_ROWS`` rows on a multi-threaded CPU runs as ``LinearInto``'s row-block
    ``bmm`` (same dot products): a short prompt's prefill gets the decode step's threaded
    matmul. Swapped in from outside for inference (``infer/fusion.py``); allocates its output."""

    @classmethod
    def of(cls, linear: nn.Linear) -> RowBlockLinear:
        new = cls.__new__(cls)
        nn.Module.__init__(new)
        new.in_features, new.out_features = linear.in_features, linear.out_features
        new.weight, new.bias = linear.weight, linear.bias  # shared: a tied output stays tied
        return new

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w, split = self.weight, torch.get_num_threads()
        n, k = w.shape
        m = x.numel() // k
        if split < 2 or m > LinearInto.MAX_ROWS or n % split or self.bias is not None or not x.device.type == "cpu":
            return F.linear(x, w, self.bias)
        blocks = w.view(split, n // split, k).transpose(1, 2)  # (split, K, N/split)
        y = torch.bmm(x.reshape(m, k).expand(split, m, k), blocks)  # (split, M, N/split)
        return y.transpose(0, 1).reshape(*x.shape[:-1], n)


class DecodeWorkspace:
    """Every activation of a decode step for up to ``max_rows`` rows of up to
    ``context_slots`` cached tokens, allocated once; modules take views of the current
    step shape (``rows`` x ``context``, set by ``FastDecoder``)."""

    def __init__(self, model: Transformer, max_rows: int, context_slots: int, cfg=None, kernels=None,
                 logit_rows: int | None = None):
        """``cfg``: the shapes to size for (default the model's; an hourglass stage's config
        for a workspace of its shortened blocks, ``hourglass_decode.py``). ``kernels``: fused
        decode ops handed in from outside (``infer/cpu_kernels/decode_ops.py``: ``rope``,
        ``paged_attention``), which the modules' ``decode_calls`` bind instead of their torch
        ops; None keeps the torch ops. ``logit_rows``: rows of logits kept (default
        ``max_rows``; 1 for a step that projects only its last row, ``FastDecoder``'s
        ``last_logits_only``)."""
        self.kernels = kernels
        cfg = cfg or model.cfg
        # The norm's weight, not the embedding's: a quantised embedding's weight is its int codes.
        emb = model.norm.weight
        self.dtype, self.device = emb.dtype, emb.device
        self.head_dim = D = cfg.head_dim
        H, Hkv, Fh, d = cfg.n_heads, cfg.n_kv_heads, cfg.ffn_hidden_dim, cfg.dim
        R, C = max_rows, context_slots
        self.rows, self._context = R, C
        self.context_read = False  # whether a binding read ``context`` (FastDecoder.plan)
        f = dict(dtype=self.dtype, device=self.device)
        self._x, self._h, self._sq, self._delta = (torch.empty(R, d, **f) for _ in range(4))
        self._ms = torch.empty(R, 1, **f)
        self._qkv = torch.empty(R * (H + 2 * Hkv) * D, **f)
        self._rot = torch.empty(R * (H + Hkv) * D, **f)
        self._cos, self._sin = torch.empty(R, D, **f), torch.empty(R, D, **f)
        self._kg, self._vg = torch.empty(Hkv * R * C * D, **f), torch.empty(Hkv * R * C * D, **f)
        self._qt, self._ao = torch.empty(H * R * D, **f), torch.empty(H * R * D, **f)
        self._scores, self._probs = torch.empty(H * R * C, **f), torch.empty(H * R * C, **f)
        self._at = torch.empty(R, H * D, **f)
        self._gu = torch.empty(R * 2 * Fh, **f)
        self._act = torch.empty(R, Fh, **f)
        self.logits = torch.empty(logit_rows or R, cfg.vocab_size, **f)
        self._scalars: dict[float, torch.Tensor] = {}
        self._derived: dict[tuple, torch.Tensor] = {}
        self.split = torch.get_num_threads() if self.device.type == "cpu" else 1
        # The row-block scratch serves float linears of 2..64 rows: the output's too, unless it
        # projects one row only.
        widest = max(getattr(m, "out_features", 0) for m in model.modules()
                     if not (logit_rows == 1 and m is getattr(model, "output", None)))
        self._split_scratch = torch.empty(min(R, LinearInto.MAX_ROWS) * widest, **f) if self.split > 1 else None
        self.linears: dict[int, LinearInto] = {}  # id(module) -> LinearInto, filled as plans bind them

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in vars(self).values() if isinstance(t, torch.Tensor))

    def begin(self, rows: int, context: int) -> None:
        self.rows, self._context, self.context_read = rows, context, False

    @property
    def context(self) -> int:
        """The step's context slots S. Reading it marks the calls being bound as valid for this
        S only; a step whose calls never read it (the C++ attention reads S from the cache's
        ``context`` tensor) serves every S."""
        self.context_read = True
        return self._context

    # -- views of the current step shape, for the modules' decode_calls --------------------

    def scalar(self, value: float) -> torch.Tensor:
        """A 0-d tensor of ``value`` (ops with a tensor operand take no Python-scalar path)."""
        if value not in self._scalars:
            self._scalars[value] = torch.tensor(value, dtype=self.dtype, device=self.device)
        return self._scalars[value]

    def derived(self, key: tuple, make: Callable[[], torch.Tensor]) -> torch.Tensor:
        """A tensor computed once from parameters (e.g. a fused norm's scaled weight)."""
        if key not in self._derived:
            self._derived[key] = make()
        return self._derived[key]

    def linear(self, mod: nn.Module) -> LinearInto:
        if id(mod) not in self.linears:
            self.linears[id(mod)] = LinearInto(mod, self.split, self._split_scratch)
        return self.linears[id(mod)]

    def residual(self) -> torch.Tensor:
        return self._x[:self.rows]

    def hidden(self, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(normed input h, branch output delta), each (B, dim)."""
        return self._h[:rows], self._delta[:rows]

    def norm_scratch(self, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self._sq[:rows], self._ms[:rows]

    def qkv_views(self, rows: int, nq: int, nkv: int, fused: bool):
        """Fused: (qkv (B, nq+2nkv), q, k, v column slices of it). Unfused: (q, k, v), each contiguous."""
        buf = self._qkv
        if fused:
            qkv = buf[:rows * (nq + 2 * nkv)].view(rows, nq + 2 * nkv)
            return qkv, qkv[:, :nq], qkv[:, nq:nq + nkv], qkv[:, nq + nkv:]
        a, b = rows * nq, rows * (nq + nkv)
        return buf[:a].view(rows, nq), buf[a:b].view(rows, nkv), buf[b:b + rows * nkv].view(rows, nkv)

    def gate_up_views(self, rows: int, hidden: int, fused: bool):
        """Fused: (gu (B, 2F), gate, up column slices, act (B, F)). Unfused: (gate, up), contiguous."""
        if fused:
            gu = self._gu[:rows * 2 * hidden].view(rows, 2 * hidden)
            return gu, gu[:, :hidden], gu[:, hidden:], self._act[:rows, :hidden]
        return self._gu[:rows * hidden].view(rows, hidden), self._gu[rows * hidden:2 * rows * hidden].view(rows, hidden)

    def attention_out(self, rows: int, width: int) -> torch.Tensor:
        return self._at[:rows, :width]

    def attention_scratch(self) -> tuple[torch.Tensor, ...]:
        """Flat buffers (kg, vg, qt, scores, probs, ao) for the cache's decode attention."""
        return self._kg, self._vg, self._qt, self._scores, self._probs, self._ao

    def rope_tables(self, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(cos, sin) (rows, D) at each row's position, for ``kernels.rope``."""
        return self._cos[:rows], self._sin[:rows]

    def rope(self, x: torch.Tensor) -> RopeInto:
        """Rotary embeddings in place on x (B, n, D), at each row's position."""
        B, D = x.shape[0], x.shape[-1]
        tmp = self._rot[:x.numel()].view(x.shape)
        return RopeInto(x, tmp, self._cos[:B].view(B, 1, D), self._sin[:B].view(B, 1, D))


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
