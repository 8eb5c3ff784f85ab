"""The decode step's workspace: every activation of a one-token-per-row step, allocated once,
and the out= / in-place pieces the modules' ``decode_calls`` bind into it.

A module's ``decode_calls`` (``RMSNorm``, ``Attention``, ``FeedForward``, the fused kinds, the
paged attention) takes views of a ``DecodeWorkspace`` for the step's shape and returns bound
calls; ``fast_decode.py`` and ``hourglass_decode.py`` bind and run them. This file sits below
the modules (it imports none of them) so that each can name what it binds into.

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


def rope_tables_folded(cos: torch.Tensor, sin: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """The tables ``RopeInto`` reads: rotate-half's sign folded into the sine, so that
    rotate_half(x) * sin == [x2, x1] * sin' term by term (negation is exact). Float32 CPU
    tables are folded in numpy: a decode process runs no other clone or negation of ATen, whose
    code each would map into it (issue 24's memory bound)."""
    half = sin.shape[1] // 2
    if sin.device.type == "cpu" and sin.dtype == dtype == torch.float32:
        folded = sin.numpy().copy()
        folded[:, :half] *= -1
        return cos, torch.from_numpy(folded)
    sin = sin.to(dtype).clone()
    sin[:, :half].neg_()
    return cos.to(dtype), sin


class RopeInto:
    """``apply_rope`` in place, without allocation: x (B, n, D) <- x*cos + [x2, x1]*sin'
    (tables from ``rope_tables_folded``, indexed by each row's position; ``tmp`` like x)."""

    def __init__(self, x: torch.Tensor, tmp: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        half = x.shape[-1] // 2
        self.x, self.t, self.cos, self.sin = x, tmp, cos, sin
        self.pairs = ((tmp[..., :half], x[..., half:]), (tmp[..., half:], x[..., :half]))

    def __call__(self) -> None:
        for dst, src in self.pairs:
            dst.copy_(src)
        self.t.mul_(self.sin)
        self.x.mul_(self.cos)
        self.x.add_(self.t)


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

    def __init__(self, model: nn.Module, max_rows: int, context_slots: int, cfg=None, kernels=None,
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
