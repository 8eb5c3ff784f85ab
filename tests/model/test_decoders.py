"""The decoder factory (model/decoders.py) and the plan cache every decoder keeps
(model/decode_plans.py). That the runner asking them names no model kind:
tests/infer/test_engine_parts.py."""

from __future__ import annotations

import dataclasses

from tests.model.test_hourglass import hourglass_config
from trainforge.infer.engine import Engine, EngineConfig
from trainforge.infer.sampling import SamplingParams
from trainforge.model import FLAVORS, build_model
from trainforge.model.decode_plans import PlanCache
from trainforge.model.fast_decode import FastDecoder
from trainforge.model.hourglass_decode import HourglassDecoder


def _runner(cfg):
    return Engine(build_model(dataclasses.replace(cfg, max_seq_len=64), seed=0).eval(),
                  EngineConfig(max_batch_size=2, block_size=4, max_context=32)).runner


def test_each_model_kind_gets_the_decoder_it_supports():
    dense = _runner(FLAVORS["debug"])
    assert type(dense.decoder) is FastDecoder and dense.packs_prompts and dense._prefill_rows > 0
    hourglass = _runner(hourglass_config("1@1 2@2/2 1@1"))
    # its rows carry the trunk's open groups: no one-token-row steps, prompts prefill alone
    assert type(hourglass.decoder) is HourglassDecoder and not hourglass.packs_prompts
    assert hourglass._prefill_rows == 0 and not hourglass.decoder.one_token_rows
    latent = _runner(FLAVORS["dsv3-debug"])  # latent attention has no decode_calls: the plain forward
    assert latent.decoder is None and not latent.packs_prompts


def test_plans_are_kept_per_context_only_when_a_binding_read_it():
    compiled = []
    plans = PlanCache(max_plans=3, compile=lambda calls: compiled.append(calls) or list(calls))
    binds = []

    def bind(read):
        binds.append(read)
        return [lambda: None], read
    a = plans.get((2,), (16,), lambda: bind(False))
    assert plans.get((2,), (32,), lambda: bind(False)) is a  # serves every context length
    b = plans.get((3,), (16,), lambda: bind(True))
    assert plans.get((3,), (16,), lambda: bind(True)) is b
    assert plans.get((3,), (32,), lambda: bind(True)) is not b  # bound for 16 only
    assert len(binds) == len(compiled) == 3 and len(plans) == 3
    plans.get((4,), (16,), lambda: bind(False))  # the oldest is evicted
    assert len(plans) == 3 and plans.get((2,), (16,), lambda: bind(False)) is not a


def test_rows_at_mixed_phases_share_one_bound_walk_per_shape():
    """The mixed-phase step binds its walk once per (rows, rows per depth) and replays it."""
    model = build_model(dataclasses.replace(hourglass_config("1@1 2@2/2 1@1"), max_seq_len=64), seed=0).eval()
    engine = Engine(model, EngineConfig(max_batch_size=2, block_size=4, max_context=40))
    engine.generate([[1, 2, 3], [4, 5, 6, 7]], SamplingParams(max_new_tokens=9, temperature=0.0, ignore_eos=True))
    # Every decode step had one row closing a group of k = 2 and one not: one shape, (2 rows, 1
    # of them inside), kept once per context length where the attention reads it.
    shapes = {key[:3] for key in engine.runner.decoder._plans._plans}
    assert shapes == {("mixed", 2, (2, 1))}
