"""MTP self-speculation (``--speculative mtp``, infer/mtp_drafter.py): every draft the
incremental MTP cache proposes equals ``Transformer.mtp_step`` over the whole sequence (no
cache); greedy output is identical to plain decoding (dense and MoE, batched with requests
joining and leaving); sampled tokens keep the target's distribution; a model without MTP
modules gets an error naming the key; the runner's fast verification equals the plain forward."""

from __future__ import annotations

import copy
import dataclasses

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from scipy.stats import chi2

from tests.infer.helpers import argmax_loop, sharpen
from tests.infer.test_speculative import chi_square, exact_marginals
from trainforge.cli import main
from trainforge.errors import TrainforgeError
from trainforge.infer.engine import Engine, EngineConfig
from trainforge.infer.kv_pool import KVPool
from trainforge.infer.mtp_drafter import MTPDrafter
from trainforge.infer.prepare import prepare_model
from trainforge.infer.quantize import quantize_model
from trainforge.infer.runner import ModelRunner
from trainforge.infer.sampling import SamplingParams
from trainforge.model import FLAVORS, ModelConfig, build_model
from trainforge.storage import checkpoint_format as ckpt

CFG = ModelConfig(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=32, ffn_hidden_dim=128, max_seq_len=128,
                  mtp_depth=1)
PROMPTS = [[5, 17, 3, 12], list(range(1, 30)), [7], [9, 8, 7, 6, 5, 4, 3, 2, 1]]


@pytest.fixture(scope="module")
def trained():
    """A model trained for a few seconds (main + MTP loss) on a sparse Markov chain, each token
    followed by one of two tokens (0.7 / 0.3): its MTP module drafts well enough that steps
    accept some drafts and reject others."""
    torch.manual_seed(0)
    V = CFG.vocab_size
    succ = torch.stack([torch.randperm(V)[:2] for _ in range(V)])  # (V, 2)

    def batch(n, T):
        x = torch.empty(n, T, dtype=torch.long)
        x[:, 0] = torch.randint(V, (n,))
        for t in range(1, T):
            x[:, t] = succ[x[:, t - 1], (torch.rand(n) > 0.7).long()]
        return x

    model = build_model(CFG, seed=0)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    for _ in range(120):
        x = batch(16, 48)
        logits, (mtp1,) = model(x[:, :-1], mtp=True)
        loss = F.cross_entropy(logits.flatten(0, 1), x[:, 1:].flatten()) + \
            F.cross_entropy(mtp1.flatten(0, 1), x[:, 2:].flatten())
        opt.zero_grad()
        loss.backward()
        opt.step()
    return model.eval()


def mtp_engine(model, k=3, drafter=None, **kw):
    cfg = EngineConfig(**{"max_batch_size": 2, "block_size": 8, "max_context": 96, "num_speculative_tokens": k, **kw})
    return Engine(model, cfg, drafter=drafter or MTPDrafter())


class RecordingDrafter(MTPDrafter):
    """Keeps, for every proposal, each row's accepted sequence, its drafts and the MTP logits
    (the first draft's from the previous step's ``accepted`` where it ran there)."""

    def __init__(self, fast: bool):
        super().__init__(fast)
        self.engine, self.records, self._logits = None, [], None

    def _step(self, h, tokens, positions):
        out = super()._step(h, tokens, positions)
        if self._logits is not None:
            self._logits.append(out[0][:, -1].clone())
        return out

    def _fast_step(self, B, S, tokens, u):
        out = super()._fast_step(B, S, tokens, u)
        self._logits.append(out.clone())
        return out

    def propose(self, batch, k):
        B = len(batch.tokens)
        # The first draft's logits, when ``accepted`` already ran it (the previous step).
        self._logits = [self.first_logits[:B].clone()] if self.first_ready[:B].all() else []
        draft, q = super().propose(batch, k)
        for r, req in enumerate(self.engine._rows):
            seq = req.prompt_ids + req.output_ids
            assert len(seq) == batch.positions[r] + 1 and seq[-1] == int(batch.tokens[r])
            self.records.append((seq, draft[r].tolist(), torch.stack([lg[r] for lg in self._logits])))
        self._logits = None
        return draft, q


@torch.no_grad()
def reference_drafts(model, seq: list[int], drafts: list[int]) -> torch.Tensor:
    """The drafter's logits from full-sequence forwards: depth 1 over positions 0..p-1 on the
    target's hidden states, then recurrently on its own last output and the previous draft."""
    x = torch.tensor([seq])
    _, h = model(x, return_hidden=True)
    H, X, out = h[:, :-1], x[:, 1:], []
    for d in drafts:
        logits, g = model.mtp_step(1, H, X)
        out.append(logits[0, -1])
        H, X = torch.cat([H, g[:, -1:]], 1), torch.cat([X, torch.tensor([[d]])], 1)
    return torch.stack(out)


@pytest.mark.parametrize("flavor", ["dense", "moe"])
def test_fast_verify_equals_the_plain_forward(trained, flavor):
    """The runner's verification on the fast decode step (B * T one-token rows) gives the plain
    forward's logits and hidden states, rows of different lengths together; tolerance 1e-5."""
    model = trained if flavor == "dense" else sharpen(build_model(
        dataclasses.replace(FLAVORS["moe-debug"], max_seq_len=128, mtp_depth=1), seed=0)).eval()
    bs, T, prompts = 4, 3, [list(range(3, 14)), [7, 8]]
    pool = KVPool(model.cfg.n_layers, model.cfg.n_kv_heads, model.cfg.head_dim, 32, bs)
    runner = ModelRunner(model, pool, 2, 64, lookahead=T - 1)
    assert runner._verifier is not None
    for i, p in enumerate(prompts):
        pool.add(i, 40)
        runner.prefill(torch.tensor(p), torch.tensor(pool.append_slots(i, len(p))))
    S = 20
    runner.slots[:2 * T] = torch.tensor([pool.append_slots(r, T) for r in range(2)]).view(-1)
    for r, p in enumerate(prompts):
        index = np.concatenate([np.arange(b * bs, (b + 1) * bs) for b in pool.table(r)] + [np.arange(S)])[:S]
        runner.gather[r * S:(r + 1) * S] = torch.from_numpy(index)
        runner.bias[r * S:(r + 1) * S] = torch.where(torch.arange(S) < len(p) + T, 0.0, float("-inf"))
    new = torch.tensor([[11, 22, 3], [5, 6, 7]])
    positions = torch.tensor([len(p) for p in prompts])[:, None] + torch.arange(T)
    fast = [t.clone() for t in runner.verify(new, positions, S, hidden=True)]
    plain = runner.verify_forward(new, positions, S, hidden=True)
    for a, b in zip(fast, plain):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("fast", [True, False])
def test_incremental_mtp_drafts_equal_the_full_sequence_forward(trained, fast):
    """The key correctness check: over a sampled run (temperature 1, so steps accept 0..k
    drafts and the rollbacks and rewrites of the MTP cache all happen) with rows joining and
    leaving, every proposal's logits equal depth 1 over the whole sequence; tolerance 1e-5.
    Drafts on the allocation-free step (``FastMTPStep``) and on the plain ``mtp_step``."""
    drafter = RecordingDrafter(fast)
    engine = mtp_engine(trained, k=3, drafter=drafter)
    drafter.engine = engine
    assert (drafter.fast is not None) == fast
    params = [SamplingParams(max_new_tokens=n, temperature=1.0, seed=i, ignore_eos=True)
              for i, n in enumerate((40, 12, 30, 20))]
    engine.generate(PROMPTS, params)
    assert len(drafter.records) > 20
    accepted_at = engine.stats()["spec_acceptance_rate"]
    assert accepted_at[0] > 0.3 and accepted_at[2] < 0.95  # steps kept all, some and none of their drafts
    for seq, drafts, logits in drafter.records:
        torch.testing.assert_close(logits, reference_drafts(trained, seq, drafts), atol=1e-5, rtol=1e-5)


def test_greedy_output_is_identical_to_plain_decoding_with_continuous_batching(trained):
    """Six requests of different budgets through two rows, k = 3: each equals greedy decoding
    of the plain forward alone, and the trained MTP module gets drafts accepted."""
    prompts = PROMPTS + [[1, 2], list(range(3, 31))]
    params = [SamplingParams(max_new_tokens=n, temperature=0, ignore_eos=True) for n in (30, 9, 21, 4, 17, 12)]
    want = [argmax_loop(trained, p, sp.max_new_tokens) for p, sp in zip(prompts, params)]
    engine = mtp_engine(trained, k=3)
    assert [r.output_ids for r in engine.generate(prompts, params)] == want
    s = engine.stats()
    assert s["peak_batch"] == 2 and engine.pool.blocks_used == 0
    assert s["spec_acceptance_rate"] == sorted(s["spec_acceptance_rate"], reverse=True)
    assert s["spec_acceptance_rate"][0] > 0.3 and s["spec_mean_accepted_length"] > 1.3


@pytest.mark.parametrize("flavor, depth, k", [("moe-debug", 1, 1), ("moe-debug", 2, 4), ("dsv3-debug", 1, 2)])
def test_greedy_moe_with_mtp(flavor, depth, k):
    """A MoE model (its MTP block has a MoE feed-forward, as DeepSeek-V3's); a model with two
    MTP depths drafts with depth 1 for every k; a DeepSeek-V3 model (latent attention: the MTP
    block's cache holds latents, as the target's pool)."""
    model = sharpen(build_model(dataclasses.replace(FLAVORS[flavor], max_seq_len=128, mtp_depth=depth),
                                seed=0)).eval()
    params = SamplingParams(max_new_tokens=10, temperature=0, ignore_eos=True)
    want = [argmax_loop(model, p, 10) for p in PROMPTS[:3]]
    engine = mtp_engine(model, k=k)
    assert [r.output_ids for r in engine.generate(PROMPTS[:3], params)] == want
    assert engine.stats()["spec_drafted_tokens"] > 0


@pytest.mark.parametrize("mode, kernel", [("int8", "int8pack"), ("int4", "reference")])
def test_quantised_mtp_target(trained, mode, kernel):
    """A quantised target drafts with its own quantised MTP module (module swaps, the MTP
    block's linears included): greedy output equals the quantised model's plain decoding."""
    target = copy.deepcopy(trained)
    quantize_model(target, mode, group_size=32, pack=False)
    prepare_model(target, quant_kernel=kernel)
    params = SamplingParams(max_new_tokens=20, temperature=0, ignore_eos=True)
    plain = Engine(target, EngineConfig(max_batch_size=1, block_size=8, max_context=96))
    want = [plain.generate([p], params)[0].output_ids for p in PROMPTS]
    engine = mtp_engine(target, k=2)
    assert [r.output_ids for r in engine.generate(PROMPTS, params)] == want
    assert set(engine.kernels) == {kernel} and engine.stats()["spec_accepted_tokens"] > 0


TINY = ModelConfig(dim=32, n_layers=1, n_heads=2, n_kv_heads=1, vocab_size=8, ffn_hidden_dim=64, max_seq_len=32,
                   mtp_depth=1)


def test_mtp_speculative_sampling_keeps_the_target_distribution():
    """800 seeded requests, k = 2: tokens 2 and 3 (one speculative step) pass a chi-square
    test against the target's exact distribution at significance 1e-3 per token."""
    target = build_model(TINY, seed=0).eval()
    with torch.no_grad():
        target.output.weight.mul_(3.0)
    params, prompt, n = SamplingParams(max_new_tokens=3, temperature=1.0, ignore_eos=True), [1, 2, 3], 800
    want = exact_marginals(target, prompt, params)
    engine = Engine(target, EngineConfig(max_batch_size=64, max_queue=n, block_size=4, max_context=16,
                                         num_speculative_tokens=2), drafter=MTPDrafter())
    out = np.array([r.output_ids for r in engine.generate([prompt] * n, [dataclasses.replace(params, seed=i)
                                                                         for i in range(n)])])
    assert 0.1 < engine.stats()["spec_acceptance_rate"][0] < 0.9  # both branches of the rule ran
    for t in (1, 2):
        stat, df = chi_square(np.bincount(out[:, t], minlength=TINY.vocab_size), want[t])
        assert stat < chi2.ppf(1 - 1e-3, df)


def write_checkpoint(path, model):
    """A single-process trainforge checkpoint directory of ``model`` (what `trainforge train` saves)."""
    path.mkdir()
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(path / ckpt.MODEL_FILE))
    ckpt.write_meta(path, 0, {}, dataclasses.asdict(model.cfg))
    return path


def test_cli_generate_with_mtp(trained, tmp_path, capsys):
    """``generate --speculative mtp`` prints what plain ``generate`` prints, with the
    speculation counters in --stats; a checkpoint without MTP modules is refused naming the key."""
    ck = write_checkpoint(tmp_path / "mtp", trained)
    base = ["generate", "--checkpoint", str(ck), "--prompt_ids", "5,17,3,12", "--print_ids", "--temperature", "0",
            "--max_new_tokens", "12", "--ignore_eos"]
    assert main(base) == 0
    plain = capsys.readouterr().out
    assert main(base + ["--speculative", "mtp", "--num_speculative_tokens", "2", "--stats"]) == 0
    captured = capsys.readouterr()
    assert captured.out == plain and len(plain.split(",")) == 12
    assert '"spec_acceptance_rate": [' in captured.err
    none = write_checkpoint(tmp_path / "plain", build_model(dataclasses.replace(CFG, mtp_depth=0), seed=0))
    assert main(["generate", "--checkpoint", str(none), "--prompt_ids", "1,2", "--speculative", "mtp"]) == 2
    assert "--speculative mtp needs a model trained with model.mtp_depth >= 1" in capsys.readouterr().err
    with pytest.raises(TrainforgeError, match=r"needs a model trained with model.mtp_depth >= 1"):
        mtp_engine(build_model(dataclasses.replace(CFG, mtp_depth=0), seed=0))
