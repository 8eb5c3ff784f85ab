"""The acceptance rule of speculative decoding (Leviathan et al. 2023; Chen et al. 2023).

A drafter proposed k tokens x_1..x_k per row, drawn from its distributions q_1..q_k; the
target scored them in one forward, giving p_1..p_{k+1}. Draft x_j is accepted with
probability min(1, p_j(x_j) / q_j(x_j)), in order, until the first rejection; a rejected
position is replaced by a draw from norm(max(0, p_j - q_j)); when all k are accepted, a
bonus token is drawn from p_{k+1}. The tokens emitted are then distributed exactly as
plain sampling from p would give them.

p and q are the *sampling* distributions: temperature, top-k and top-p applied to both the
same way (``filtered_probs``; the order and tie rules of ``sampling.BatchSampler``). A
greedy row (temperature 0) has one-hot p and q (argmax), for which the rule reduces to
"accept while the draft equals the target's argmax, then emit the target's argmax": output
identical to greedy decoding. Greedy rows draw nothing. A batch of greedy rows only skips the
probabilities altogether (``accept_greedy``: argmaxes, the same tokens).

Rows draw their uniforms and residual samples from their request's own generator
(``BatchSampler``'s), so a seed reproduces a request whatever shares its batch.
"""

from __future__ import annotations

import torch

from trainforge.infer.sampling import SamplingParams


def filtered_probs(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """logits (B, T, V) -> float32 probabilities (B, T, V) of each row's sampling
    distribution: temperature, then top-k (keep logits >= the k-th largest), then top-p (drop
    a token once the mass before it reaches top_p), softmax; one-hot argmax for greedy rows."""
    logits = logits.float()
    out = torch.empty_like(logits)
    for b, sp in enumerate(params):
        x = logits[b]  # (T, V)
        if sp.greedy:
            out[b] = torch.nn.functional.one_hot(x.argmax(-1), x.shape[-1]).float()
            continue
        x = x / sp.temperature
        k = min(sp.top_k, x.shape[-1])
        if k:
            kth = x.topk(k, dim=-1).values[:, -1:]
            x = x.masked_fill(x < kth, float("-inf"))
        if sp.top_p < 1.0:
            srt, idx = x.sort(dim=-1, descending=True)
            probs = srt.softmax(-1)
            before = probs.cumsum(-1) - probs
            drop = torch.zeros_like(before, dtype=torch.bool).scatter_(-1, idx, before >= sp.top_p)
            x = x.masked_fill(drop, float("-inf"))
        out[b] = x.softmax(-1)
    return out


def draw(probs: torch.Tensor, params: list[SamplingParams], gens: list[torch.Generator | None]) -> torch.Tensor:
    """One token per row from probs (B, V) (argmax for greedy rows), each with its row's generator."""
    out = probs.argmax(-1)
    for b, sp in enumerate(params):
        if not sp.greedy:
            out[b] = torch.multinomial(probs[b], 1, generator=gens[b])[0]
    return out


def accept_greedy(draft: torch.Tensor, target_logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``accept`` for a batch of greedy rows, from the target's logits (B, k+1, V): drafts are
    kept while they equal the target's argmax, then the argmax follows (so the emitted tokens
    are the argmaxes themselves)."""
    best = target_logits.argmax(-1)  # (B, k+1)
    return (draft == best[:, :-1]).long().cumprod(-1).sum(-1), best


def accept(draft: torch.Tensor, q: torch.Tensor, p: torch.Tensor, params: list[SamplingParams],
           gens: list[torch.Generator | None]) -> tuple[torch.Tensor, torch.Tensor]:
    """draft (B, k) tokens drawn from q (B, k, V); p (B, k+1, V) the target's distributions at
    the k draft positions and the one after. Returns (n_accepted (B,), tokens (B, k+1)):
    row b emits ``tokens[b, :n_accepted[b] + 1]`` (its accepted drafts, then the residual
    draw or the bonus token); entries past that are meaningless."""
    B, k = draft.shape
    px = p[:, :k].gather(-1, draft[..., None])[..., 0]  # (B, k)
    qx = q.gather(-1, draft[..., None])[..., 0]
    u = torch.zeros(B, k, device=p.device)  # greedy rows: accept iff p(x) > 0, i.e. x is the argmax
    for b, sp in enumerate(params):
        if not sp.greedy:
            u[b] = torch.rand(k, generator=gens[b], device=p.device)
    ok = u * qx < px  # u < p/q without dividing by a q of 0 (x was drawn from q, so q(x) > 0)
    n = ok.long().cumprod(-1).sum(-1)  # leading accepts, (B,)
    # q past the last draft is 0, so position k's "residual" is p_{k+1} itself: the bonus draw.
    q_pad = torch.cat([q, torch.zeros_like(q[:, :1])], dim=1)  # (B, k+1, V)
    rows = torch.arange(B, device=p.device)
    residual = (p[rows, n] - q_pad[rows, n]).clamp_(min=0)  # (B, V)
    mass = residual.sum(-1, keepdim=True)
    # A rejection means p(x) < q(x), so p - q has positive mass somewhere; float rounding could
    # still leave none, and then p itself is the right distribution to fall back to.
    residual = torch.where(mass > 0, residual / mass.clamp(min=1e-30), p[rows, n])
    tokens = torch.cat([draft, draft[:, :1]], dim=1)
    tokens[rows, n] = draw(residual, params, gens)
    return n, tokens
