"""Sampling for a batch of sequences, each with its own parameters, without a host sync.

``SamplingParams`` is what a request asks for. ``BatchSampler`` turns a (rows, vocab)
block of logits into next tokens on the device. Row parameters sit in device tensors
written when a request joins, so a step launches the same few kernels whatever the mix of
requests, and every buffer is allocated once (``out=`` and in-place ops only).

Order, as in Hugging Face's ``generate``: repetition penalty (over prompt and generated
tokens), greedy argmax for temperature-0 rows, then temperature, top-k, top-p, and a draw.
The draw is the exponential race ``argmax(p / E)`` with ``E ~ Exp(1)`` (what gpt-fast
does; equivalent to sampling from ``p``), with ``E`` drawn from a per-request
``torch.Generator``, so a seed reproduces a request's tokens whatever else shares its batch.

Log-probabilities (``SamplingParams.logprobs``) are the model's raw ``log_softmax`` of the
logits, taken before the repetition penalty, temperature, top-k and top-p, as vLLM reports
them by default (``logprobs_mode="raw_logprobs"``) and OpenAI documents them: the same
numbers whatever the sampling settings, comparable across requests.
"""

from __future__ import annotations

import math
import secrets
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class SamplingParams:
    max_new_tokens: int = 64
    temperature: float = 1.0  # 0 = greedy
    top_k: int = 0  # 0 = off
    top_p: float = 1.0  # 1 = off
    repetition_penalty: float = 1.0  # 1 = off; > 1 discourages tokens already in the sequence
    stop: tuple[str, ...] = ()  # stop strings: the output ends before the first one
    stop_token_ids: tuple[int, ...] = ()  # besides the tokenizer's end-of-text id
    ignore_eos: bool = False
    seed: int | None = None  # None = a fresh random seed per request
    logprobs: int | None = None  # None = off; k >= 0: the sampled token's logprob and the k most likely

    MAX_LOGPROBS = 20  # OpenAI's bound on top_logprobs
    # torch.Generator.manual_seed takes [-2^63, 2^64); outside it raises in the engine thread.
    SEED_RANGE = (-(1 << 63), (1 << 64) - 1)

    def validate(self) -> None:
        """Raise ``ValueError`` naming the bad field and the allowed range."""
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens={self.max_new_tokens}: must be >= 1")
        if not (self.temperature >= 0 and math.isfinite(self.temperature)):
            raise ValueError(f"temperature={self.temperature}: must be a finite number >= 0 (0 = greedy)")
        if self.top_k < 0:
            raise ValueError(f"top_k={self.top_k}: must be >= 0 (0 = off)")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p={self.top_p}: must be in (0, 1]")
        if not (self.repetition_penalty > 0 and math.isfinite(self.repetition_penalty)):
            raise ValueError(f"repetition_penalty={self.repetition_penalty}: must be a finite number > 0 (1 = off)")
        lo, hi = self.SEED_RANGE
        if self.seed is not None and not lo <= self.seed <= hi:
            raise ValueError(f"seed={self.seed}: must be in [{lo}, {hi}] (a 64-bit integer)")
        if self.logprobs is not None and not 0 <= self.logprobs <= self.MAX_LOGPROBS:
            raise ValueError(f"logprobs={self.logprobs}: must be in [0, {self.MAX_LOGPROBS}]")
        if any(not s for s in self.stop):
            raise ValueError("stop: stop strings must be non-empty")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


@dataclass
class Logprobs:
    """One step's log-probabilities on the device: chosen (n,), top_ids / top (n, k)."""

    chosen: torch.Tensor
    top_ids: torch.Tensor
    top: torch.Tensor

    def to_host(self, ks: list[int | None]) -> list:
        """Per row: None, or (logprob of the sampled token, [(id, logprob)] its first k)."""
        chosen, ids, top = self.chosen.tolist(), self.top_ids.tolist(), self.top.tolist()
        return [None if k is None else (chosen[r], list(zip(ids[r][:k], top[r][:k]))) for r, k in enumerate(ks)]


class BatchSampler:
    """Per-row sampling state for up to ``max_rows`` rows of a (rows, vocab) logits block.

    ``set_row`` / ``move_row`` / ``clear_row`` change a row's parameters (at join, batch
    compaction and leave); ``sample`` runs one step. ``sample`` mutates the logits it is
    given (the runner's buffer, rewritten every step anyway)."""

    def __init__(self, max_rows: int, vocab_size: int, device: str | torch.device = "cpu"):
        self.max_rows, self.vocab_size, self.device = max_rows, vocab_size, torch.device(device)
        R, V = max_rows, vocab_size
        f32 = dict(dtype=torch.float32, device=device)
        self.temperature = torch.ones(R, 1, **f32)
        self.top_p = torch.full((R, 1), 2.0, **f32)  # 2 = off: the mass before a token never reaches it
        self.top_k_index = torch.zeros(R, 1, dtype=torch.long, device=device)  # k - 1
        self.top_k_off = torch.ones(R, 1, dtype=torch.bool, device=device)
        self.penalty = torch.ones(R, 1, **f32)
        self.inv_penalty = torch.ones(R, 1, **f32)
        self.greedy = torch.ones(R, dtype=torch.bool, device=device)
        self.unseen = torch.ones(R, V, dtype=torch.bool, device=device)  # tokens not yet in the sequence
        # Work buffers: (R, V) each, so no step allocates.
        self._probs = torch.empty(R, V, **f32)
        self._noise = torch.ones(R, V, **f32)
        self._mask = torch.empty(R, V, dtype=torch.bool, device=device)
        self._mask_sorted = torch.empty(R, V, dtype=torch.bool, device=device)
        self._factor = torch.empty(R, V, **f32)
        self._sorted = torch.empty(R, V, **f32)
        self._sorted_idx = torch.empty(R, V, dtype=torch.long, device=device)
        self._topk_vals = torch.empty(R * V, **f32)
        self._topk_idx = torch.empty(R * V, dtype=torch.long, device=device)
        self._kth = torch.empty(R, 1, **f32)
        self._greedy_tok = torch.empty(R, dtype=torch.long, device=device)
        self._sampled_tok = torch.empty(R, dtype=torch.long, device=device)
        self._zero = torch.zeros((), **f32)
        self._neg_inf = torch.full((), float("-inf"), **f32)
        self._params: list[SamplingParams | None] = [None] * R
        self._gens: list[torch.Generator | None] = [None] * R

    # -- rows -------------------------------------------------------------------------------

    def set_row(self, row: int, params: SamplingParams, prompt_ids: list[int]) -> None:
        """Give ``row`` the parameters of a joining request (``prompt_ids`` seed the
        repetition penalty, as in HF)."""
        self._params[row] = params
        self.greedy[row] = params.greedy
        self.temperature[row] = 1.0 if params.greedy else params.temperature
        k = 0 if params.greedy else min(params.top_k, self.vocab_size)  # greedy rows skip the filters
        self.top_k_off[row] = k == 0
        self.top_k_index[row] = max(k - 1, 0)
        self.top_p[row] = params.top_p if params.top_p < 1.0 else 2.0
        self.penalty[row] = params.repetition_penalty
        self.inv_penalty[row] = 1.0 / params.repetition_penalty
        if params.repetition_penalty != 1.0:
            self.unseen[row].fill_(True)
            if prompt_ids:
                self.unseen[row, torch.tensor(prompt_ids, device=self.device)] = False
        gen = None
        if not params.greedy:
            seed = params.seed if params.seed is not None else secrets.randbits(62)
            gen = torch.Generator(device=self.device).manual_seed(seed)
        self._gens[row] = gen

    def move_row(self, src: int, dst: int) -> None:
        """Copy row ``src``'s state to ``dst`` (batch compaction); ``src`` is then free."""
        for t in (self.temperature, self.top_p, self.top_k_index, self.top_k_off, self.penalty, self.inv_penalty,
                  self.greedy):
            t[dst] = t[src]
        if self._params[src] is not None and self._params[src].repetition_penalty != 1.0:
            self.unseen[dst].copy_(self.unseen[src])
        self._params[dst], self._gens[dst] = self._params[src], self._gens[src]
        self.clear_row(src)

    def rows(self, n: int) -> tuple[list[SamplingParams], list[torch.Generator | None]]:
        """The parameters and generators of rows 0..n-1 (speculative decoding draws with them)."""
        return list(self._params[:n]), list(self._gens[:n])

    def clear_row(self, row: int) -> None:
        self._params[row], self._gens[row] = None, None

    # -- one step ---------------------------------------------------------------------------

    def sample(self, logits: torch.Tensor, row0: int, out: torch.Tensor) -> "Logprobs | None":
        """logits: (n, V), rows ``row0 .. row0 + n - 1``; writes n token ids into ``out`` (n,).
        Returns None, or when a row asks for logprobs, device tensors for all n rows: the
        sampled tokens' logprobs (n,) and the top-k ids and logprobs (n, k), k the largest
        asked for (rows that asked for fewer use their first ones). No host sync."""
        n = logits.shape[0]
        rows = slice(row0, row0 + n)
        params = self._params[rows]
        if any(p is None for p in params):
            raise RuntimeError(f"sampling rows {row0}..{row0 + n - 1} with a row that has no request")
        k = max((p.logprobs for p in params if p.logprobs is not None), default=None)
        raw = None if k is None else torch.log_softmax(logits.float(), dim=-1)  # before sampling mutates logits
        penalised = any(p.repetition_penalty != 1.0 for p in params)
        if penalised:
            # HF: a seen token's logit is divided by the penalty when positive, multiplied when negative.
            neg, factor = self._mask[rows], self._factor[rows]
            torch.lt(logits, self._zero, out=neg)
            torch.where(neg, self.penalty[rows], self.inv_penalty[rows], out=factor)
            factor.masked_fill_(self.unseen[rows], 1.0)
            logits.mul_(factor)
        n_greedy = sum(p.greedy for p in params)
        if n_greedy == n:
            torch.argmax(logits, dim=-1, out=out)
        else:
            if n_greedy:
                torch.argmax(logits, dim=-1, out=self._greedy_tok[rows])
            self._filter_and_draw(logits, rows, params)
            if n_greedy:
                torch.where(self.greedy[rows], self._greedy_tok[rows], self._sampled_tok[rows], out=out)
            else:
                out.copy_(self._sampled_tok[rows])
        if penalised:
            self.unseen[rows].scatter_(1, out.unsqueeze(1), False)
        if raw is None:
            return None
        top_lp, top_ids = raw.topk(k, dim=-1) if k else (raw[:, :0], out[:, None][:, :0])
        return Logprobs(raw.gather(1, out[:, None]).squeeze(1), top_ids, top_lp)

    def _filter_and_draw(self, logits: torch.Tensor, rows: slice, params: list[SamplingParams]) -> None:
        n, V = logits.shape
        logits.div_(self.temperature[rows])
        sampled = [p for p in params if not p.greedy]
        k_max = max(min(p.top_k, V) for p in sampled)
        if k_max:
            vals = self._topk_vals[:n * k_max].view(n, k_max)
            torch.topk(logits, k_max, dim=-1, out=(vals, self._topk_idx[:n * k_max].view(n, k_max)))
            kth = self._kth[rows]
            torch.gather(vals, 1, self.top_k_index[rows], out=kth)
            kth.masked_fill_(self.top_k_off[rows], float("-inf"))
            mask = self._mask[rows]
            torch.lt(logits, kth, out=mask)
            logits.masked_fill_(mask, float("-inf"))
        if any(p.top_p < 1.0 for p in sampled):
            srt, idx, probs = self._sorted[rows], self._sorted_idx[rows], self._probs[rows]
            torch.sort(logits, dim=-1, descending=True, out=(srt, idx))
            torch.ops.aten._softmax.out(srt, -1, False, out=probs)
            cum = self._factor[rows]
            torch.cumsum(probs, dim=-1, out=cum)
            cum.sub_(probs)  # probability mass before each token
            # Drop a token once the mass before it reaches top_p (the top token always stays).
            drop_sorted = self._mask_sorted[rows]
            torch.ge(cum, self.top_p[rows], out=drop_sorted)
            drop = self._mask[rows]
            drop.scatter_(1, idx, drop_sorted)
            logits.masked_fill_(drop, float("-inf"))
        probs, noise = self._probs[rows], self._noise[rows]
        torch.ops.aten._softmax.out(logits, -1, False, out=probs)
        for i, p in enumerate(params):
            if not p.greedy:
                noise[i].exponential_(1.0, generator=self._gens[rows.start + i])
        probs.div_(noise)
        torch.argmax(probs, dim=-1, out=self._sampled_tok[rows])
