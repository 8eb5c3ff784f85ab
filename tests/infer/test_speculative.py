"""Speculative decoding: the verification forward equals sequential decode steps; rollback
returns pages; greedy output is identical to plain decoding (draft = target, a perturbed
draft, a different shape, batched with requests joining and leaving, int8 target); stops and
length limits hold mid-acceptance; sampled tokens keep the target's distribution (chi-square);
CLI and config errors name the fix."""

from __future__ import annotations

import copy
import dataclasses
import json

import httpx
import numpy as np
import pytest
import torch
from scipy.stats import chi2

from tests.infer.helpers import argmax_loop, model_for
from trainforge.cli import main
from trainforge.infer.engine import Engine, EngineConfig
from trainforge.infer.kv_pool import KVPool
from trainforge.infer.prepare import prepare_model
from trainforge.infer.quantize import quantize_model
from trainforge.infer.runner import ModelRunner
from trainforge.infer.sampling import SamplingParams
from trainforge.infer.speculative import DraftModelDrafter
from trainforge.model import ModelConfig, build_model

GREEDY = SamplingParams(max_new_tokens=24, temperature=0)
PROMPTS = [[5, 17, 300, 42], list(range(1, 38)), [7], [99, 98, 97, 96, 95, 94, 93, 92, 91, 90, 89]]


def perturbed(model, scale: float, seed: int = 1):
    """A copy with noise of ``scale`` x each weight's std: a draft that agrees with the target
    often but not always (scale 0.1 accepts about half of the first drafts on gqa2)."""
    draft = copy.deepcopy(model)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in draft.parameters():
            p.add_(scale * p.std() * torch.randn(p.shape, generator=gen))
    return draft


def spec_engine(target, draft, k=3, **kw):
    cfg = EngineConfig(**{"max_batch_size": 3, "block_size": 8, "max_context": 128, "num_speculative_tokens": k, **kw})
    return Engine(target, cfg, drafter=DraftModelDrafter(draft))


@pytest.fixture(scope="module")
def gqa2():
    target = model_for("gqa2")
    return target, [argmax_loop(target, p, GREEDY.max_new_tokens) for p in PROMPTS]


# -- the verification forward and rollback ----------------------------------------------------

def test_verify_forward_equals_sequential_decode_steps():
    """k + 1 tokens per row in one forward (PagedCache.set_verify) give the logits of k + 1
    one-token decode steps, rows of different lengths together; tolerance 1e-5."""
    model = model_for("gqa4")
    bs, T, prompts = 4, 4, [list(range(3, 14)), [7, 8]]
    pool = KVPool(3, 2, 16, 32, bs)
    runner = ModelRunner(model, pool, 2, 64, lookahead=T - 1)
    for i, p in enumerate(prompts):
        pool.add(i, 40)
        runner.prefill(torch.tensor(p), torch.tensor(pool.append_slots(i, len(p))))
    new = torch.tensor([[11, 22, 33, 44], [55, 66, 77, 88]])
    lengths = [len(p) for p in prompts]
    S = 24

    def layout(n_new):  # gather / bias for each row holding its prompt + n_new tokens
        for r in range(2):
            table = pool.table(r)
            index = np.concatenate([np.arange(b * bs, (b + 1) * bs) for b in table] + [np.arange(S)])[:S]
            runner.gather[r * S:(r + 1) * S] = torch.from_numpy(index)
            runner.bias[r * S:(r + 1) * S] = torch.where(torch.arange(S) < lengths[r] + n_new, 0.0, float("-inf"))

    slots = [pool.append_slots(r, T) for r in range(2)]
    runner.slots[:2 * T] = torch.tensor(slots).view(-1)
    layout(T)
    positions = torch.tensor(lengths)[:, None] + torch.arange(T)
    verified = runner.verify(new, positions, S).clone()  # (2, T, V)
    assert runner.decoder is not None  # the sequential reference is the engine's fast float32 step
    stepped = []
    for j in range(T):
        runner.tokens[:2], runner.positions[:2] = new[:, j], positions[:, j]
        runner.slots[:2] = torch.tensor([slots[0][j], slots[1][j]])
        layout(j + 1)
        stepped.append(runner.decode(2, S).clone())
    torch.testing.assert_close(verified, torch.stack(stepped, 1), atol=1e-5, rtol=1e-5)


def test_rollback_returns_pages_and_keeps_the_reservation():
    pool = KVPool(1, 1, 4, 12, 4)
    pool.add(0, 30)  # 8 blocks reserved
    pool.append_slots(0, 10)
    free0 = len(pool._free)
    pool.append_slots(0, 9)  # 19 tokens: 5 blocks
    assert len(pool._free) == free0 - 2
    assert pool.truncate(0, 11) == 2 and pool.length(0) == 11
    assert len(pool._free) == free0 and len(pool.table(0)) == 3
    assert pool.utilisation()["blocks_reserved"] == 8  # rolled-back blocks stay promised to the sequence
    assert pool.append_slots(0, 19)[-1] // 4 in pool.table(0)  # it grows to its reservation again
    pool.free(0)
    assert pool.blocks_used == 0 and len(pool._free) == 11
    pool.add(1, 8)
    with pytest.raises(ValueError, match="it holds 0"):
        pool.truncate(1, 1)


def test_rollback_keeps_each_row_at_its_accepted_length(gqa2):
    """After every step a row's pool length is its accepted length and its blocks are just
    those it needs; decoding after the rollbacks still equals plain greedy decoding."""
    target, want = gqa2
    engine = spec_engine(target, perturbed(target, 0.1))
    reqs = [engine.submit(p, GREEDY) for p in PROMPTS]
    rolled_back = False
    while engine.has_work():
        engine.step()
        for req in engine._rows:
            n = engine.pool.length(req.id)
            assert n == engine.layout.pos[req.row] == len(req.prompt_ids) + len(req.output_ids) - 1
            assert len(engine.pool.table(req.id)) == engine.pool.blocks_for(n)
        stats = engine.stats()
        rolled_back |= stats["spec_accepted_tokens"] < stats["spec_drafted_tokens"]
    assert rolled_back and [r.output_ids for r in reqs] == want
    assert engine.pool.blocks_used == 0


# -- greedy: identical to plain decoding ------------------------------------------------------

@pytest.mark.parametrize("draft_kind", ["same", "perturbed", "other_shape"])
def test_greedy_output_is_identical_to_plain_decoding(gqa2, draft_kind):
    target, want = gqa2
    if draft_kind == "same":
        draft = model_for("gqa2")
    elif draft_kind == "perturbed":
        draft = perturbed(target, 0.1)
    else:  # a smaller model with the same vocabulary
        cfg = ModelConfig(dim=32, n_layers=1, n_heads=2, n_kv_heads=1, vocab_size=512, ffn_hidden_dim=64,
                          max_seq_len=256)
        draft = build_model(cfg, seed=3).eval()
    engine = spec_engine(target, draft)
    assert [r.output_ids for r in engine.generate(PROMPTS, GREEDY)] == want
    s = engine.stats()
    rate = s["spec_accepted_tokens"] / s["spec_drafted_tokens"]
    if draft_kind == "same":
        assert s["spec_acceptance_rate"] == [1.0, 1.0, 1.0] and s["spec_mean_accepted_length"] == 4.0
    elif draft_kind == "perturbed":
        assert 0.2 < rate < 0.9 and 1.0 < s["spec_mean_accepted_length"] < 4.0
    assert s["spec_acceptance_rate"] == sorted(s["spec_acceptance_rate"], reverse=True)


def test_continuous_batching_with_per_row_acceptance(gqa2):
    """Six requests of different budgets through three rows: rows accept different numbers
    of drafts per step, join and leave at step boundaries; each equals decoding it alone."""
    target, _ = gqa2
    params = [SamplingParams(max_new_tokens=n, temperature=0) for n in (30, 9, 21, 4, 17, 12)]
    prompts = PROMPTS + [[1, 2], list(range(200, 260))]
    want = [argmax_loop(target, p, sp.max_new_tokens) for p, sp in zip(prompts, params)]
    engine = spec_engine(target, perturbed(target, 0.1), k=4)
    got = engine.generate(prompts, params)
    assert [r.output_ids for r in got] == want
    assert engine.stats()["peak_batch"] == 3 and engine.pool.blocks_used == 0


def test_greedy_and_sampled_rows_share_a_batch(gqa2):
    """A sampled row makes the step compute distributions; a greedy row beside it still gets
    plain greedy output (its one-hot p and q reduce the rule to argmax agreement), and a
    seeded sampled row reproduces itself."""
    target, want = gqa2
    sampled = SamplingParams(max_new_tokens=24, temperature=0.8, top_k=40, top_p=0.9, seed=3)
    runs = [spec_engine(target, perturbed(target, 0.1)).generate(PROMPTS[:2], [GREEDY, sampled]) for _ in range(2)]
    assert runs[0][0].output_ids == want[0]
    assert runs[0][1].output_ids == runs[1][1].output_ids != want[1]


def test_a_request_filling_the_whole_context(gqa2):
    """prompt + max_new_tokens = max_seq_len: the last steps' drafts run past the model's
    context (their positions are clamped; they are never emitted) and the output is unchanged."""
    target = gqa2[0]
    prompt = [(7 * i) % 500 + 1 for i in range(250)]
    engine = Engine(target, EngineConfig(max_batch_size=1, block_size=16, num_speculative_tokens=4),
                    drafter=DraftModelDrafter(model_for("gqa2")))
    assert engine.max_context == target.cfg.max_seq_len == 256
    out = engine.generate([prompt], SamplingParams(max_new_tokens=6, temperature=0))[0].output_ids
    assert out == argmax_loop(target, prompt, 6)


def test_stops_and_length_limits_hold_mid_acceptance(gqa2):
    """A draft = target accepts every draft, so a step emits k + 1 tokens: a stop token or the
    length limit inside them ends the output there."""
    target, want = gqa2
    stop = want[0][6]
    first = want[0].index(stop)
    reqs = spec_engine(target, model_for("gqa2")).generate(
        [PROMPTS[0], PROMPTS[0]], [SamplingParams(max_new_tokens=24, temperature=0, stop_token_ids=(stop,)),
                                   SamplingParams(max_new_tokens=7, temperature=0)])
    assert reqs[0].output_ids == want[0][:first] and reqs[0].finish_reason == "stop"
    assert reqs[1].output_ids == want[0][:7] and reqs[1].finish_reason == "length"


@pytest.mark.parametrize("mode, kernel", [("int8", "int8pack"), ("int4", "reference")])
def test_quantised_target(gqa2, mode, kernel):
    """Quantised linears are module swaps, so the verification forward runs them as the plain
    step does. Weight-only kernels compute each row alone, so the output is identical to plain
    decoding. (fbgemm's int8 kernel quantises activations with one scale per batch, so its plain
    decoding already changes with the batch; there speculation keeps the distribution, not the
    tokens.)"""
    target = copy.deepcopy(gqa2[0])
    quantize_model(target, mode, group_size=32, pack=False)
    prepare_model(target, quant_kernel=kernel)
    plain = Engine(target, EngineConfig(max_batch_size=1, block_size=8, max_context=128))
    want = [plain.generate([p], GREEDY)[0].output_ids for p in PROMPTS]
    engine = spec_engine(target, perturbed(gqa2[0], 0.1))
    assert [r.output_ids for r in engine.generate(PROMPTS, GREEDY)] == want
    assert set(engine.kernels) == {kernel} and engine.stats()["spec_accepted_tokens"] > 0


# -- sampling keeps the target's distribution -------------------------------------------------

TINY = ModelConfig(dim=32, n_layers=1, n_heads=2, n_kv_heads=1, vocab_size=8, ffn_hidden_dim=64, max_seq_len=32)


def exact_marginals(model, prompt: list[int], params: SamplingParams) -> np.ndarray:
    """(3, V): the exact distributions of generated tokens 1, 2, 3 under ``params``
    (temperature, top-k), summing over every path (V^2 sequences for token 3)."""
    V = model.cfg.vocab_size

    def dist(seqs):  # next-token sampling distribution after each sequence, (N, V)
        logits = model(torch.tensor(seqs))[:, -1].double() / params.temperature
        if params.top_k:
            kth = logits.topk(params.top_k, -1).values[:, -1:]
            logits = logits.masked_fill(logits < kth, float("-inf"))
        return logits.softmax(-1).numpy()

    with torch.no_grad():
        p1 = dist([prompt])[0]
        p2 = dist([prompt + [a] for a in range(V)])  # (V, V): row a = P(t2 | t1 = a)
        p3 = dist([prompt + [a, b] for a in range(V) for b in range(V)]).reshape(V, V, V)
    joint12 = p1[:, None] * p2
    return np.stack([p1, joint12.sum(0), (joint12[:, :, None] * p3).sum((0, 1))])


def chi_square(counts: np.ndarray, probs: np.ndarray) -> tuple[float, int]:
    """Pearson's statistic and degrees of freedom, cells with expected count < 5 pooled."""
    expected = probs * counts.sum()
    small = expected < 5
    obs = np.append(counts[~small], counts[small].sum())
    exp = np.append(expected[~small], expected[small].sum())
    keep = exp > 0
    return float(((obs[keep] - exp[keep]) ** 2 / exp[keep]).sum()), int(keep.sum()) - 1


@pytest.mark.parametrize("params", [SamplingParams(max_new_tokens=3, temperature=1.0, ignore_eos=True),
                                    SamplingParams(max_new_tokens=3, temperature=0.7, top_k=5, ignore_eos=True)])
def test_speculative_sampling_keeps_the_target_distribution(params):
    """1200 seeded requests, k = 2 (tokens 2 and 3 come from one speculative step: accepted
    drafts, residual draws and bonus tokens). Their frequencies pass a chi-square test against
    the target's exact distribution at significance 1e-3 per token (a correct implementation
    fails one of the 2 checks with probability < 2e-3; seeds are fixed, so the outcome is
    deterministic), and fail it against the draft's distribution (the test has power)."""
    target = build_model(TINY, seed=0).eval()
    draft = build_model(TINY, seed=5).eval()
    with torch.no_grad():  # spread-out but distinct distributions
        for m in (target, draft):
            m.output.weight.mul_(3.0)
    prompt, n = [1, 2, 3], 1200
    want, drafted = exact_marginals(target, prompt, params), exact_marginals(draft, prompt, params)
    engine = Engine(target, EngineConfig(max_batch_size=64, max_queue=n, block_size=4, max_context=16,
                                         num_speculative_tokens=2), drafter=DraftModelDrafter(draft))
    reqs = engine.generate([prompt] * n, [dataclasses.replace(params, seed=i) for i in range(n)])
    out = np.array([r.output_ids for r in reqs])  # (n, 3)
    assert 0.2 < engine.stats()["spec_acceptance_rate"][0] < 0.9  # both branches of the rule ran
    for t in (1, 2):
        counts = np.bincount(out[:, t], minlength=TINY.vocab_size)
        stat, df = chi_square(counts, want[t])
        assert stat < chi2.ppf(1 - 1e-3, df), (t, counts, want[t] * n)
        stat_draft, df = chi_square(counts, drafted[t])
        assert stat_draft > chi2.ppf(1 - 1e-3, df)


def test_server_metrics_carry_the_speculation_counters(gqa2):
    from prometheus_client import CollectorRegistry, generate_latest

    from trainforge.infer.server import engine_record
    from trainforge.monitor.registry import Registry
    from trainforge.monitor.sinks import RegistryCollector, read_exposition

    target = gqa2[0]
    engine = spec_engine(target, model_for("gqa2"), k=2)
    engine.generate(PROMPTS[:2], GREEDY)
    reg = Registry(rank=0)
    reg.ingest(engine_record(engine))
    cr = CollectorRegistry(auto_describe=False)
    cr.register(RegistryCollector(reg))
    m = read_exposition(generate_latest(cr).decode())
    drafted = engine.stats()["spec_drafted_tokens"]
    assert m["trainforge_speculative_drafted_tokens_total"] == drafted > 0
    assert m["trainforge_speculative_accepted_tokens_total"] == drafted  # the draft is the target
    assert m['trainforge_speculative_acceptance_ratio{position="0"}'] == 1.0
    assert m['trainforge_speculative_acceptance_ratio{position="1"}'] == 1.0
    assert m["trainforge_speculative_mean_accepted_length"] == 3.0


# -- configuration and CLI errors -------------------------------------------------------------

def test_engine_refuses_what_it_cannot_speculate(gqa2):
    target = gqa2[0]
    other_vocab = build_model(dataclasses.replace(TINY, max_seq_len=256), seed=0)
    with pytest.raises(ValueError, match="vocab_size 8 differs from the target's 512"):
        spec_engine(target, other_vocab)
    short = build_model(dataclasses.replace(target.cfg, max_seq_len=64), seed=0)
    with pytest.raises(ValueError, match="max_seq_len 64 is shorter"):
        spec_engine(target, short)
    with pytest.raises(ValueError, match="num_speculative_tokens 0: must be an integer >= 1"):
        spec_engine(target, target, k=0)
    with pytest.raises(ValueError, match="drop --compile or --speculative"):
        spec_engine(target, target, compile=True)
    with pytest.raises(ValueError, match="repetition_penalty=1.2: not supported"):
        spec_engine(target, target).submit([1, 2], SamplingParams(repetition_penalty=1.2))


@pytest.mark.parametrize("args, message", [
    (["--speculative", "draft:"], "give one of draft:CHECKPOINT, mtp"),
    (["--speculative", "medusa"], "give one of draft:CHECKPOINT, mtp"),
    (["--speculative", "draft:x", "--num_speculative_tokens", "0"], "--num_speculative_tokens 0: must be"),
])
@pytest.mark.parametrize("command", ["generate", "serve"])
def test_cli_errors_name_the_option(capsys, tmp_path, command, args, message):
    extra = ["--prompt_ids", "1,2"] if command == "generate" else []
    assert main([command, "--checkpoint", str(tmp_path / "missing"), *extra, *args]) == 2
    assert message in capsys.readouterr().err


def test_cli_generate_with_a_draft_checkpoint(tmp_path, capsys):
    """``generate --speculative draft:DIR`` prints what plain ``generate`` prints, and its
    --stats carry the speculation counters."""
    from tests.infer.test_loading import write_hf_dir

    target = write_hf_dir(tmp_path / "target", model_for("gqa2"))
    draft = write_hf_dir(tmp_path / "draft", perturbed(model_for("gqa2"), 0.1))
    base = ["generate", "--checkpoint", str(target), "--prompt_ids", "5,17,300,42", "--print_ids", "--temperature",
            "0", "--max_new_tokens", "12", "--ignore_eos"]
    assert main(base) == 0
    plain = capsys.readouterr().out
    assert main(base + ["--speculative", f"draft:{draft}", "--num_speculative_tokens", "2", "--stats"]) == 0
    captured = capsys.readouterr()
    assert captured.out == plain and len(plain.split(",")) == 12
    assert '"spec_acceptance_rate": [' in captured.err and '"spec_mean_accepted_length"' in captured.err


def test_server_streams_speculative_output_and_exports_its_metrics(small_data):
    """``serve --speculative``: a streamed greedy completion equals the plain engine's text,
    and /metrics carries the speculation counters."""
    from tests.infer.test_server import serving, tiny_model
    from trainforge.data.tokenizer import eos_id, load_tokenizer
    from trainforge.infer.server import ServerConfig
    from trainforge.monitor.sinks import read_exposition

    tok = load_tokenizer(small_data / "tokenizer.json")
    V, prompt = tok.get_vocab_size(), "def main(argv):\n"
    params = SamplingParams(max_new_tokens=20, temperature=0, ignore_eos=True)
    want = Engine(tiny_model(V), EngineConfig(max_batch_size=1, max_context=128), tokenizer=tok).generate(
        [tok.encode(prompt).ids], params)[0].text
    engine = Engine(tiny_model(V), EngineConfig(max_batch_size=2, max_context=128, block_size=8,
                                                num_speculative_tokens=3), tokenizer=tok, eos_ids=(eos_id(tok),),
                    drafter=DraftModelDrafter(perturbed(tiny_model(V), 0.1)))
    with serving(engine, tok, ServerConfig(model_name="tiny")) as url:
        text = ""
        with httpx.stream("POST", url + "/v1/completions", timeout=60, json={
                "prompt": prompt, "max_tokens": 20, "temperature": 0, "stream": True, "ignore_eos": True}) as r:
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    text += json.loads(line[6:])["choices"][0]["text"]
        metrics = read_exposition(httpx.get(url + "/metrics").text)
    assert text == want
    assert metrics["trainforge_speculative_drafted_tokens_total"] > 0
    assert 'trainforge_speculative_acceptance_ratio{position="2"}' in metrics
