"""Absorbed latent-attention decode in the engine (model/mla.py ``_absorbed``,
``PagedCache.attend_latent``): the paged pool holds only each token's latent and rotary key,
and the engine's logits and greedy tokens match the naive training forward, with continuous
batching, speculative verification and int8 weights."""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch
from torch import nn

from tests.infer.helpers import argmax_loop, sharpen
from trainforge.infer.engine import Engine, EngineConfig
from trainforge.infer.prepare import prepare_model
from trainforge.infer.quantize import Int8Linear, quantize_model
from trainforge.infer.sampling import SamplingParams
from trainforge.infer.speculative import DraftModelDrafter
from trainforge.model import FLAVORS, build_model
from trainforge.model.attention_cache import StaticCache, kv_bytes_per_token
from trainforge.model.preflight import inference_estimate

CFG = dataclasses.replace(FLAVORS["dsv3-debug"], max_seq_len=128)
# Different lengths and budgets: with two rows, the third request joins when the first leaves.
PROMPTS = [[5, 17, 300, 42, 9], list(range(1, 30)), [7], [99, 98, 97, 96, 95, 94, 93, 92, 91, 90, 89]]
NEW = [10, 6, 12, 8]


def engine_for(model, **kw) -> Engine:
    return Engine(model, EngineConfig(**{"max_batch_size": 2, "block_size": 8, "max_context": 64, **kw}))


def greedy(n: int) -> SamplingParams:
    return SamplingParams(max_new_tokens=n, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def mla():
    """dsv3-debug with decisive logits, its naive greedy tokens (training forward, argmax)."""
    model = sharpen(build_model(CFG, seed=0)).eval()
    return model, [argmax_loop(model, p, n) for p, n in zip(PROMPTS, NEW)]


def test_pool_stores_only_the_latent_and_rotary_key():
    engine = engine_for(build_model(CFG, seed=0).eval())
    per_token = CFG.n_layers * (CFG.kv_lora_rank + CFG.qk_rope_head_dim) * 4
    assert engine.pool.v is None and engine.pool.bytes_per_token == per_token
    assert engine.pool.nbytes == per_token * engine.pool.n_blocks * engine.pool.block_size
    # The load preflight sizes the same pool.
    assert inference_estimate(CFG, 4, 100, 4).parts["KV pool"] == 100 * per_token == 100 * kv_bytes_per_token(CFG, 4)
    # Naive per-head keys and values would take (H * (nope + rope + v)) / (r + rope) times more.
    naive = CFG.n_layers * CFG.n_heads * (CFG.qk_nope_head_dim + CFG.qk_rope_head_dim + CFG.v_head_dim) * 4
    assert naive / per_token == 160 / 40


def test_engine_logits_match_the_naive_forward(mla):
    """Every prefill and decode logit the engine computes (absorbed, over the paged pool,
    rows of different lengths joining and leaving) equals the training forward's (naive
    attention) at that position within 1e-4; greedy tokens equal the argmax loop's."""
    model, want = mla
    engine = engine_for(prepare_model(copy.deepcopy(model)))  # fused + row-block linears: the serve path
    runner, seen = engine.runner, []
    prefill, decode = runner.prefill, runner.decode

    def record_prefill(tokens, slots, all_logits=False):
        out = prefill(tokens, slots, all_logits)
        seen.append((tokens.tolist(), None, out[-1].clone()))
        return out

    def record_decode(B, S):
        out = decode(B, S)
        for r in range(B):  # row r's request, input token and its position
            seen.append((None, (engine._rows[r], int(runner.tokens[r]), int(runner.positions[r])), out[r].clone()))
        return out

    runner.prefill, runner.decode = record_prefill, record_decode
    reqs = engine.generate(PROMPTS, [greedy(n) for n in NEW])
    assert [r.output_ids for r in reqs] == want
    assert engine.stats()["peak_batch"] == 2
    n_decode = 0
    with torch.no_grad():
        for tokens, row, got in seen:
            if row is None:  # a prefill: the prompt's last position
                ref = model(torch.tensor([tokens]))[0, -1]
            else:  # a decode step: the input token sits at position p of prompt + outputs
                req, token, p = row
                seq = (req.prompt_ids + req.output_ids)[:p + 1]
                assert seq[p] == token
                ref = model(torch.tensor([seq]))[0, -1]
                n_decode += 1
            torch.testing.assert_close(got, ref, rtol=0, atol=1e-4)
    assert n_decode >= sum(NEW) - len(NEW)


def test_static_cache_keeps_the_naive_form(mla):
    """StaticCache (not latent) stores per-head keys and values; the module takes the naive path."""
    model, _ = mla
    cache = StaticCache.for_model(model, batch_size=1, max_seq_len=16)
    assert not cache.layer(0).latent and cache.k.shape[2] == CFG.n_heads


def test_speculative_verify_with_an_mla_target(mla):
    """The target drafting for itself: every draft accepted, output identical to plain greedy."""
    model, want = mla
    engine = Engine(model, EngineConfig(max_batch_size=2, block_size=8, max_context=64, num_speculative_tokens=3),
                    drafter=DraftModelDrafter(model))
    assert [r.output_ids for r in engine.generate(PROMPTS, [greedy(n) for n in NEW])] == want
    s = engine.stats()
    assert s["spec_acceptance_rate"] == [1.0, 1.0, 1.0] and s["spec_drafted_tokens"] > 0


def test_int8_keeps_wkv_b_float_and_decodes_as_its_forward(mla):
    """int8 quantises every linear but wkv_b (read as a matrix by the absorbed form); the
    engine's greedy tokens equal the quantised model's own training-forward argmax loop.
    The int8pack kernel keeps activations fp32 (fbgemm's dynamic activation quantisation
    depends on the rows in a call, so one-token decode and whole-sequence forward differ)."""
    model, _ = mla
    q = copy.deepcopy(model)
    quantize_model(q, "int8", pack=False)
    prepare_model(q, quant_kernel="int8pack")
    attn = q.layers["0"].attention
    assert type(attn.wkv_b) is not Int8Linear and isinstance(attn.wkv_b.weight, nn.Parameter)
    assert isinstance(attn.wkv_a, Int8Linear) and isinstance(attn.wo, Int8Linear)
    want = [argmax_loop(q, p, n) for p, n in zip(PROMPTS[:2], NEW[:2])]
    engine = engine_for(q)
    assert [r.output_ids for r in engine.generate(PROMPTS[:2], [greedy(n) for n in NEW[:2]])] == want
