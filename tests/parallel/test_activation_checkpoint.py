"""Activation checkpointing wraps every block, the trunk's and those a family keeps elsewhere
(the MTP modules' blocks), found by kind: parallel/activation_checkpoint.py names no family."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper

from trainforge.model.config import FLAVORS
from trainforge.model.llama import Transformer, TransformerBlock
from trainforge.parallel.activation_checkpoint import apply_activation_checkpointing


@pytest.mark.parametrize("kw", [dict(mtp_depth=2), dict(n_layers=5, hourglass="1@1 1@2 1@4/2 1@2 1@1")],
                         ids=["mtp", "hourglass"])
def test_every_block_is_wrapped_once_and_names_are_kept(kw):
    torch.manual_seed(0)
    model = Transformer(dataclasses.replace(FLAVORS["debug"], **kw))
    names = [n for n, _ in model.named_parameters()]
    blocks = [n for n, m in model.named_modules() if isinstance(m, TransformerBlock)]
    tokens = torch.randint(0, model.cfg.vocab_size, (2, 16))
    before = model(tokens)
    apply_activation_checkpointing(model, "full")
    wrapped = {n for n, m in model.named_modules() if isinstance(m, CheckpointWrapper)}
    assert wrapped == set(blocks) and len(blocks) == model.cfg.n_layers + model.cfg.mtp_depth
    assert [n.replace("._checkpoint_wrapped_module", "") for n, _ in model.named_parameters()] == names
    torch.testing.assert_close(model(tokens), before, rtol=0, atol=0)
