"""Prefill and decode forward passes of a ``Transformer`` over a paged ``KVPool``.

The runner reads the model's own modules (embedding, norms, linears: plain, fused by
``fusion.py`` or quantised by ``quantize/``) and drives them in two paths:

- ``prefill(tokens, slots)``: one sequence's prompt, T tokens at once. Writes its keys and
  values into the pool at ``slots``; causal attention over the prompt itself through
  ``scaled_dot_product_attention``. Allocates freely (once per request).
- ``decode(B, S)``: one token for each of B sequences of different lengths. Inputs are the
  runner's own buffers (``tokens``, ``positions``, ``slots``, ``gather``, ``bias``), which
  the engine fills; ``gather`` / ``bias`` hold each row's first S slots (its page table,
  padded with the padding block) and the mask (-inf past its length). The step itself is
  in ``decode.py``: workspace allocated here once for ``max_rows`` x ``max_context``, no
  allocation in float32 (``count_allocations`` checks).

Rotary embeddings fold the rotate-half sign into the sine table (x*cos + [x2, x1]*sin'),
which is the model's formula term by term. Attention scales q before q.k, SDPA scales the
product: logits agree to float rounding (HF parity within 1e-4, tests). ``compile``
swaps in a functional decode step for ``torch.compile``.
"""

from __future__ import annotations

import time
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn
from torch.profiler import ProfilerActivity, profile

from trainforge.infer.decode import DecodePlan, LinearInto, decode_step
from trainforge.infer.fusion import FusedTransformerBlock, _unwrap, rms_norm
from trainforge.infer.kv_pool import KVPool
from trainforge.model.llama import Transformer


class _Layer:
    """One block's modules, resolved once (fused or not) so the decode loop does no lookups."""

    def __init__(self, block: nn.Module):
        attn, ffn = block.attention, block.feed_forward
        self.qkv = [attn.wqkv] if hasattr(attn, "wqkv") else [attn.wq, attn.wk, attn.wv]
        self.gate_up = [ffn.w13] if hasattr(ffn, "w13") else [ffn.w1, ffn.w3]
        self.wo, self.w2 = attn.wo, ffn.w2
        self.attn_norm, self.ffn_norm = block.attention_norm, block.ffn_norm
        self.fused_norm = isinstance(block, FusedTransformerBlock)


class ModelRunner:
    """Forward passes of ``model`` over ``pool`` for up to ``max_rows`` sequences of up to
    ``max_context`` tokens each. Does not modify the model."""

    MAX_PLANS = 64  # decode shapes whose workspace views are kept (decode.py)

    def __init__(self, model: Transformer, pool: KVPool, max_rows: int, max_context: int):
        cfg = model.cfg
        if max_context > cfg.max_seq_len:
            raise ValueError(f"max_context={max_context} exceeds the model's max_seq_len={cfg.max_seq_len}")
        self.model, self.pool, self.cfg = model, pool, cfg
        self.max_rows, self.max_context = max_rows, max_context
        # Gathers cover whole blocks, so the workspace's context is max_context rounded up.
        self.context_slots = -(-max_context // pool.block_size) * pool.block_size
        emb = model.tok_embeddings.weight
        self.device, self.dtype = emb.device, emb.dtype
        self.layers = [_Layer(_unwrap(b)) for b in model.layers.values()]
        self.fused_norm = all(layer.fused_norm for layer in self.layers)
        H, Hkv, D = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        self.H, self.Hkv, self.D, self.G, self.F = H, Hkv, D, H // Hkv, cfg.ffn_hidden_dim
        half = D // 2
        # Rotate-half sign folded into the sine: rotate_half(x) * sin == [x2, x1] * sin'.
        self.rope_cos = model.rope_cos.to(self.dtype)
        sin = model.rope_sin.to(self.dtype).clone()
        sin[:, :half].neg_()
        self.rope_sin = sin
        dev = dict(device=self.device)
        R, C = max_rows, self.context_slots
        # Decode inputs, filled by the engine (host views of these on CPU).
        self.tokens = torch.zeros(R, dtype=torch.long, **dev)
        self.positions = torch.zeros(R, dtype=torch.long, **dev)
        self.slots = torch.zeros(R, dtype=torch.long, **dev)
        self.gather = torch.zeros(R * C, dtype=torch.long, **dev)
        self.bias = torch.zeros(R * C, dtype=self.dtype, **dev)
        # Workspace: every decode activation, allocated once.
        f = dict(dtype=self.dtype, **dev)
        d, Fh = cfg.dim, self.F
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
        self.logits = torch.empty(R, cfg.vocab_size, **f)
        self._scale = torch.tensor(D ** -0.5, **f)
        self._eps = torch.tensor(cfg.norm_eps, **f)
        self._d = torch.tensor(float(d), **f)
        self._d_eps = torch.tensor(d * cfg.norm_eps, **f)
        # Fused norms fold sqrt(d) into their weight (fusion.py), once here.
        norms = [n for layer in self.layers for n in (layer.attn_norm, layer.ffn_norm)] + [model.norm]
        self._scaled_weight = {id(n): (n.weight.detach() * d ** 0.5).to(self.dtype) for n in norms}
        linears = [m for layer in self.layers for m in (*layer.qkv, layer.wo, *layer.gate_up, layer.w2)]
        linears.append(model.output)
        self.split = torch.get_num_threads() if self.device.type == "cpu" else 1
        widest = max(getattr(m, "out_features", 0) for m in linears)
        scratch = torch.empty(min(R, LinearInto.MAX_ROWS) * widest, **f) if self.split > 1 else None
        self._split_scratch = scratch
        self._into = {id(m): LinearInto(m, self.split, scratch) for m in linears}
        self._plans: dict[tuple[int, int], DecodePlan] = {}  # views per decode shape (B, S), oldest first
        self._decode_fn = self._decode
        self.compile_s: float | None = None
        self.static_shape: tuple[int, int] | None = None  # (rows, context) the compiled step runs at

    @property
    def workspace_bytes(self) -> int:
        return sum(t.nbytes for t in vars(self).values() if isinstance(t, torch.Tensor))

    # -- decode -----------------------------------------------------------------------------

    @torch.no_grad()
    def decode(self, B: int, S: int) -> torch.Tensor:
        """One token for rows 0..B-1 (inputs in ``tokens``, ``positions``, ``slots``, and
        ``gather`` / ``bias`` laid out (B, S), or ``static_shape`` once compiled); returns
        logits (B, V), a workspace view (a fresh tensor when compiled)."""
        if not 0 < B <= self.max_rows or not 0 < S <= self.context_slots:
            raise ValueError(f"decode(B={B}, S={S}) outside the workspace ({self.max_rows} x {self.context_slots})")
        if self.static_shape is not None:  # compiled: inputs are laid out for the static shape
            return self._decode_fn(*self.static_shape)[:B]
        return self._decode_fn(B, S)

    def _decode(self, B: int, S: int) -> torch.Tensor:
        plan = self._plans.get((B, S))
        if plan is None:
            if len(self._plans) >= self.MAX_PLANS:
                self._plans.pop(next(iter(self._plans)))  # the oldest
            plan = self._plans[(B, S)] = DecodePlan(self, B, S)
        return decode_step(self, plan)

    # -- prefill ----------------------------------------------------------------------------

    @torch.no_grad()
    def prefill(self, tokens: torch.Tensor, slots: torch.Tensor, all_logits: bool = False) -> torch.Tensor:
        """tokens, slots: (T,) for one new sequence (positions 0..T-1). Writes its keys and
        values into the pool; returns logits (1, V) of the last position, or (T, V)."""
        T = tokens.shape[0]
        if not 0 < T <= self.max_context:
            raise ValueError(f"prompt of {T} tokens: must be 1..{self.max_context} (max_context)")
        x = F.embedding(tokens, self.model.tok_embeddings.weight)  # (T, dim)
        cos, sin = self.rope_cos[:T].view(T, 1, self.D), self.rope_sin[:T].view(T, 1, self.D)
        layers = self.layers
        h = self._prefill_norm(x, layers[0].attn_norm, self.fused_norm)
        for i, layer in enumerate(layers):
            x = x + self._attention_prefill(i, layer, h, cos, sin, slots)
            h = self._prefill_norm(x, layer.ffn_norm, layer.fused_norm)
            x = x + self._ffn_prefill(layer, h)
            nxt = layers[i + 1].attn_norm if i + 1 < len(layers) else self.model.norm
            h = self._prefill_norm(x, nxt, layer.fused_norm)
        return self._linear(self.model.output, h if all_logits else h[-1:])

    def _linear(self, mod: nn.Module, x: torch.Tensor) -> torch.Tensor:
        """mod(x) for prefill: short prompts take the threaded row-block path too."""
        into = self._into[id(mod)]
        if into.float and into.split > 1 and x.shape[0] <= into.MAX_ROWS:
            out = torch.empty(x.shape[0], into.wt.shape[1], dtype=x.dtype, device=x.device)
            into(x, out, torch.empty_like(out).view(-1))
            return out
        return mod(x)

    @staticmethod
    def _prefill_norm(x: torch.Tensor, norm: nn.Module, fused: bool) -> torch.Tensor:
        return rms_norm(x, norm) if fused else norm(x)

    def _rope(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        half = self.D // 2
        return x * cos + torch.cat((x[..., half:], x[..., :half]), dim=-1) * sin

    def _attention_prefill(self, i: int, layer: _Layer, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                           slots: torch.Tensor) -> torch.Tensor:
        T = h.shape[0]
        H, Hkv, D = self.H, self.Hkv, self.D
        q, k, v = self._project_qkv(layer, h, self._linear)
        q = self._rope(q.reshape(T, H, D), cos, sin).transpose(0, 1)  # (H, T, D)
        k = self._rope(k.reshape(T, Hkv, D), cos, sin).transpose(0, 1)  # (Hkv, T, D)
        v = v.reshape(T, Hkv, D).transpose(0, 1)
        self.pool.k[i].index_copy_(1, slots, k)
        self.pool.v[i].index_copy_(1, slots, v)
        out = F.scaled_dot_product_attention(q[None], k[None], v[None], is_causal=True, enable_gqa=H != Hkv)
        return self._linear(layer.wo, out[0].transpose(0, 1).reshape(T, H * D))

    def _ffn_prefill(self, layer: _Layer, h: torch.Tensor) -> torch.Tensor:
        g, u = self._project_gate_up(layer, h, self._linear)
        return self._linear(layer.w2, F.silu(g) * u)

    def _project_qkv(self, layer: _Layer, h: torch.Tensor, linear: Callable) -> tuple[torch.Tensor, ...]:
        """q, k, v from one fused projection (split) or three."""
        if len(layer.qkv) == 1:
            return linear(layer.qkv[0], h).split([self.H * self.D, self.Hkv * self.D, self.Hkv * self.D], dim=-1)
        return tuple(linear(mod, h) for mod in layer.qkv)

    def _project_gate_up(self, layer: _Layer, h: torch.Tensor, linear: Callable) -> tuple[torch.Tensor, ...]:
        """SwiGLU's gate and up from one fused projection (split) or two."""
        if len(layer.gate_up) == 1:
            return linear(layer.gate_up[0], h).split(self.F, dim=-1)
        return tuple(linear(mod, h) for mod in layer.gate_up)

    # -- torch.compile ----------------------------------------------------------------------

    def _decode_graph(self, B: int, S: int) -> torch.Tensor:
        """The decode step written functionally (no ``out=``, no workspace), for
        ``torch.compile``: inductor plans its own buffers and fuses the elementwise ops,
        residual add and norm included. Same inputs and pool writes as ``_decode``."""
        H, Hkv, D, G = self.H, self.Hkv, self.D, self.G
        x = F.embedding(self.tokens[:B], self.model.tok_embeddings.weight)
        pos = self.positions[:B]
        cos, sin = self.rope_cos[pos].unsqueeze(1), self.rope_sin[pos].unsqueeze(1)  # (B, 1, D)
        slots, gather = self.slots[:B], self.gather[:B * S]
        bias = self.bias[:B * S].view(1, B, 1, S)
        layers = self.layers
        h = self._prefill_norm(x, layers[0].attn_norm, self.fused_norm)
        for i, layer in enumerate(layers):
            q, k, v = self._project_qkv(layer, h, _call)
            q = self._rope(q.reshape(B, H, D), cos, sin)
            k = self._rope(k.reshape(B, Hkv, D), cos, sin)
            self.pool.k[i].index_copy_(1, slots, k.transpose(0, 1))
            self.pool.v[i].index_copy_(1, slots, v.reshape(B, Hkv, D).transpose(0, 1))
            kg = self.pool.k[i].index_select(1, gather).view(Hkv, B, S, D)
            vg = self.pool.v[i].index_select(1, gather).view(Hkv, B, S, D)
            qt = q.view(B, Hkv, G, D).permute(1, 0, 2, 3) * self._scale  # (Hkv, B, G, D)
            probs = (qt @ kg.transpose(-1, -2) + bias).softmax(dim=-1)  # (Hkv, B, G, S)
            out = (probs @ vg).permute(1, 0, 2, 3).reshape(B, H * D)
            x = x + layer.wo(out)
            h = self._prefill_norm(x, layer.ffn_norm, layer.fused_norm)
            g, u = self._project_gate_up(layer, h, _call)
            x = x + layer.w2(F.silu(g) * u)
            nxt = layers[i + 1].attn_norm if i + 1 < len(layers) else self.model.norm
            h = self._prefill_norm(x, nxt, layer.fused_norm)
        return self.model.output(h)

    def compile(self) -> float:
        """Compile the decode step with ``torch.compile`` at one static shape, all
        ``max_rows`` rows x the whole context (gpt-fast's static-cache approach: one graph,
        no recompiles; unused rows attend to the padding block and are ignored), and run it
        once so the compile happens now. Returns (and keeps in ``compile_s``) the seconds taken."""
        self._decode_fn = torch.compile(self._decode_graph, dynamic=False)
        self.static_shape = (self.max_rows, self.context_slots)
        self.slots.zero_()  # every row writes into and reads from the padding block
        self.gather.zero_()
        self.bias.zero_()
        t0 = time.perf_counter()
        with torch.no_grad():
            self._decode_fn(*self.static_shape)
        self.compile_s = time.perf_counter() - t0
        bs = self.pool.block_size
        self.pool.k[:, :, :bs].zero_()
        self.pool.v[:, :, :bs].zero_()
        return self.compile_s


def _call(mod: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """A plain module call: the compiled graph lets inductor plan the linears."""
    return mod(x)


def count_allocations(fn, *args, **kwargs) -> dict[str, int]:
    """Memory allocations made while ``fn(*args, **kwargs)`` runs, from the profiler's memory
    events (every allocator call, CPU or CUDA): {"count": n, "bytes": total}."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn(*args, **kwargs)
    sizes = [e.nbytes() for e in prof.profiler.kineto_results.events() if e.name() == "[memory]" and e.nbytes() > 0]
    return {"count": len(sizes), "bytes": int(sum(sizes))}
