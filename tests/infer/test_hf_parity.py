"""The engine against ``transformers.LlamaForCausalLM`` with the same weights (small
random models, two grouped-query shapes): logits within 1e-4 (fp32) on prefill and at every
decode step, and the same 64 greedy tokens. Unfused and fused (``prepare_model``'s default)."""

from __future__ import annotations

import pytest
import torch
import transformers

from tests.infer.helpers import SHAPES, model_for
from trainforge.infer.engine import Engine, EngineConfig
from trainforge.infer.prepare import prepare_model
from trainforge.infer.sampling import SamplingParams
from trainforge.model.hf import to_hf_config_dict, to_hf_state_dict

ATOL, RTOL = 1e-4, 1e-5
NEW_TOKENS = 64


def hf_twin(model) -> transformers.LlamaForCausalLM:
    cfg = model.cfg
    hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(**to_hf_config_dict(cfg), attn_implementation="eager"))
    hf.load_state_dict(to_hf_state_dict(model.state_dict(), cfg), strict=True)
    return hf.eval()


def spy(engine: Engine) -> list[torch.Tensor]:
    """Record the logits of every prefill and decode the engine runs."""
    seen = []
    runner = engine.runner
    prefill, decode = runner.prefill, runner.decode
    runner.prefill = lambda *a, **k: (lambda out: (seen.append(out.clone()), out)[1])(prefill(*a, **k))
    runner.decode = lambda *a: (lambda out: (seen.append(out.clone()), out)[1])(decode(*a))
    return seen


@pytest.mark.parametrize("fuse", [False, True], ids=["unfused", "fused"])
@pytest.mark.parametrize("shape", list(SHAPES))
def test_logits_and_greedy_tokens_match_transformers(shape, fuse):
    model = model_for(shape, seed=3)
    hf = hf_twin(model)
    prompt = torch.randint(0, model.cfg.vocab_size, (19,), generator=torch.Generator().manual_seed(5)).tolist()
    with torch.no_grad():
        out = hf.generate(torch.tensor([prompt]), max_new_tokens=NEW_TOKENS, do_sample=False, output_logits=True,
                          return_dict_in_generate=True, eos_token_id=None, pad_token_id=0)
        hf_prefill = hf(input_ids=torch.tensor([prompt])).logits[0]
    hf_tokens = out.sequences[0, len(prompt):].tolist()
    hf_step_logits = torch.cat(out.logits)  # (64, V): step i's logits, before any processor

    engine = Engine(prepare_model(model, fuse=fuse), EngineConfig(max_batch_size=2, block_size=8, max_context=128))
    # Prefill logits at every prompt position, into a scratch sequence of the pool.
    engine.pool.add(10_000, len(prompt))
    slots = torch.tensor(engine.pool.append_slots(10_000, len(prompt)))
    ours_prefill = engine.runner.prefill(torch.tensor(prompt), slots, all_logits=True)
    engine.pool.free(10_000)
    torch.testing.assert_close(ours_prefill, hf_prefill, atol=ATOL, rtol=RTOL)

    seen = spy(engine)
    req = engine.generate([prompt], SamplingParams(max_new_tokens=NEW_TOKENS, temperature=0))[0]
    assert req.output_ids == hf_tokens
    ours_steps = torch.cat(seen)  # prefill's last position, then 63 decode steps
    assert ours_steps.shape == hf_step_logits.shape
    torch.testing.assert_close(ours_steps, hf_step_logits, atol=ATOL, rtol=RTOL)
    print(f"{shape} fuse={fuse}: max |logit diff| prefill {(ours_prefill - hf_prefill).abs().max():.2e}, "
          f"decode {(ours_steps - hf_step_logits).abs().max():.2e}")
