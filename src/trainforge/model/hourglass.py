"""The hourglass trunk (Nawrot et al. 2022, "Hierarchical Transformers Are More Efficient
Language Models"): the middle blocks run on a shortened, optionally narrower sequence.

``model.hourglass`` (``hourglass_spec.py``) lists the stages; each step inwards is a
*shortening* by k = (inner shorten) / (outer shorten), each step outwards the matching
*upsampling*::

    shorten:  x (B, T, d)  --shift right by k-1--> pool each k positions --> project d -> d/r
              -> (B, ceil(T/k), d/r)
    upsample: y (B, ceil(T/k), d/r) --project d/r -> d--> repeat each position k times,
              keep the first T --> + x (the stream from before the shortening) -> (B, T, d)

Causality. The shift puts k-1 zero rows in front, so shortened position j pools input
positions jk-k+1 .. jk (the zeros where those are < 0): nothing after jk. Upsampled position
t reads shortened position t // k, whose inputs end at k * (t // k) <= t, so no position sees
a later token; the residual brings each position's own stream back. The shortened
sequence is ceil(T/k) long and every group is full of real (or shift) rows, so a length
that k does not divide needs no padding at the end and a group's pool does not depend on
where the sequence stops (``tests/model/test_hourglass.py`` checks every position of every
tested spec, lengths not divisible by k included).

Pooling (``model.hourglass_pool``): ``mean`` averages the k rows, then projects d -> d/r
(no projection when r is 1); ``linear`` maps the k rows' concatenation (k·d) to d/r with one
learned matrix (Nawrot's linear pooling). The upsampling projects before it repeats: the
same linear map applied once per shortened position instead of k times.

Rotary positions of shortened tokens: shortened token j gets rotary position j, its group
index at the shortened rate, with tables over the stage's own head dim (d / r / n_heads).
So a shortened stage is an ordinary causal LM over ceil(T/k) tokens at unit spacing, and its
decode cache stores one entry per k tokens at positions 0, 1, 2, ... . Full-rate stages keep
the model's tables.

Decoding (``hourglass_cache.py``, driven by the engine through ``infer/hourglass_pools.py``):
``forward`` with an ``HourglassCache`` runs the same modules, the middle stages once every k
tokens per sequence, each depth attending through its own paged pool at its rate.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from trainforge.model.config import ModelConfig
from trainforge.model.hourglass_spec import shortening_spans
from trainforge.model.rope import rope_tables

if TYPE_CHECKING:
    from trainforge.model.hourglass_cache import HourglassCache


class Shortening(nn.Module):
    """Shift right by k-1, pool each k positions, project the width down (module docstring).
    x (B, T, d_outer) -> (B, ceil(T/k), d_inner)."""

    def __init__(self, k: int, d_outer: int, d_inner: int, pool: str):
        super().__init__()
        self.k, self.pool = k, pool
        if pool == "linear":
            self.proj: nn.Linear | None = nn.Linear(k * d_outer, d_inner, bias=False)
        else:
            self.proj = nn.Linear(d_outer, d_inner, bias=False) if d_outer != d_inner else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, d = x.shape
        n = -(-T // self.k)
        # k-1 zero rows in front; n*k <= T + k - 1 rows, so every group holds only real or shift rows.
        groups = F.pad(x, (0, 0, self.k - 1, 0))[:, :n * self.k].reshape(B, n, self.k, d)  # (B, n, k, d)
        return self.pool_groups(groups)

    def pool_groups(self, groups: torch.Tensor) -> torch.Tensor:
        """Each group of k rows to one: groups (B, n, k, d_outer) -> (B, n, d_inner). The
        decode cache (``hourglass_cache.py``) calls it on the groups it collects."""
        B, n, k, d = groups.shape
        if self.pool == "linear":
            return self.proj(groups.reshape(B, n, k * d))
        h = groups.mean(dim=2)  # (B, n, d)
        return self.proj(h) if self.proj is not None else h

    def decode_calls(self, ws, groups: torch.Tensor, out: torch.Tensor, scratch: torch.Tensor) -> list:
        """out <- pool_groups(groups) for one closed group per row, groups (B, k, d_outer) ->
        out (B, d_inner), as bound out= operator calls (``fast_decode.py``'s convention; the
        decoder may compile them): the same mean, then the same projection through the
        workspace's linear. ``scratch`` (B, d_outer): the mean, when a projection follows."""
        B, k, d = groups.shape
        if self.pool == "linear":
            return [ws.linear(self.proj).bind(groups.view(B, k * d), out)]
        h = scratch if self.proj is not None else out
        calls = [functools.partial(torch.ops.aten.mean.out, groups, [1], False, out=h)]
        return calls + ([ws.linear(self.proj).bind(h, out)] if self.proj is not None else [])


class Upsampling(nn.Module):
    """Project the width up, repeat each position k times, add the stream from before the
    shortening. x (B, ceil(T/k), d_inner), residual (B, T, d_outer) -> (B, T, d_outer)."""

    def __init__(self, k: int, d_inner: int, d_outer: int):
        super().__init__()
        self.k = k
        self.proj = nn.Linear(d_inner, d_outer, bias=False) if d_inner != d_outer else None

    def forward(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        h = self.proj(x) if self.proj is not None else x
        return residual + h.repeat_interleave(self.k, dim=1)[:, :residual.shape[1]]

    def decode_calls(self, ws, inner: torch.Tensor, x: torch.Tensor, scratch: torch.Tensor) -> list:
        """x <- forward(inner, x) for one token per row (its group's inner output, repeated
        once): inner (B, d_inner), x (B, d_outer) in place, as bound operator calls.
        ``scratch`` (B, d_outer): the projection, when there is one."""
        if self.proj is None:
            return [functools.partial(torch.ops.aten.add_.Tensor, x, inner)]
        return [ws.linear(self.proj).bind(inner, scratch), functools.partial(torch.ops.aten.add_.Tensor, x, scratch)]


class HourglassTrunk(nn.Module):
    """The shortenings and upsamplings of ``cfg.hourglass`` (keyed "0".. by level, outside
    in) and their rotary tables; ``forward`` runs the model's blocks through them. The
    blocks stay in ``Transformer.layers`` (numbered through the stages), so activation
    checkpointing, FSDP units, TP plans and pipeline cuts see them as in a dense model."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        stages = cfg.hourglass_stages
        mid = len(stages) // 2
        self.spans = shortening_spans(stages)  # per level: (first block, last block + 1) inside it
        self.shorten = nn.ModuleDict()
        self.upsample = nn.ModuleDict()
        self.rates: list[int] = []  # cumulative shortening of each level
        for level, (outer, inner) in enumerate(zip(stages[:mid], stages[1:mid + 1])):
            k = inner.shorten // outer.shorten
            d_outer, d_inner = cfg.dim // outer.width_ratio, cfg.dim // inner.width_ratio
            self.shorten[str(level)] = Shortening(k, d_outer, d_inner, cfg.hourglass_pool)
            self.upsample[str(level)] = Upsampling(k, d_inner, d_outer)
            self.rates.append(inner.shorten)
            cos, sin = self._tables(level, inner.shorten, d_inner)
            # Non-persistent, as the model's own tables: recomputed from the config.
            self.register_buffer(f"rope_cos_{level}", cos, persistent=False)
            self.register_buffer(f"rope_sin_{level}", sin, persistent=False)

    def _tables(self, level: int, rate: int, width: int, device=None) -> tuple[torch.Tensor, torch.Tensor]:
        """Rotary rows at the shortened rate: position j is group j (module docstring)."""
        n = -(-self.cfg.max_seq_len // rate)
        head_dim = width // self.cfg.n_heads
        if (torch.device(device) if device is not None else torch.get_default_device()).type == "meta":
            return torch.empty(n, head_dim, device="meta"), torch.empty(n, head_dim, device="meta")
        return rope_tables(head_dim, n, self.cfg.rope_theta, device=device)

    @torch.no_grad()
    def reset_rope(self) -> None:
        """Recompute the tables in place (after building on the meta device)."""
        stages = self.cfg.hourglass_stages
        for level, rate in enumerate(self.rates):
            cos, sin = self._tables(level, rate, self.cfg.dim // stages[level + 1].width_ratio,
                                    device=getattr(self, f"rope_cos_{level}").device)
            getattr(self, f"rope_cos_{level}").copy_(cos)
            getattr(self, f"rope_sin_{level}").copy_(sin)

    def forward(self, h: torch.Tensor, layers: nn.ModuleDict, cos: torch.Tensor, sin: torch.Tensor,
                cache: HourglassCache | None = None) -> torch.Tensor:
        """Run ``layers`` (all of the model's blocks, or a pipeline stage's contiguous part,
        which starts and ends at the full rate: ``parallel/pipeline.py`` refuses other cuts)
        on h (B, T, dim) with the full-rate rotary rows cos/sin; the shortening of a level
        runs just before its first block, the upsampling just after its last. Returns
        (B, T, dim).

        With a ``cache`` (``hourglass_cache.py``; inference), each block attends through it
        and the cache does the shortening and upsampling's bookkeeping around the same
        modules: a prompt (one row, positions 0..T-1) runs as in training and leaves each
        level's unfinished group and last inner output in the cache; a decode step (one token
        per row, rows at any phase of k) pools a level only for the rows whose token closes
        a group and runs that level's blocks on those rows alone (none: the blocks are
        skipped), and every row's upsampling adds the inner output of its latest closed group."""
        residuals: list[torch.Tensor] = []  # the streams from before each open shortening
        tables = [(cos, sin)]
        for name, block in layers.items():
            j = int(name)
            for level, (first, _) in enumerate(self.spans):
                if first == j:  # outer levels first: spans are listed outside in
                    residuals.append(h)
                    cos_l, sin_l = getattr(self, f"rope_cos_{level}"), getattr(self, f"rope_sin_{level}")
                    if cache is None:
                        h = self.shorten[str(level)](h)
                        tables.append((cos_l[:h.shape[1]], sin_l[:h.shape[1]]))
                    else:
                        h, positions = cache.shorten(level, h, self.shorten[str(level)])
                        tables.append((cos_l[positions], sin_l[positions]) if positions.dim() == 1 else
                                      (cos_l[positions].unsqueeze(1), sin_l[positions].unsqueeze(1)))
            if h.shape[0]:  # decode: no row closes a group of this level this step
                h = block(h, *tables[-1], cache.layer(j) if cache is not None else None)
            for level in reversed(range(len(self.spans))):
                if self.spans[level][1] - 1 == j:  # inner levels first
                    upsample = self.upsample[str(level)]
                    h = upsample(h, residuals.pop()) if cache is None else cache.upsample(level, h, residuals.pop(),
                                                                                          upsample)
                    tables.pop()
        return h
