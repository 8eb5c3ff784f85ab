"""MTP self-speculation: the model's own multi-token-prediction module drafts for it
(``--speculative mtp``; DeepSeek-V3 §5.4.3).

MTP depth 1 at position t reads the main model's last hidden state h_t (before the final
norm) and the token t+1 and predicts token t+2 (``Transformer.mtp_step``). In a speculative
step whose last accepted token x_p sits at position p (not yet in any cache):

- draft 1 is depth 1 at position p-1 on (h_{p-1}, x_p): the drafter keeps h_{p-1} per row,
  taken from the target's previous forward (prefill or verification);
- draft j+1 (j >= 1) is depth 1 again at position p-1+j on (its own output at p-2+j, draft j):
  the module is reused recurrently, its output standing in for the target's hidden state
  (vLLM's MTP proposer and EAGLE do the same). Only depth 1 drafts, for every k: deeper
  modules chained at position p-1 would attend to their own states at positions whose
  tokens t+depth are still drafts, a triangle of extra forwards per step, not written.
  A model with mtp_depth > 1 therefore drafts with its first module alone.

The MTP block's keys/values live in a paged pool of their own (one layer, the block's
shape) over the target's slots: position t's entry sits in the slot the target uses for
position t, so the engine's page tables, growth, rollback and freeing cover it.
Invariant at ``propose``: the MTP cache holds exact entries (h_t of the target, token t+1,
both accepted) for positions 0..p-2. ``propose`` writes p-1 exactly and p..p+k-2 from drafts;
``accepted`` rewrites the accepted positions p..p+n-1 from the verification forward's hidden
states (the target's, so they are exact) and keeps h_{p+n} for the next step. Entries past
a row's accepted length are rewritten before they are next read.

``accepted`` also runs the next step's first draft: that draft is depth 1 at position p+n on
(h_{p+n}, the next input token), the column right after the accepted ones, so one forward
of n+1 tokens (ragged rows padded to the longest) writes the accepted entries and the next
first draft's; its logits and output wait for the next ``propose``. That saves one MTP
forward per step (~3 ms of ~23 for dsv3-tiny at k = 1 on this CPU). A row without a pending
first draft (it joined since, by ``prefill``) makes ``propose`` compute the first draft of
every row as before (rewriting the same entries).

Drafts run on ``FastMTPStep`` (model/fast_decode.py: the module's allocation-free one-token
step; for ``tiny`` on this CPU the plain ``mtp_step`` spent most of its ~2.5 ms in Python
dispatch). ``accepted`` (T tokens at once, once per step) uses ``mtp_step``.
"""

from __future__ import annotations

import numpy as np
import torch

from trainforge.errors import TrainforgeError
from trainforge.infer.kv_pool import KVPool
from trainforge.infer.speculative import DraftBatch, Drafter, pick_draft
from trainforge.model.attention_cache import LayerCache, PagedCache
from trainforge.model.fast_decode import FastMTPStep
from trainforge.model.llama import Transformer


def check_mtp_model(cfg) -> None:
    """``TrainforgeError`` unless the model has MTP modules to draft with."""
    if cfg.mtp_depth < 1:
        raise TrainforgeError("--speculative mtp needs a model trained with model.mtp_depth >= 1 (this checkpoint "
                              "has mtp_depth 0, no MTP modules); train with --model.mtp_depth 1 or use "
                              "--speculative draft:CHECKPOINT")


class _MTPLayers:
    """The drafter's one-layer ``PagedCache`` seen under the layer index the MTP block asks
    for (``n_layers``: depth 1), so the pool holds no empty layers for the main blocks."""

    def __init__(self, cache: PagedCache, first: int):
        self.cache, self.first = cache, first

    def layer(self, index: int) -> LayerCache:
        return self.cache.layer(index - self.first)


class MTPDrafter(Drafter):
    """Drafts with ``model.mtp["0"]`` (depth 1) of the target itself (module docstring)."""

    wants_hidden = True

    def __init__(self, fast: bool = True):
        self.model: Transformer | None = None
        self.cache: PagedCache | None = None
        self.fast: FastMTPStep | bool | None = fast  # the allocation-free step, built where supported

    def build(self, target: Transformer, pool: KVPool, max_rows: int, max_context: int, k: int) -> None:
        check_mtp_model(target.cfg)
        cfg, w = target.cfg, target.tok_embeddings.weight
        self.model = target
        # The target pool's layout for one layer: GQA keys and values, or MLA's latent alone (no v).
        self.k_pool = torch.zeros(1, *pool.k.shape[1:], dtype=w.dtype, device=w.device)
        self.v_pool = None if pool.v is None else torch.zeros(1, *pool.v.shape[1:], dtype=w.dtype, device=w.device)
        context = -(-(max_context + k) // pool.block_size) * pool.block_size  # as the target runner's
        self.cache = PagedCache(self.k_pool, self.v_pool, max_rows, context, max_tokens_per_row=k + 1)  # accepted: n + 1 <= k + 1 per row
        self._layers = _MTPLayers(self.cache, cfg.n_layers)
        self.h = torch.zeros(max_rows, cfg.dim, dtype=w.dtype, device=w.device)  # h_{p-1} per row
        # The next step's first draft per row, run by ``accepted``: its logits and MTP output.
        self.first_logits = torch.zeros(max_rows, cfg.vocab_size, dtype=w.dtype, device=w.device)
        self.first_h = torch.zeros(max_rows, cfg.dim, dtype=w.dtype, device=w.device)
        self.first_ready = np.zeros(max_rows, dtype=bool)
        self._max_pos = cfg.max_seq_len - 1
        self.fast = FastMTPStep(target, 1, self.cache) if self.fast and FastMTPStep.supports(target) else None

    @property
    def nbytes(self) -> int:
        if self.cache is None:
            return 0
        c = self.cache
        own = sum(t.nbytes for t in (self.k_pool, self.v_pool, self.h, self.first_logits, self.first_h, c.slots,
                                     c.gather, c.bias) if t is not None)
        return own + (self.fast.nbytes if self.fast is not None else 0)

    def _step(self, h: torch.Tensor, tokens: torch.Tensor, positions: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        """MTP depth 1 on (B, T) inputs at ``positions`` (B, T), the cache already set."""
        pos = torch.from_numpy(np.minimum(positions, self._max_pos)).to(tokens.device)
        return self.model.mtp_step(1, h, tokens, pos, self._layers)

    def _layout(self, index: np.ndarray, last: np.ndarray) -> None:
        """gather / bias: each row's first S slots, valid through position ``last[b]``."""
        B, S = index.shape
        self.cache.gather[:B * S].copy_(torch.from_numpy(np.ascontiguousarray(index).reshape(-1)))
        bias = np.where(np.arange(S)[None, :] <= last[:, None], 0.0, -np.inf).reshape(-1)
        self.cache.bias[:B * S].copy_(torch.from_numpy(bias))

    def _fast_step(self, B: int, S: int, tokens: torch.Tensor, u: np.ndarray) -> torch.Tensor:
        """One draft on the allocation-free step; its ``x`` carries the module's output on."""
        self.fast.tokens[:B].copy_(tokens)
        self.fast.positions[:B].copy_(torch.from_numpy(np.minimum(u, self._max_pos)))
        return self.fast.step(B, S)

    @torch.no_grad()
    def prefill(self, tokens: torch.Tensor, slots: torch.Tensor, row: int, hidden: torch.Tensor | None = None) -> None:
        """The prompt's MTP entries: position t (0..T-2) on (h_t, token t+1); keeps h_{T-1}."""
        T = tokens.shape[0]
        self.h[row] = hidden[T - 1]
        self.first_ready[row] = False
        if T > 1:
            self.cache.set_prefill(slots[:T - 1])
            self._step(hidden[None, :T - 1], tokens[None, 1:], np.arange(T - 1))

    @torch.no_grad()
    def propose(self, batch: DraftBatch, k: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        B, S = batch.index.shape
        greedy = all(p.greedy for p in batch.params)
        rows = np.arange(B)
        h, tokens, drafts, qs = self.h[:B, None], batch.tokens, [], []
        ready = bool(self.first_ready[:B].all())  # every row's first draft ran in ``accepted``
        if self.fast is not None:
            # depth 1's input: the target's h_{p-1}, or the pending first draft's output
            self.fast.x[:B].copy_(self.first_h[:B] if ready else self.h[:B])
        elif ready:
            h = self.first_h[:B, None]
        for j in range(k):
            if j == 0 and ready:
                logits = self.first_logits[:B]
            else:
                u = batch.positions - 1 + j  # this draft's MTP position; its slot is the target's for u
                slot = batch.index[rows, u] if j == 0 else batch.slots[:, j - 1]
                self.cache.slots[:B].copy_(torch.from_numpy(np.ascontiguousarray(slot)))
                self._layout(batch.index, u)
                self.cache.set_decode(B, S)
                if self.fast is not None:
                    logits = self._fast_step(B, S, tokens, u)
                else:
                    logits, h = self._step(h, tokens[:, None], u[:, None])
                    logits = logits[:, 0]
            tokens = pick_draft(logits, batch, greedy, qs)
            drafts.append(tokens)
        self.first_ready[:B] = False
        return torch.stack(drafts, 1), torch.stack(qs, 1) if qs else None

    @torch.no_grad()
    def accepted(self, batch: DraftBatch, draft: torch.Tensor, n_accepted: torch.Tensor) -> None:
        """Exact entries for the accepted positions p..p+n-1 (the verification forward's h at
        p+i with draft i+1) and the next step's first draft at p+n (h_{p+n} with the next input
        token), one T = max(n) + 1 forward for all rows; a row that kept fewer writes entries
        past its own, which are rewritten before they are read. Keeps h_{p+n}, and the first
        draft's logits and output for ``propose``."""
        hidden = batch.hidden  # (B, k+1, dim): the target's h at positions p..p+k
        B, S = batch.index.shape
        T = int(n_accepted.max()) + 1
        rows = torch.arange(B, device=hidden.device)
        # Row b's tokens: its accepted drafts, then its next input at column n_b (the columns
        # after it are padding, written into slots the row still holds and rewritten later).
        tokens = torch.cat([draft, draft[:, -1:]], 1)[:, :T].clone()
        tokens[rows, n_accepted] = batch.next_tokens
        self.cache.slots[:B * T].copy_(torch.from_numpy(np.ascontiguousarray(batch.slots[:, :T]).reshape(-1)))
        self._layout(batch.index, batch.positions + T - 1)  # the T new entries are each row's last valid
        self.cache.set_verify(B, T, S)
        logits, h = self._step(hidden[:, :T], tokens, batch.positions[:, None] + np.arange(T))
        self.h[:B] = hidden[rows, n_accepted]
        self.first_logits[:B] = logits[rows, n_accepted]
        self.first_h[:B] = h[rows, n_accepted]
        self.first_ready[:B] = True

    def move_row(self, src: int, dst: int) -> None:
        self.h[dst] = self.h[src]
        self.first_logits[dst], self.first_h[dst] = self.first_logits[src], self.first_h[src]
        self.first_ready[dst] = self.first_ready[src]
