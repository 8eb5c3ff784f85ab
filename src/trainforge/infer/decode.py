"""The engine's decode step: one token for each of B sequences, with no allocation.

Every activation lives in the runner's workspace (allocated once for ``max_rows`` x
``max_context``) and every op is ``out=`` or in place. The views of the workspace a step
needs depend only on (B, S), so a ``DecodePlan`` builds them once per (B, S) and keeps
them (a batch-1 generation meets a new S every ``block_size`` tokens): a step then
dispatches only compute ops, ~40 per layer, instead of ~100 view ops on top of them.

Per layer: QKV projection (one matmul when fused), rotary embeddings in place, the new
keys/values appended at ``slots``, every row's first S slots gathered from the pool with
one ``index_select`` into (H_kv, B*S, D) (the batch of H_kv * B key matrices ``bmm``
wants, no permute copy), scores + additive mask (-inf past each row's length), softmax,
``bmm`` with the values, output projection, residual add, RMSNorm, SwiGLU, residual add.

Float linears run through ``LinearInto``: a few-row GEMM is memory-bound and MKL runs it
on one thread (it streamed ~12 GB/s at 1 or 2 threads on this machine), so the weight's
rows are split into ``split`` blocks (views, no copy) and multiplied with one ``bmm``,
whose batch OpenMP spreads over the threads (~22 GB/s on 2). Same dot products, same
results. Quantised layers call their kernel, which threads itself, and allocate its result
(the kernels have no ``out=`` form).
"""

from __future__ import annotations

import functools
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn


class LinearInto:
    """out = mod(x) for x (M, K) into a preallocated ``out`` (see the module docstring)."""

    MAX_ROWS = 64  # above this the GEMM has work enough for MKL's own threading

    def __init__(self, mod: nn.Module, split: int, scratch: torch.Tensor | None):
        self.mod = mod
        self.float = type(mod) is nn.Linear and mod.bias is None
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
            return functools.partial(self.mod.forward_into, x, out)
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


class _Rope:
    """In place: x (B, n, D) <- x*cos + [x2, x1]*sin' (sin' carries rotate-half's sign)."""

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


class DecodePlan:
    """Workspace views and bound calls of one decode step shape (B rows, S context slots)."""

    def __init__(self, r, B: int, S: int):  # r: the ModelRunner
        H, Hkv, D, G, Fh, d = r.H, r.Hkv, r.D, r.G, r.F, r.cfg.dim
        n = B * S
        self.x, self.h, self.sq, self.ms, self.delta = r._x[:B], r._h[:B], r._sq[:B], r._ms[:B], r._delta[:B]
        self.x_row, self.x_col, self.ms3 = self.x.view(B, 1, d), self.x.view(B, d, 1), self.ms.view(B, 1, 1)
        self.tokens, self.pos, self.slots = r.tokens[:B], r.positions[:B], r.slots[:B]
        self.cos2, self.sin2 = r._cos[:B], r._sin[:B]
        cos, sin = self.cos2.view(B, 1, D), self.sin2.view(B, 1, D)
        self.gather = r.gather[:n]
        self.kg, self.vg = r._kg[:Hkv * n * D].view(Hkv, n, D), r._vg[:Hkv * n * D].view(Hkv, n, D)
        self.kg_t = self.kg.view(Hkv * B, S, D).transpose(1, 2)
        self.vg_b = self.vg.view(Hkv * B, S, D)
        self.qt = r._qt[:H * B * D].view(Hkv, B, G, D)
        self.qt_b = self.qt.view(Hkv * B, G, D)
        self.scores = r._scores[:H * B * S].view(Hkv * B, G, S)
        self.scores4, self.bias = self.scores.view(Hkv, B, G, S), r.bias[:n].view(1, B, 1, S)
        self.probs = r._probs[:H * B * S].view(Hkv * B, G, S)
        self.ao = r._ao[:H * B * D].view(Hkv * B, G, D)
        self.ao_perm = self.ao.view(Hkv, B, G, D).permute(1, 0, 2, 3)
        self.at = r._at[:B]
        self.at4 = self.at.view(B, Hkv, G, D)
        self.logits = r.logits[:B]
        # Projections: fused (one buffer, column slices) or not (three / two buffers).
        qkv = r._qkv[:B * (H + 2 * Hkv) * D].view(B, (H + 2 * Hkv) * D)
        fq, fk, fv = qkv[:, :H * D], qkv[:, H * D:(H + Hkv) * D], qkv[:, (H + Hkv) * D:]
        uq = r._qkv[:B * H * D].view(B, H * D)
        uk = r._qkv[B * H * D:B * (H + Hkv) * D].view(B, Hkv * D)
        uv = r._qkv[B * (H + Hkv) * D:B * (H + 2 * Hkv) * D].view(B, Hkv * D)
        rot = r._rot
        qk = qkv[:, :(H + Hkv) * D].view(B, H + Hkv, D)
        self.variants = {
            True: dict(outs=[qkv], ropes=[_Rope(qk, rot[:qk.numel()].view(qk.shape), cos, sin)],
                       q=fq, k=fk, v=fv),
            False: dict(outs=[uq, uk, uv], ropes=[_Rope(t, rot[:t.numel()].view(t.shape), cos, sin)
                                                  for t in (uq.view(B, H, D), uk.view(B, Hkv, D))], q=uq, k=uk, v=uv),
        }
        for v in self.variants.values():
            v["k3"] = v["k"].view(B, Hkv, D).transpose(0, 1)
            v["v3"] = v["v"].view(B, Hkv, D).transpose(0, 1)
            v["q_perm"] = v["q"].view(B, Hkv, G, D).permute(1, 0, 2, 3)
        gu = r._gu[:B * 2 * Fh].view(B, 2 * Fh)
        ug, uu = r._gu[:B * Fh].view(B, Fh), r._gu[B * Fh:2 * B * Fh].view(B, Fh)
        self.ffn = {True: dict(outs=[gu], g=gu[:, :Fh], u=gu[:, Fh:], act=r._act[:B]),
                    False: dict(outs=[ug, uu], g=ug, u=uu, act=ug)}
        self.layers = []
        for layer in r.layers:
            att = self.variants[len(layer.qkv) == 1]
            ffn = self.ffn[len(layer.gate_up) == 1]
            self.layers.append(dict(
                att=att, ffn=ffn,
                qkv=[r._into[id(m)].bind(self.h, o) for m, o in zip(layer.qkv, att["outs"])],
                wo=r._into[id(layer.wo)].bind(self.at, self.delta),
                gate_up=[r._into[id(m)].bind(self.h, o) for m, o in zip(layer.gate_up, ffn["outs"])],
                w2=r._into[id(layer.w2)].bind(ffn["act"], self.delta)))
        self.output = r._into[id(r.model.output)].bind(self.h, self.logits)


def rms_norm_into(r, p: DecodePlan, norm: nn.Module, fused: bool) -> None:
    """p.h <- RMSNorm(p.x), no allocation (fp32). Unfused: the model's arithmetic op for op
    (sum / d is what ``mean`` computes). Fused: x * rsqrt(x.x + d*eps) * (w*sqrt(d)) (fusion.py)."""
    if r.dtype != torch.float32:
        p.h.copy_(norm(p.x))
    elif fused and p.x.is_cuda:
        p.h.copy_(torch.ops.aten._fused_rms_norm(p.x, [p.x.shape[1]], norm.weight, norm.eps)[0])
    elif fused:
        torch.bmm(p.x_row, p.x_col, out=p.ms3)  # sum of squares
        p.ms.add_(r._d_eps).rsqrt_()
        torch.mul(p.x, p.ms, out=p.h)
        p.h.mul_(r._scaled_weight[id(norm)])
    else:
        torch.mul(p.x, p.x, out=p.sq)
        torch.sum(p.sq, dim=-1, keepdim=True, out=p.ms)
        p.ms.div_(r._d).add_(r._eps).rsqrt_()
        torch.mul(p.x, p.ms, out=p.h)
        p.h.mul_(norm.weight)


def decode_step(r, p: DecodePlan) -> torch.Tensor:
    """One decode step of runner ``r`` at plan ``p``'s shape; returns logits (B, V) (a view)."""
    torch.index_select(r.model.tok_embeddings.weight, 0, p.tokens, out=p.x)
    torch.index_select(r.rope_cos, 0, p.pos, out=p.cos2)
    torch.index_select(r.rope_sin, 0, p.pos, out=p.sin2)
    layers = r.layers
    rms_norm_into(r, p, layers[0].attn_norm, r.fused_norm)
    for i, (layer, calls) in enumerate(zip(layers, p.layers)):
        att, ffn = calls["att"], calls["ffn"]
        for call in calls["qkv"]:
            call()
        for rope in att["ropes"]:
            rope()
        kp, vp = r.pool.k[i], r.pool.v[i]  # (H_kv, slots, D)
        kp.index_copy_(1, p.slots, att["k3"])
        vp.index_copy_(1, p.slots, att["v3"])
        torch.index_select(kp, 1, p.gather, out=p.kg)
        torch.index_select(vp, 1, p.gather, out=p.vg)
        torch.mul(att["q_perm"], r._scale, out=p.qt)
        torch.bmm(p.qt_b, p.kg_t, out=p.scores)
        p.scores4.add_(p.bias)
        torch.ops.aten._softmax.out(p.scores, -1, False, out=p.probs)
        torch.bmm(p.probs, p.vg_b, out=p.ao)
        p.at4.copy_(p.ao_perm)
        calls["wo"]()
        p.x.add_(p.delta)
        rms_norm_into(r, p, layer.ffn_norm, layer.fused_norm)
        for call in calls["gate_up"]:
            call()
        F.silu(ffn["g"], inplace=True)
        if ffn["act"] is ffn["g"]:
            ffn["g"].mul_(ffn["u"])
        else:
            torch.mul(ffn["g"], ffn["u"], out=ffn["act"])
        calls["w2"]()
        p.x.add_(p.delta)
        rms_norm_into(r, p, layers[i + 1].attn_norm if i + 1 < len(layers) else r.model.norm, layer.fused_norm)
    p.output()
    return p.logits
