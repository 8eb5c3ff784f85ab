"""Which fast decode step a model supports: the one question a runner asks.

A runner (``infer/runner.py``) holds one decoder for its model and never tests the model's
kind: ``make_decoder`` looks at the model once and returns the allocation-free step its
modules support, or None where some module on the decode path has no ``decode_calls`` (then
the runner decodes through the model's plain forward, which every model has). A new model
kind with a decode walk of its own adds its decoder to ``DECODERS``, not a branch in the runner.

Every decoder offers:

- ``step(rows, context) -> logits (rows, V)``: one token for each of rows 0..B-1, reading the
  tokens and positions buffers it was built with and the cache's metadata;
- ``one_token_rows``: whether a sequence's tokens may run as independent one-token rows (not
  where a row carries state of its own beyond the pool); if so,
  ``rows_step(rows, context_slots, positions, last_logits_only=False)`` gives a step of its own
  over such rows sharing the pool (a verification's or a short prompt's tokens), and that
  step's ``hidden(rows)`` the last step's final residual stream;
- ``nbytes``: its workspace.
"""

from __future__ import annotations

from typing import Protocol

import torch
from torch import nn

from trainforge.model.attention_cache import AttentionCache
from trainforge.model.fast_decode import FastDecoder
from trainforge.model.hourglass_decode import HourglassDecoder


class Decoder(Protocol):
    nbytes: int
    one_token_rows: bool

    def step(self, rows: int, context: int) -> torch.Tensor: ...

    def rows_step(self, rows: int, context_slots: int, positions: torch.Tensor,
                  last_logits_only: bool = False) -> Decoder: ...


# Tried in order; the first whose ``supports(model)`` holds decodes the model.
DECODERS = (HourglassDecoder, FastDecoder)


def make_decoder(model: nn.Module, cache: AttentionCache, tokens: torch.Tensor, positions: torch.Tensor,
                 kernels=None) -> Decoder | None:
    """The fast decode step of ``model`` over ``cache`` (the cache the model attends through),
    reading each row's token from ``tokens`` and position from ``positions`` (B,) (buffers the
    owner fills); ``kernels``: fused decode ops handed in from outside (``DecodeWorkspace``).
    None: the model decodes through its plain forward."""
    for kind in DECODERS:
        if kind.supports(model):
            return kind(model, cache, tokens, positions, kernels)
    return None
