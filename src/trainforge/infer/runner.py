"""Drives the model's own forward over a paged KV pool: prefill and batched decode.

Nothing here computes a layer: the runner wraps the pool's tensors in a ``PagedCache``
(``model/attention_cache.py``) and calls the model.

- ``prefill(tokens, slots)``: one sequence's prompt, T tokens at once:
  ``model(tokens, positions=0..T-1, cache)`` with the cache set to store keys/values at
  ``slots`` (the prompt attends to itself). Allocates freely (once per request). A prompt of
  at most ``FAST_PREFILL_TOKENS`` runs instead as T one-token rows of the fast decode step
  (row j: token j at position j, attending to the prompt's slots up to its own), as
  ``verify`` does, in a workspace of its own that projects only the last row: the plain
  forward's Python dispatch cost a 1-token prompt as much as ~5 decode steps, and its ATen ops
  (sdpa, rope's cat, the norm's reductions, ...) are used nowhere else in a CPU decode
  process, whose peak RSS each raised by ~0.3-1 MiB of libtorch code pages mapped on first
  use (4.1 MiB on the 90m q4_0 model: docs/benchmarks-archive.md, issue 24). That workspace is sized by the
  first short prompt (the next power of two rows) and grows with a longer one.
- ``prefill_packed(tokens, slots, lengths)``: several prompts in one forward, concatenated
  into one row of sum(T_i) tokens, prompt i at positions 0..T_i-1 and attending to itself
  only (``PagedCache.set_packed_prefill``); returns each prompt's last logits. The matrix
  products then run on hundreds of rows rather than tens, and the Python dispatch of one
  forward is paid once (the engine's step 2 has the figures). Not for hourglass or
  latent-attention models (their caches prefill one prompt at a time).
- ``decode(B, S)``: one token for each of B sequences of different lengths. Inputs are
  buffers the engine fills: ``tokens``, ``positions`` and the cache's ``slots``, ``gather``,
  ``bias`` (each row's first S slots and its mask). The step is the model's
  allocation-free decode path (``model/fast_decode.py``: each module's ``decode_calls``,
  no allocation in float32), or, for a model whose modules have none (latent attention's
  absorbed form, ``model/mla.py``, has none), its plain forward on (B, 1) tokens with the
  same cache.
- ``verify(tokens, positions, S)``: speculative decoding's verification, T tokens for each of
  B rows in one forward; the runner's ``slots`` then hold B * T slots. Built with
  ``lookahead = k`` so a row's context has room for its k drafts. Where the model has the
  fast decode step, the B * T tokens run as B * T one-token rows of it (row b's token j
  attends to row b's context up to itself, its own gather and mask; the keys/values of a
  layer are all written before any row reads them), in a second workspace of
  ``max_rows * (k + 1)`` rows: the plain forward costs ~2x a fast step on small models
  (Python dispatch), which made speculation slower than plain decoding. Else the plain
  forward (``PagedCache.set_verify``).
- ``compile()``: ``torch.compile`` of that same forward at one static shape.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import numpy as np
import torch
from torch.profiler import ProfilerActivity, profile

from trainforge.infer.cpu_kernels.decode_ops import decode_kernels
from trainforge.infer.kv_pool import KVPool
from trainforge.model.attention_cache import PagedCache
from trainforge.model.fast_decode import FastDecoder
from trainforge.model.llama import Transformer

if TYPE_CHECKING:
    from trainforge.infer.hourglass_pools import HourglassPools


class ModelRunner:
    """Forward passes of ``model`` over ``pool`` for up to ``max_rows`` sequences of up to
    ``max_context`` tokens each. Does not modify the model."""

    FAST_PREFILL_TOKENS = 16  # prompts up to this long prefill through the fast step (module docstring)

    def __init__(self, model: Transformer, pool: KVPool, max_rows: int, max_context: int, lookahead: int = 0):
        cfg = model.cfg
        if max_context > cfg.max_seq_len:
            raise ValueError(f"max_context={max_context} exceeds the model's max_seq_len={cfg.max_seq_len}")
        self.model, self.pool, self.cfg = model, pool, cfg
        self.max_rows, self.max_context = max_rows, max_context
        # Gathers cover whole blocks, so the context in slots is max_context rounded up; a
        # speculative engine's rows hold up to ``lookahead`` draft tokens past it.
        self.context_slots = -(-(max_context + lookahead) // pool.block_size) * pool.block_size
        self.device = model.tok_embeddings.weight.device
        self.cache = PagedCache(pool.k, pool.v, max_rows, self.context_slots, max_tokens_per_row=lookahead + 1)
        # What the model attends through: the paged cache, or for an hourglass model the
        # HourglassCache around it and the shortened depths' pools (hourglass_pools.py).
        self.hourglass: HourglassPools | None = None
        self.model_cache = self.cache
        if cfg.is_hourglass:  # imported here: a Llama's decode process never maps the hourglass code
            from trainforge.infer.hourglass_pools import HourglassPools

            self.hourglass = HourglassPools(cfg, self.cache, max_rows, max_context, pool.n_blocks, pool.block_size,
                                            pool.k.dtype, self.device)
            self.model_cache = self.hourglass.cache
        # Decode inputs, filled by the engine (host views of these on CPU).
        self.tokens = torch.zeros(max_rows, dtype=torch.long, device=self.device)
        self.positions = torch.zeros(max_rows, dtype=torch.long, device=self.device)
        self.slots, self.gather, self.bias = self.cache.slots, self.cache.gather, self.cache.bias
        kernels = decode_kernels(model)
        self.decoder = FastDecoder(model, self.cache, self.tokens, self.positions, kernels) \
            if FastDecoder.supports(model) else None
        if self.hourglass is not None:
            from trainforge.model.hourglass_decode import HourglassDecoder

            if HourglassDecoder.supports(model):
                self.decoder = HourglassDecoder(model, self.hourglass.cache, self.tokens, self.positions, kernels)
        self._verifier: FastDecoder | None = None  # the fast verification step (module docstring)
        if lookahead and self.decoder is not None:
            n = max_rows * (lookahead + 1)
            self._verifier = self._one_token_rows(n, self.context_slots, torch.zeros(n, dtype=torch.long,
                                                                                     device=self.device), kernels)
        # Short prompts (module docstring): up to ``_prefill_rows`` tokens; the step is built by
        # the first one (``_prompt_step``).
        self._prefiller: FastDecoder | None = None
        self._prefill_rows = min(self.FAST_PREFILL_TOKENS, max_context) \
            if self.hourglass is None and isinstance(self.decoder, FastDecoder) else 0
        self._kernels = kernels
        self._compiled = None
        self.compile_s: float | None = None
        self.static_shape: tuple[int, int] | None = None  # (rows, context) the compiled step runs at

    def _one_token_rows(self, rows: int, context_slots: int, positions: torch.Tensor, kernels,
                        **kw) -> FastDecoder:
        """A fast step of its own over ``rows`` one-token rows (verification, short prompts): its
        own cache metadata and tokens over the same pool, the decoder's rope tables shared."""
        cache = PagedCache(self.pool.k, self.pool.v, rows, context_slots)
        tokens = torch.zeros(rows, dtype=torch.long, device=self.device)
        rope = (self.decoder.rope_cos, self.decoder.rope_sin) if isinstance(self.decoder, FastDecoder) else None
        return FastDecoder(self.model, cache, tokens, positions, kernels, rope=rope, **kw)

    @property
    def workspace_bytes(self) -> int:
        own = sum(t.nbytes for t in (self.tokens, self.positions, self.slots, self.gather, self.bias))
        for step in (self._verifier, self._prefiller):
            if step is not None:
                c = step.cache
                own += step.nbytes + sum(t.nbytes for t in (step.tokens, step.positions, c.slots, c.gather, c.bias))
        own += self.hourglass.cache.nbytes if self.hourglass is not None else 0
        return own + (self.decoder.nbytes if self.decoder is not None else 0)

    # -- decode -----------------------------------------------------------------------------

    @torch.no_grad()
    def decode(self, B: int, S: int) -> torch.Tensor:
        """One token for rows 0..B-1 (inputs in ``tokens``, ``positions``, ``slots``, and
        ``gather`` / ``bias`` laid out (B, S), or ``static_shape`` once compiled); returns
        logits (B, V), a workspace view (a fresh tensor off the fast path)."""
        if not 0 < B <= self.max_rows or not 0 < S <= self.context_slots:
            raise ValueError(f"decode(B={B}, S={S}) outside the workspace ({self.max_rows} x {self.context_slots})")
        if self._compiled is not None:  # inputs are laid out for the static shape
            return self._compiled(*self.static_shape)[:B]
        if self.decoder is not None:
            return self.decoder.step(B, S)
        return self._forward_decode(B, S)

    def _forward_decode(self, B: int, S: int) -> torch.Tensor:
        """The model's plain forward on one token per row, attending through the paged cache."""
        self.cache.set_decode(B, S)
        return self.model(self.tokens[:B, None], self.positions[:B, None], self.model_cache)[:, 0]

    @torch.no_grad()
    def verify(self, tokens: torch.Tensor, positions: torch.Tensor, S: int, hidden: bool = False):
        """tokens, positions: (B, T), the T consecutive tokens of each row (``slots`` holds
        their B * T slots, ``gather`` / ``bias`` each row's first S slots, the new ones
        included); returns logits (B, T, V), or (logits, h) with ``hidden``: h (B, T, dim) the
        last block's output (an MTP drafter's input). The fast step where the runner has one
        (workspace views, valid until the next verify), else the plain forward."""
        if self._verifier is None:
            return self.verify_forward(tokens, positions, S, hidden)
        B, T = tokens.shape
        n, c = B * T, self._verifier.cache
        if n > c.max_rows:
            raise ValueError(f"verify of {B} x {T} tokens exceeds the runner's {c.max_rows} rows (lookahead)")
        self._verifier.tokens[:n].copy_(tokens.reshape(-1))
        self._verifier.positions[:n].copy_(positions.reshape(-1))
        c.slots[:n].copy_(self.slots[:n])  # row-major, as the rows below
        c.gather[:n * S].view(B, T, S).copy_(self.gather[:B * S].view(B, 1, S).expand(B, T, S))
        bias = self.bias[:B * S].view(B, 1, S)
        # Row b's T new tokens are its last T valid slots: token j sees slots up to valid - T + j.
        limit = (bias == 0).sum(-1, keepdim=True) - T + torch.arange(T, device=bias.device).view(1, T, 1)
        seen = torch.arange(S, device=bias.device).view(1, 1, S) <= limit  # (B, T, S)
        c.bias[:n * S].view(B, T, S).copy_(bias.masked_fill(~seen, float("-inf")))
        logits = self._verifier.step(n, S).view(B, T, -1)
        return (logits, self._verifier.hidden(n).view(B, T, -1)) if hidden else logits

    @torch.no_grad()
    def verify_forward(self, tokens: torch.Tensor, positions: torch.Tensor, S: int, hidden: bool = False):
        """``verify`` by the model's plain forward (``PagedCache.set_verify``): the reference
        of the fast path, and the path of models without one."""
        B, T = tokens.shape
        self.cache.set_verify(B, T, S)
        return self.model(tokens, positions, self.cache, return_hidden=hidden)

    # -- prefill ----------------------------------------------------------------------------

    @torch.no_grad()
    def prefill(self, tokens: torch.Tensor, slots: torch.Tensor, all_logits: bool = False, hidden: bool = False):
        """tokens, slots: (T,) for one new sequence (positions 0..T-1). Writes its keys and
        values into the pool; returns logits (1, V) of the last position, or (T, V). With
        ``hidden``: (those logits, h (T, dim)), every position's last block output (the model
        keeps hidden states only at the rows it projects, so this projects all T)."""
        T = tokens.shape[0]
        if not 0 < T <= self.max_context:
            raise ValueError(f"prompt of {T} tokens: must be 1..{self.max_context} (max_context)")
        if T <= self._prefill_rows and not all_logits:
            return self._fast_prefill(tokens, slots, hidden)
        return self.prefill_forward(tokens, slots, all_logits, hidden)

    def _fast_prefill(self, tokens: torch.Tensor, slots: torch.Tensor, hidden: bool):
        """``prefill`` of T <= ``FAST_PREFILL_TOKENS`` tokens as T rows of the fast step; the
        inputs are written through numpy on CPU (no ATen op: module docstring)."""
        T, bs = tokens.shape[0], self.pool.block_size
        step = self._prompt_step(T)
        c = step.cache
        host = _host(slots)
        S = -(-T // bs) * bs
        gather = (host[::bs] // bs * bs)[:, None] + np.arange(bs)  # the prompt's blocks, whole
        seen = np.arange(S)[None, :] <= np.arange(T)[:, None]  # row j sees positions 0..j
        _write(step.tokens, _host(tokens))
        _write(c.slots, host)
        _write(c.gather, np.broadcast_to(gather.reshape(1, S), (T, S)).reshape(-1))
        _write(c.bias, np.where(seen, 0.0, -np.inf).astype(np.float32).reshape(-1))
        logits = step.step(T, S)
        return (logits, step.hidden(T)) if hidden else logits

    def _prompt_step(self, T: int) -> FastDecoder:
        """The short-prompt step for T tokens, built for the next power of two rows (at most
        ``_prefill_rows``) by the first prompt, rebuilt larger by a longer one: ``generate`` of a
        1-token prompt then holds a 1-row workspace, not a 16-row one (1.7 MiB of the 90m model's
        2 MiB; issue 24's memory bound). Row j is the prompt's position j."""
        if self._prefiller is None or self._prefiller.cache.max_rows < T:
            n = min(self._prefill_rows, 1 << (T - 1).bit_length())
            self._prefiller = None  # the smaller step's workspace is freed before the larger one is made
            self._prefiller = self._one_token_rows(n, -(-n // self.pool.block_size) * self.pool.block_size,
                                                   torch.from_numpy(np.arange(n)).to(self.device), self._kernels,
                                                   last_logits_only=True)
        return self._prefiller

    @torch.no_grad()
    def prefill_packed(self, tokens: torch.Tensor, slots: torch.Tensor, lengths: list[int]) -> torch.Tensor:
        """tokens, slots: (sum T_i,) n new sequences' prompts concatenated, prompt i of
        ``lengths[i]`` tokens. Writes their keys and values into the pool; returns logits
        (n, V), row i prompt i's last position (``prefill`` of each prompt alone, to float
        rounding)."""
        if self.hourglass is not None or self.cache.latent:
            raise ValueError("prefill_packed: an hourglass or latent-attention (MLA) model prefills one prompt at a "
                             "time (prefill)")
        for T in lengths:
            if not 0 < T <= self.max_context:
                raise ValueError(f"prompt of {T} tokens: must be 1..{self.max_context} (max_context)")
        if not lengths or tokens.shape[0] != sum(lengths):
            raise ValueError(f"prefill_packed: {tokens.shape[0]} tokens for prompts of lengths {lengths}")
        self.cache.set_packed_prefill(slots, lengths)
        positions = torch.from_numpy(np.concatenate([np.arange(T) for T in lengths])).to(self.device)
        last = torch.from_numpy(np.cumsum(lengths) - 1).to(self.device)
        return self.model(tokens[None], positions, self.model_cache, output_rows=last)[0]

    @torch.no_grad()
    def prefill_forward(self, tokens: torch.Tensor, slots: torch.Tensor, all_logits: bool = False,
                        hidden: bool = False):
        """``prefill`` by the model's plain forward: the reference of the fast path, and the path
        of long prompts and of models without the fast step."""
        T = tokens.shape[0]
        self.cache.set_prefill(slots)
        positions = torch.arange(T, device=tokens.device)
        rows = None if all_logits else slice(T - 1, T)
        if hidden:
            logits, h = self.model(tokens[None], positions, self.model_cache, return_hidden=True)
            return logits[0, rows or slice(None)], h[0]
        return self.model(tokens[None], positions, self.model_cache, output_rows=rows)[0]

    # -- torch.compile ----------------------------------------------------------------------

    def compile(self) -> float:
        """Compile the model's forward on one token per row with ``torch.compile`` at one
        static shape, all ``max_rows`` rows x the whole context (gpt-fast's static-cache
        approach: one graph, no recompiles; unused rows attend to the padding block and are
        ignored), and run it once so the compile happens now. Returns (and keeps in
        ``compile_s``) the seconds taken."""
        self._compiled = torch.compile(self._forward_decode, dynamic=False)
        self.static_shape = (self.max_rows, self.context_slots)
        self.slots.zero_()  # every row writes into and reads from the padding block
        self.gather.zero_()
        self.bias.zero_()
        t0 = time.perf_counter()
        with torch.no_grad():
            self._compiled(*self.static_shape)
        self.compile_s = time.perf_counter() - t0
        bs = self.pool.block_size
        self.pool.k[:, :, :bs].zero_()
        if self.pool.v is not None:
            self.pool.v[:, :, :bs].zero_()
        return self.compile_s


def _host(t: torch.Tensor) -> np.ndarray:
    return t.numpy() if t.device.type == "cpu" else t.cpu().numpy()


def _write(dst: torch.Tensor, src: np.ndarray) -> None:
    """dst[:len(src)] = src: through a numpy view on CPU (no ATen op), else one copy."""
    if dst.device.type == "cpu" and dst.dtype != torch.bfloat16:
        dst.numpy()[:src.shape[0]] = src
    else:
        dst[:src.shape[0]].copy_(torch.from_numpy(np.ascontiguousarray(src)))


def count_allocations(fn, *args, **kwargs) -> dict[str, int]:
    """Memory allocations made while ``fn(*args, **kwargs)`` runs, from the profiler's memory
    events (every allocator call, CPU or CUDA): {"count": n, "bytes": total}."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn(*args, **kwargs)
    sizes = [e.nbytes() for e in prof.profiler.kineto_results.events() if e.name() == "[memory]" and e.nbytes() > 0]
    return {"count": len(sizes), "bytes": int(sum(sizes))}
