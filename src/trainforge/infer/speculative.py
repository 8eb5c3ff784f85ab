"""Drafters for speculative decoding, and the ``--speculative`` option.

Each speculative step of the engine (``speculative_step.SpeculativeStep``):

1. the engine hands every running row k + 1 slots (positions p..p+k) in the paged pool;
2. the drafter proposes k tokens per row (``Drafter.propose``) and, for sampled rows, the
   distributions q it drew them from;
3. the target scores the last accepted token and the k drafts in ONE forward of its own
   ``forward`` (``ModelRunner.verify``, ``PagedCache.set_verify``);
4. ``speculative_sampling.accept`` keeps a prefix of each row's drafts and draws one more
   token (rows accept different numbers);
5. the drafter hears what was accepted (``Drafter.accepted``), then the engine rolls each
   row back to its accepted length (``KVPool.truncate``: pages past it go back to the pool).

A drafter's own cache uses the *target's page tables*: ``DraftModelDrafter`` keeps its keys
and values in a pool of its own tensors laid out over the same slots, so the engine's block
bookkeeping (admission, growth, rollback, freeing) covers both models and the drafter holds
no per-row state. (vLLM's draft-model runner shares block tables the same way.)

``MTPDrafter`` (``mtp_drafter.py``: DeepSeek-V3's multi-token-prediction module drafting for
its own model) keeps per-row state and reads the target's hidden states (``wants_hidden``).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from trainforge.infer.kv_pool import KVPool
from trainforge.infer.runner import ModelRunner
from trainforge.infer.sampling import SamplingParams
from trainforge.infer.speculative_sampling import draw, filtered_probs
from trainforge.model.llama import Transformer

MODES = ("draft:CHECKPOINT", "mtp")


def parse_speculative(value: str) -> tuple[str, str | None]:
    """``--speculative`` -> ("draft", checkpoint) or ("mtp", None); ValueError naming the fix."""
    if value.startswith("draft:") and value[len("draft:"):].strip():
        return "draft", value[len("draft:"):].strip()
    if value == "mtp":
        return "mtp", None
    raise ValueError(f"--speculative {value!r}: give one of {', '.join(MODES)} (e.g. draft:runs/tiny)")


def check_num_speculative_tokens(k: int) -> None:
    if not isinstance(k, int) or k < 1:
        raise ValueError(f"--num_speculative_tokens {k}: must be an integer >= 1 (drafted tokens per step)")


@dataclass
class DraftBatch:
    """One speculative step as a drafter sees it: rows 0..B-1 of the engine's batch."""

    tokens: torch.Tensor  # (B,) each row's last accepted token, in no cache yet (device)
    positions: np.ndarray  # (B,) its position p
    slots: np.ndarray  # (B, k+1) pool slots of positions p..p+k (the target's page tables)
    index: np.ndarray  # (B, S) slot of each row's token t for t < S (S a multiple of the block size)
    params: list[SamplingParams]  # each row's sampling options (temperature, top-k, top-p)
    gens: list[torch.Generator | None]  # each row's generator (None for greedy rows)
    hidden: torch.Tensor | None = None  # (B, k+1, dim) the verify forward's last hidden states, for ``accepted``
    next_tokens: torch.Tensor | None = None  # (B,) each row's next step input (after its accepted drafts), ditto


class SpecStats:
    """The engine's speculation counters: row-steps verified, drafts proposed and accepted,
    and accepted drafts per position."""

    def __init__(self, k: int):
        self.k, self.row_steps, self.accepted = k, 0, 0
        self.accepted_at = np.zeros(k, dtype=np.int64)

    def add(self, n_accepted: int) -> None:
        """One row verified k drafts and kept the first ``n_accepted``."""
        self.row_steps += 1
        self.accepted += n_accepted
        self.accepted_at[:n_accepted] += 1

    def as_dict(self, drafter: Drafter) -> dict:
        """``spec_acceptance_rate[j]``: share of row-steps whose draft j + 1 was accepted;
        ``spec_mean_accepted_length``: tokens emitted per row per verification forward
        (accepted drafts + the target's own token)."""
        steps = max(self.row_steps, 1)
        return {"spec_drafted_tokens": self.k * self.row_steps, "spec_accepted_tokens": self.accepted,
                "spec_acceptance_rate": (self.accepted_at / steps).tolist(),
                "spec_mean_accepted_length": (self.accepted + self.row_steps) / steps if self.row_steps else 0.0,
                "spec_num_tokens": self.k, "draft_bytes": drafter.nbytes}


class Drafter:
    """What the engine needs of a drafter. ``build`` is called once by the engine (the target
    model, its pool, the engine's sizes and k: a drafter sizes its own buffers); ``prefill``
    when a request joins (its prompt, at the slots the pool gave it); ``propose`` and
    ``accepted`` once per step; ``move_row`` when batch compaction moves a row. A drafter with
    ``wants_hidden`` gets the target's last hidden states (before the final norm): the prompt's
    in ``prefill``, the verification forward's in ``DraftBatch.hidden``."""

    wants_hidden = False

    def build(self, target: Transformer, pool: KVPool, max_rows: int, max_context: int, k: int) -> None:
        raise NotImplementedError

    def prefill(self, tokens: torch.Tensor, slots: torch.Tensor, row: int, hidden: torch.Tensor | None = None) -> None:
        """A request joins batch row ``row``: its prompt (T,) at ``slots`` (T,); ``hidden`` (T, dim)."""
        raise NotImplementedError

    def propose(self, batch: DraftBatch, k: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """k draft tokens per row (B, k) and the float32 distributions (B, k, V) they were
        drawn from, after the row's temperature / top-k / top-p (one-hot for greedy rows);
        None instead of the distributions when every row is greedy (argmax drafts)."""
        raise NotImplementedError

    def accepted(self, batch: DraftBatch, draft: torch.Tensor, n_accepted: torch.Tensor) -> None:
        """Row b kept ``draft[b, :n_accepted[b]]``; called before the engine rolls the rows back."""

    def move_row(self, src: int, dst: int) -> None:
        """Row ``src``'s request now sits in row ``dst`` (for drafters with per-row state)."""

    def clear_row(self, row: int) -> None:
        """``row`` holds no request any more (a drafter is a row-state participant: row_state.py)."""

    @property
    def nbytes(self) -> int:
        return 0


def pick_draft(logits: torch.Tensor, batch: DraftBatch, greedy: bool, qs: list[torch.Tensor]) -> torch.Tensor:
    """Each row's next draft from the drafter's logits (B, V): the argmax when every row is
    greedy, else a draw from the filtered distribution, which is appended to ``qs`` for the
    acceptance rule."""
    if greedy:
        return logits.argmax(-1)
    q = filtered_probs(logits[:, None], batch.params)[:, 0]  # (B, V)
    qs.append(q)
    return draw(q, batch.params, batch.gens)


class DraftModelDrafter(Drafter):
    """A smaller model sharing the target's tokenizer drafts k tokens, one decode step each
    (its runner: the allocation-free float32 step where the model has one). Its keys/values
    live in a pool of its own shape over the target pool's slots."""

    def __init__(self, model: Transformer):
        self.model = model
        self.runner: ModelRunner | None = None

    def build(self, target: Transformer, pool: KVPool, max_rows: int, max_context: int, k: int) -> None:
        cfg, target_cfg = self.model.cfg, target.cfg
        if cfg.vocab_size != target_cfg.vocab_size:
            raise ValueError(f"--speculative draft: the draft model's vocab_size {cfg.vocab_size} differs from the "
                             f"target's {target_cfg.vocab_size}; the draft must share the target's tokenizer")
        if cfg.max_seq_len < max_context:
            raise ValueError(f"--speculative draft: the draft model's max_seq_len {cfg.max_seq_len} is shorter than "
                             f"the engine's max_context {max_context}; lower --max_context")
        w = self.model.norm.weight  # the float dtype: a quantised embedding's weight is its codes
        own = KVPool.for_model(cfg, pool.n_blocks, pool.block_size, w.dtype, w.device)
        self.runner = ModelRunner(self.model, own, max_rows, max_context, lookahead=k)
        self._max_pos = cfg.max_seq_len - 1

    @property
    def nbytes(self) -> int:
        return self.runner.pool.nbytes + self.runner.workspace_bytes if self.runner is not None else 0

    def prefill(self, tokens: torch.Tensor, slots: torch.Tensor, row: int, hidden: torch.Tensor | None = None) -> None:
        self.runner.prefill(tokens, slots)

    def _step(self, batch: DraftBatch, j: int, tokens: torch.Tensor) -> torch.Tensor:
        """One decode step of the draft on ``tokens`` (B,) at positions p + j; logits (B, V)."""
        run = self.runner
        B, S = batch.index.shape
        pos = batch.positions + j
        run.tokens[:B].copy_(tokens)
        # Past max_seq_len a token is beyond every request's budget (its draft is never
        # emitted); clamping only keeps the rotary lookup in range.
        run.positions[:B].copy_(torch.from_numpy(np.minimum(pos, self._max_pos)))
        run.slots[:B].copy_(torch.from_numpy(np.ascontiguousarray(batch.slots[:, j])))
        bias = np.where(np.arange(S)[None, :] <= pos[:, None], 0.0, -np.inf)  # context 0..p+j
        run.bias[:B * S].copy_(torch.from_numpy(bias.reshape(-1)))
        return run.decode(B, S)

    @torch.no_grad()
    def propose(self, batch: DraftBatch, k: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        B, S = batch.index.shape
        self.runner.gather[:B * S].copy_(torch.from_numpy(np.ascontiguousarray(batch.index).reshape(-1)))
        greedy = all(p.greedy for p in batch.params)
        tokens, drafts, qs = batch.tokens, [], []
        for j in range(k):
            logits = self._step(batch, j, tokens)
            tokens = pick_draft(logits, batch, greedy, qs)
            drafts.append(tokens)
        return torch.stack(drafts, 1), torch.stack(qs, 1) if qs else None

    @torch.no_grad()
    def accepted(self, batch: DraftBatch, draft: torch.Tensor, n_accepted: torch.Tensor) -> None:
        # propose() stored the keys/values of the last accepted token and drafts 1..k-1; a row
        # that kept all k drafts continues after draft k, whose keys/values are still missing.
        # (Rows that kept fewer write a slot the engine's rollback drops.)
        k = draft.shape[1]
        if bool((n_accepted == k).any()):
            self._step(batch, k, draft[:, -1])


# ``MTPDrafter`` (mtp_drafter.py): the target's own MTP module drafts (``--speculative mtp``).
