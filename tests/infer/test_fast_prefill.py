"""A short prompt's prefill through the fast decode step (``ModelRunner.prefill``: T one-token
rows of the step, each attending to the prompt up to itself) against the model's plain forward
(``prefill_forward``): the same last-position logits, the same hidden states and the same
keys/values written into the pool, float32, tolerance 1e-5; longer prompts keep the forward."""

from __future__ import annotations

import pytest
import torch

from tests.infer.helpers import model_for
from trainforge.infer.kv_pool import KVPool
from trainforge.infer.prepare import prepare_model
from trainforge.infer.runner import ModelRunner

TOL = dict(atol=1e-5, rtol=1e-5)


def _runner(fuse: bool, bs: int = 4) -> tuple[ModelRunner, KVPool]:
    model = prepare_model(model_for("gqa4"), fuse=fuse)
    cfg = model.cfg
    pool = KVPool(cfg.n_layers, cfg.n_kv_heads, cfg.head_dim, 64, bs)
    return ModelRunner(model, pool, 2, 96), pool


@pytest.fixture
def threads(request):
    """Intra-op threads while the runner is built: at 2 its float linears run as row blocks
    (``LinearInto``), the last-row output projection as a (split, 1, N/split) bmm."""
    before = torch.get_num_threads()
    torch.set_num_threads(request.param)
    yield request.param
    torch.set_num_threads(before)


@pytest.mark.parametrize("threads", [1, 2], indirect=True)
@pytest.mark.parametrize("fuse", [False, True], ids=["plain", "fused"])
@pytest.mark.parametrize("T", [1, 3, 9, 16])
def test_a_short_prompt_prefills_through_the_fast_step_as_the_forward_does(fuse, T, threads, monkeypatch):
    runner, pool = _runner(fuse)
    prompt = torch.randint(0, runner.cfg.vocab_size, (T,), generator=torch.Generator().manual_seed(T))
    pool.add(0, T)
    pool.add(1, T)
    fast_slots, ref_slots = (torch.tensor(pool.append_slots(i, T)) for i in range(2))
    ref_logits, ref_h = (t.clone() for t in runner.prefill_forward(prompt, ref_slots, hidden=True))
    ref_last = runner.prefill_forward(prompt, ref_slots)
    forward = []
    monkeypatch.setattr(runner, "prefill_forward", lambda *a, **k: forward.append(a))
    fast_logits, fast_h = runner.prefill(prompt, fast_slots, hidden=True)
    assert forward == []  # the plain forward never ran
    assert runner._prefiller.ws.split == threads
    torch.testing.assert_close(fast_logits, ref_logits, **TOL)
    torch.testing.assert_close(fast_h, ref_h, **TOL)
    torch.testing.assert_close(runner.prefill(prompt, fast_slots), ref_last, **TOL)
    assert fast_logits.shape == (1, runner.cfg.vocab_size)
    for cache in (pool.k, pool.v):  # the keys / values the decode steps will read
        torch.testing.assert_close(cache[:, :, fast_slots], cache[:, :, ref_slots], **TOL)


def test_long_prompts_and_all_logits_keep_the_plain_forward(monkeypatch):
    runner, pool = _runner(fuse=True)
    forward = []
    real = runner.prefill_forward
    monkeypatch.setattr(runner, "prefill_forward", lambda *a, **k: forward.append(a[0].shape[0]) or real(*a, **k))
    n = ModelRunner.FAST_PREFILL_TOKENS
    pool.add(0, 64)
    runner.prefill(torch.arange(n + 1), torch.tensor(pool.append_slots(0, n + 1)))
    pool.add(1, 64)
    logits = runner.prefill(torch.arange(2), torch.tensor(pool.append_slots(1, 2)), all_logits=True)
    assert forward == [n + 1, 2] and logits.shape == (2, runner.cfg.vocab_size)


def test_the_short_prompt_step_grows_with_the_prompt_and_stays_exact():
    """The step is built for the first short prompt's length (next power of two) and rebuilt
    larger for a longer one; every prompt still matches the forward."""
    runner, pool = _runner(fuse=True)
    rows = []
    for i, T in enumerate((1, 2, 9, 3, 16)):
        prompt = torch.randint(0, runner.cfg.vocab_size, (T,), generator=torch.Generator().manual_seed(i))
        pool.add(2 * i, T)
        pool.add(2 * i + 1, T)
        fast_slots, ref_slots = (torch.tensor(pool.append_slots(2 * i + j, T)) for j in range(2))
        ref = runner.prefill_forward(prompt, ref_slots).clone()
        torch.testing.assert_close(runner.prefill(prompt, fast_slots), ref, **TOL)
        rows.append(runner._prefiller.cache.max_rows)
    assert rows == [1, 2, 16, 16, 16]
