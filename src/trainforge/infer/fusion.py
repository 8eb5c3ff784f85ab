"""Fusion rules for inference: which module swaps to apply to a built model, from outside.
The fused module kinds themselves live in ``trainforge.model.fused`` (each with its forward
and its decode fast path); this file only decides where they replace the plain ones.

- QKV: ``wq``, ``wk``, ``wv`` become one ``wqkv`` (``FusedAttention``).
- gate+up: the SwiGLU ``w1`` (gate) and ``w3`` (up) become one ``w13`` (``FusedFeedForward``);
  in a MoE block, the shared experts' (a SwiGLU on every token).
- residual-add + RMSNorm: every block's norms and the final norm become ``FusedRMSNorm``
  (``FusedTransformerBlock``).
- row-block linears (``row_block_linears``, CPU): every float linear becomes a
  ``RowBlockLinear``, whose few-row products (a prompt's prefill) spread over the threads,
  or, where the C++ kernels build, its ``GemvLinear`` form (``cpu_linear.py``: the decode
  step's 1-8 row products on the C++ GEMV).

A MoE block is not a dense block: its ``MoE`` feed-forward stays as it is (routing is the
model's own forward; the routed experts' weights are one stacked tensor per projection, no
concatenation to gain), only its attention, norms and shared experts are fused. The router's
gate is left a plain fp32 ``nn.Linear`` (never row-blocked or quantised: ``quantize/experts.py``).

Quantised linears concatenate in their stored form (``QuantLinear.cat``), so fusion may run
before or after the quantisation swap, as long as the layers are not packed yet.
``count_ops`` counts the ATen operators a call dispatches (views included), for the
before/after report. ``fuse_model`` mutates the model it is given (``prepare.py`` applies
it before an engine is built; the engine never changes its model).
"""

from __future__ import annotations

from collections import Counter
from typing import Any, Callable

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from trainforge.infer.cpu_kernels import load_kernels
from trainforge.infer.cpu_linear import GemvLinear
from trainforge.infer.quantize.common import QuantLinear
from trainforge.model.decode_workspace import RowBlockLinear
from trainforge.model.fused import FusedAttention, FusedFeedForward, FusedRMSNorm, FusedTransformerBlock
from trainforge.model.llama import Attention, FeedForward, RMSNorm
from trainforge.model.moe import MoE, Router


def cat_linears(mods: list[nn.Module]) -> nn.Module | None:
    """One layer whose output is the concatenation of ``mods``' outputs (same input),
    or None when they cannot be concatenated (mixed kinds, packed quantised layers)."""
    if all(type(m) is nn.Linear and m.bias is None for m in mods):
        w = torch.cat([m.weight.detach() for m in mods], dim=0)
        fused = nn.Linear(w.shape[1], w.shape[0], bias=False, device="meta")
        fused.weight = nn.Parameter(w, requires_grad=False)
        return fused
    if all(type(m) is type(mods[0]) and isinstance(m, QuantLinear) for m in mods):
        if any(m.kernel_name not in (None, "reference") for m in mods):
            return None
        return type(mods[0]).cat(mods)
    return None


def _unwrap(block: nn.Module) -> nn.Module:
    for attr in ("_checkpoint_wrapped_module", "_orig_mod"):
        block = getattr(block, attr, block)
    return block


def _fuse_gate_up(ffn: FeedForward) -> FusedFeedForward | None:
    w13 = cat_linears([ffn.w1, ffn.w3])
    return None if w13 is None else FusedFeedForward(w13, ffn.w2, ffn.w1.out_features)


@torch.no_grad()
def fuse_model(model: nn.Module, qkv: bool = True, gate_up: bool = True, add_norm: bool = True) -> dict[str, int]:
    """Swap every block's attention / MLP / block for the fused versions (in place).
    Returns how many of each fusion were applied."""
    done = {"qkv": 0, "gate_up": 0, "add_norm": 0}
    for name in list(model.layers.keys()):
        block = _unwrap(model.layers[name])
        attn, ffn = block.attention, block.feed_forward
        if qkv and isinstance(attn, Attention):
            wqkv = cat_linears([attn.wq, attn.wk, attn.wv])
            if wqkv is not None:
                block.attention = FusedAttention(wqkv, attn.wo, attn.n_heads, attn.n_kv_heads, attn.head_dim)
                done["qkv"] += 1
        if gate_up and isinstance(ffn, FeedForward):
            fused = _fuse_gate_up(ffn)
            if fused is not None:
                block.feed_forward = fused
                done["gate_up"] += 1
        if gate_up and isinstance(ffn, MoE) and isinstance(ffn.shared_experts, FeedForward):
            fused = _fuse_gate_up(ffn.shared_experts)
            if fused is not None:
                ffn.shared_experts = fused
                done["gate_up"] += 1
        if add_norm and not isinstance(block, FusedTransformerBlock):
            block = FusedTransformerBlock(block)
            done["add_norm"] += 1
        model.layers[name] = block
    if add_norm and type(model.norm) is RMSNorm:
        model.norm = FusedRMSNorm.of(model.norm)
    return done


def row_block_linears(model: nn.Module) -> int:
    """Swap every bias-free float ``nn.Linear`` but a router's gate for a ``RowBlockLinear`` on
    the same weight (in place), a ``GemvLinear`` (the C++ GEMV for decode) where the CPU kernels
    build and the weight is fp32; returns how many. Run after fusion (``cat_linears`` takes plain linears)."""
    swaps = [(parent, name, m) for parent in model.modules() if not isinstance(parent, Router)
             for name, m in parent.named_children() if type(m) is nn.Linear and m.bias is None]
    ops = load_kernels() if swaps else None
    for parent, name, m in swaps:
        gemv = ops is not None and m.weight.dtype == torch.float32
        setattr(parent, name, GemvLinear.of(m, ops) if gemv else RowBlockLinear.of(m))
    return len(swaps)


class _OpCounter(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.counts: Counter[str] = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.counts[str(func.overloadpacket.__name__)] += 1
        return func(*args, **(kwargs or {}))


_VIEW_OPS = {"view", "_unsafe_view", "slice", "select", "t", "transpose", "permute", "expand", "unsqueeze",
             "squeeze", "split", "split_with_sizes", "unbind", "alias", "detach", "as_strided", "reshape",
             "_reshape_alias", "chunk", "narrow", "lift_fresh"}


def count_ops(fn: Callable[..., Any], *args, **kwargs) -> dict[str, Any]:
    """ATen operators dispatched by ``fn(*args, **kwargs)`` (a composite op such as
    ``F.linear`` counts as the ops it decomposes into; ops a kernel calls internally are not
    seen): ``total``, ``compute`` (without views and other metadata-only ops) and ``by_op``."""
    with _OpCounter() as counter:
        fn(*args, **kwargs)
    counts = counter.counts
    compute = sum(n for op, n in counts.items() if op not in _VIEW_OPS)
    return {"total": sum(counts.values()), "compute": compute, "by_op": dict(counts.most_common())}
