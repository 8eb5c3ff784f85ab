"""Mixture-of-experts feed-forward (DeepSeek-V3 / Mixtral style), for one device.

``MoE`` replaces a block's SwiGLU ``FeedForward``: a ``Router`` picks ``k`` of
``n_routed_experts`` fine-grained SwiGLU experts per token, ``GroupedExperts`` runs them,
and ``n_shared_experts`` always-on experts (one wider SwiGLU) see every token.

Dispatch sorts the (token, choice) pairs by expert, so each expert's tokens are one
contiguous slice of a single gathered matrix and the experts run as one grouped GEMM
(``torch._grouped_mm``, CPU and CUDA in torch 2.13) or, where that is refused, one
matmul per expert slice. Nothing loops over tokens. Expert parallelism
(``parallel/expert_parallel.py``) wraps ``GroupedExperts`` from outside: it receives the
sorted tokens and per-expert counts, sends them to the ranks owning the experts and
brings the results back; this file does not know.

Balancing (DeepSeek-V3 §2.1.2; Wang et al. 2024, "Auxiliary-Loss-Free Load Balancing"):

* ``Router.expert_bias`` is added to the scores for *selection only*; the combine weights
  come from the unbiased scores. The bias is a persistent buffer (checkpointed with the
  weights); ``train/moe_balance.py`` moves it after each optimizer step from the load the
  routers count here (``load``: training forwards; ``eval_load``: eval forwards).
* Optional auxiliary losses, computed in the forward when their coefficient is > 0:
  the sequence-wise balance loss (DeepSeek-V3 eq. 17-20) and the classic batch-wise one
  (Switch / GShard). They reach the gradient through ``_AuxLossGrad``: the block's output
  carries them, so the training loss needs no extra term and every layout (DDP, FSDP2,
  pipeline stages, activation checkpointing) backpropagates them unchanged. Their value
  is kept in ``Router.aux_loss`` (detached) and summed in ``Router.aux_loss_sum`` for metrics.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from trainforge.model.config import ModelConfig
from trainforge.model.swiglu import FeedForward


def _in_backward() -> bool:
    """True while autograd's engine runs (activation checkpointing re-running a forward):
    such a forward must not count load a second time."""
    return torch._C._current_graph_task_id() != -1


class Router(nn.Module):
    """Scores (N, dim) tokens against ``n_experts`` and picks ``k`` per token.

    ``gate`` is an ``nn.Linear`` so the precision rule ``*.gate`` keeps it in fp32 (top-k
    over near-ties flips in bf16). Returns (weights (N, k) in fp32, expert ids (N, k))."""

    # Buffers that count this rank's own tokens (summed over micro-batches until the balance
    # component all-reduces them): data parallelism must not overwrite them with rank 0's.
    rank_local_buffers = ("load", "eval_load", "aux_loss_sum")

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.n_experts, self.k = cfg.n_routed_experts, cfg.n_activated_experts
        self.score_func, self.route_scale = cfg.score_func, cfg.route_scale
        self.n_group, self.topk_group = cfg.n_group, cfg.topk_group
        self.norm_topk_prob = cfg.norm_topk_prob
        self.aux_loss_alpha, self.seq_aux_loss_alpha = cfg.aux_loss_alpha, cfg.seq_aux_loss_alpha
        self.gate = nn.Linear(cfg.dim, cfg.n_routed_experts, bias=False)
        # Selection bias (loss-free balancing): state, saved with the weights.
        self.register_buffer("expert_bias", torch.zeros(cfg.n_routed_experts))
        # Tokens routed to each expert since the balance component last read them.
        self.register_buffer("load", torch.zeros(cfg.n_routed_experts), persistent=False)
        self.register_buffer("eval_load", torch.zeros(cfg.n_routed_experts), persistent=False)
        # (sum of the auxiliary losses, number of training forwards) for metrics, counted like ``load``.
        self.register_buffer("aux_loss_sum", torch.zeros(2), persistent=False)
        self.aux_loss: torch.Tensor | None = None
        # Multiplies the auxiliary losses' gradient: 1 / micro-batches (x the fp16 loss
        # scale, a device tensor), set by the balance component, so they average like the main loss.
        self.aux_grad_scale: float | torch.Tensor = 1.0

    def scores(self, x: torch.Tensor) -> torch.Tensor:
        logits = F.linear(x.float(), self.gate.weight.float())
        if self.score_func == "sigmoid":
            return logits.sigmoid()
        return logits.softmax(dim=-1)

    def select(self, scores: torch.Tensor) -> torch.Tensor:
        """Expert ids (N, k) by biased scores, within the best ``topk_group`` groups."""
        biased = scores + self.expert_bias
        if self.n_group > 1:
            grouped = biased.view(scores.shape[0], self.n_group, -1)
            group_scores = grouped.topk(2, dim=-1).values.sum(-1)  # (N, n_group)
            keep = group_scores.topk(self.topk_group, dim=-1).indices
            mask = torch.ones_like(group_scores, dtype=torch.bool).scatter_(1, keep, False)
            biased = grouped.masked_fill(mask.unsqueeze(-1), float("-inf")).view_as(scores)
        return biased.topk(self.k, dim=-1).indices

    def forward(self, x: torch.Tensor, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
        """x: (N, dim) with N = batch * seq_len tokens in sequence order."""
        scores = self.scores(x)
        idx = self.select(scores)
        weights = scores.gather(1, idx)
        if self.score_func == "sigmoid" or self.norm_topk_prob:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        weights = weights * self.route_scale
        if not _in_backward():
            with torch.no_grad():
                counts = torch.bincount(idx.flatten(), minlength=self.n_experts).to(self.load.dtype)
                (self.load if self.training else self.eval_load).add_(counts)
        self.aux_loss = self._aux_loss(scores, idx, seq_len) if self.training else None
        if self.aux_loss is not None and not _in_backward():
            with torch.no_grad():
                self.aux_loss_sum[0] += self.aux_loss.detach()
                self.aux_loss_sum[1] += 1
        return weights, idx

    def _aux_loss(self, scores: torch.Tensor, idx: torch.Tensor, seq_len: int) -> torch.Tensor | None:
        """alpha * sum_i f_i * P_i: f_i = E / (k T) x tokens choosing expert i, P_i = the
        mean normalised score of expert i; per sequence (DeepSeek-V3 eq. 17-20, T = the
        sequence) and/or over the whole micro-batch (the classic auxiliary loss)."""
        if not (self.aux_loss_alpha or self.seq_aux_loss_alpha):
            return None
        E, k = self.n_experts, self.k
        probs = scores / scores.sum(dim=-1, keepdim=True)  # softmax: unchanged; sigmoid: normalised
        chosen = torch.zeros_like(scores).scatter_(1, idx, 1.0)  # (N, E)
        total = scores.new_zeros(())
        if self.seq_aux_loss_alpha:
            B = scores.shape[0] // seq_len
            f = chosen.view(B, seq_len, E).mean(1) * (E / k)
            p = probs.view(B, seq_len, E).mean(1)
            total = total + self.seq_aux_loss_alpha * (f * p).sum(-1).mean()
        if self.aux_loss_alpha:
            f = chosen.mean(0) * (E / k)
            total = total + self.aux_loss_alpha * (f * probs.mean(0)).sum()
        return total


def _grouped_mm_ok(x: torch.Tensor, w: torch.Tensor) -> bool:
    # torch._grouped_mm takes bf16 on CUDA and fp32/bf16 on CPU; it refuses fp16 (CPU) and
    # fp32 on CUDA: fall back to per-expert matmuls there. Its meta kernel (what torch.compile
    # traces with) takes only bf16, so a compiled fp32 forward uses the per-expert matmuls too.
    return hasattr(torch, "_grouped_mm") and x.dtype == w.dtype and (x.dtype == torch.bfloat16 or (
        x.device.type == "cpu" and x.dtype == torch.float32 and not torch.compiler.is_compiling()))


class GroupedExperts(nn.Module):
    """``n`` SwiGLU experts stacked: w1, w3 (n, hidden, dim), w2 (n, dim, hidden) (each
    expert's weight in ``nn.Linear`` layout). ``forward(x, counts)``: x (M, dim) sorted by
    expert, ``counts`` (n,) tokens per expert -> (M, dim) in the same order.

    ``grouped_mm``: run the three projections as grouped GEMMs where torch has one for the
    dtype (``bench/moe.py`` measured it the faster choice on CPU too), else one matmul per
    expert's contiguous slice."""

    grouped_mm = True

    def __init__(self, n: int, dim: int, hidden: int):
        super().__init__()
        self.w1 = nn.Parameter(torch.empty(n, hidden, dim))
        self.w2 = nn.Parameter(torch.empty(n, dim, hidden))
        self.w3 = nn.Parameter(torch.empty(n, hidden, dim))

    def forward(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        w1, w2, w3 = (w.to_local() if hasattr(w, "to_local") else w for w in (self.w1, self.w2, self.w3))
        if x.shape[0] == 0:
            return x.new_zeros(x.shape)
        if self.grouped_mm and _grouped_mm_ok(x, w1):
            offs = counts.cumsum(0).to(torch.int32)
            h = F.silu(torch._grouped_mm(x, w1.transpose(1, 2), offs=offs)) * torch._grouped_mm(
                x, w3.transpose(1, 2), offs=offs)
            return torch._grouped_mm(h, w2.transpose(1, 2), offs=offs)
        out, start = [], 0
        for e, c in enumerate(counts.tolist()):
            xs = x[start:start + c]
            start += c
            out.append(F.linear(F.silu(F.linear(xs, w1[e])) * F.linear(xs, w3[e]), w2[e]))
        return torch.cat(out)


class _AuxLossGrad(torch.autograd.Function):
    """Identity on ``out``; in backward also gives ``aux`` the gradient ``scale``, as if
    ``scale * aux`` had been added to the loss (Megatron's MoEAuxLossAutoScaler idea)."""

    @staticmethod
    def forward(ctx, out: torch.Tensor, aux: torch.Tensor, scale: float | torch.Tensor) -> torch.Tensor:
        ctx.scale = scale
        return out.view_as(out)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        # A tensor scale (the fp16 loss scale lives on the device) is used as is: no host sync.
        scale = ctx.scale
        if isinstance(scale, torch.Tensor):
            g = scale.detach().to(device=grad.device, dtype=torch.float32).reshape(())
        else:
            g = torch.full((), scale, dtype=torch.float32, device=grad.device)
        return grad, g, None


class MoE(nn.Module):
    """Routed experts + shared experts: the feed-forward of a MoE block."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.router = Router(cfg)
        self.experts = GroupedExperts(cfg.n_routed_experts, cfg.dim, cfg.moe_inter_dim)
        self.shared_experts = (FeedForward(cfg.dim, cfg.n_shared_experts * cfg.moe_inter_dim)
                               if cfg.n_shared_experts else None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, D = x.shape
        flat = x.reshape(-1, D)
        weights, idx = self.router(flat, T)
        k = idx.shape[1]
        # Sort (token, choice) pairs by expert: each expert's tokens become one slice.
        order = idx.flatten().argsort(stable=True)
        counts = torch.bincount(idx.flatten(), minlength=self.router.n_experts)
        token = order // k
        ys = self.experts(flat[token], counts)
        ys = ys * weights.flatten()[order].unsqueeze(-1).to(ys.dtype)
        out = torch.zeros_like(flat).index_add_(0, token, ys.to(flat.dtype))
        if self.shared_experts is not None:
            out = out + self.shared_experts(flat)
        aux = self.router.aux_loss
        if aux is not None:
            # The router keeps the value, not its graph: a module holding a non-leaf tensor cannot
            # be deep-copied (pipeline stages, master weights) and would keep the graph alive.
            self.router.aux_loss = aux.detach()
            if torch.is_grad_enabled():
                out = _AuxLossGrad.apply(out, aux, self.router.aux_grad_scale)
        return out.view(B, T, D)

    def decode_calls(self, ws, h: torch.Tensor, out: torch.Tensor) -> list[Callable[[], None]]:
        """The decode step's call (``model/fast_decode.py``): this forward on the (B, dim) rows.
        Routing is data-dependent (which experts, how many tokens each), so unlike the dense
        modules it allocates; the rest of the block keeps its allocation-free calls."""
        B, D = h.shape
        rows = h.view(B, 1, D)
        return [lambda: out.copy_(self(rows).view(B, D))]


def routers(module: nn.Module) -> list[tuple[str, Router]]:
    """Every ``Router`` in ``module`` with its FQN (layer order)."""
    return [(n, m) for n, m in module.named_modules() if isinstance(m, Router)]
