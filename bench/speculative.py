"""Speculative decoding (a draft model, or the target's own MTP module) against plain
decoding of the same target: batch 1, temperature 0, through the engine, interleaved.

    OMP_NUM_THREADS=1 python -m bench.speculative                  # random tiny target, random/self drafts
    OMP_NUM_THREADS=1 python -m bench.speculative --target runs/small --draft runs/tiny --k 2 4 --new_tokens 128
    OMP_NUM_THREADS=1 python -m bench.speculative --speculative mtp --k 1 2 3   # tiny + MTP, trained here briefly
    OMP_NUM_THREADS=1 python -m bench.speculative --speculative mtp --target runs/tiny_mtp  # model.mtp_depth >= 1

Without checkpoints the target is the ``tiny`` flavor and the drafts are a random ``debug``
shape with tiny's vocabulary (acceptance near 0: random models disagree, so this measures
the cost of speculation that fails) and the target drafting for itself (acceptance 1: the
most a draft of the target's cost can give). Figures that mean something need a trained
pair sharing a tokenizer, e.g. ``trainforge train`` of ``--model.flavor tiny`` and ``small``
on the same prepared data, passed as ``--target`` / ``--draft`` (checkpoint or run
directories; the prompts are then text from ``--prompts``).

``--speculative mtp`` drafts with the target's MTP module (``infer/mtp_drafter.py``). Without
``--target`` the target is ``tiny`` with ``mtp_depth`` 1 trained here for ``--train_steps``
on a synthetic Markov chain over 64 tokens (each followed by one of two, 0.9 / 0.1; the
prompts are drawn from it): a random MTP module would accept nothing, and a trained
checkpoint takes hours on this CPU. The figures then show the machinery's cost at a high
acceptance, not a language model's acceptance; pass a checkpoint trained with
``--model.mtp_depth 1`` for that.

Per draft and k: each round decodes every prompt plainly and speculatively, in an order
that alternates between rounds; decode tok/s = (n - 1) / (last token - first token) of the
request (prefill excluded). The ratio is paired within a round (same prompts, same moment
of machine load) and summarised by median and IQR over rounds. Acceptance: the engine's
``spec_acceptance_rate`` (per draft position) and ``spec_mean_accepted_length`` (tokens per
target forward) over all rounds. Output identity with plain greedy decoding is checked on
every request. A benchmark, not a test: it prints a table (and ``--json``) and exits 0.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import time

import torch

import torch.nn.functional as F

from trainforge.infer.engine import Engine, EngineConfig
from trainforge.infer.mtp_drafter import MTPDrafter, check_mtp_model
from trainforge.infer.prepare import prepare_model
from trainforge.infer.sampling import SamplingParams
from trainforge.infer.speculative import DraftModelDrafter
from trainforge.model import FLAVORS, build_model

TEXT_PROMPTS = ["def ", "The ", "import numpy as np\n", "class Model:\n    def __init__(self"]


def random_pair(max_seq_len: int) -> tuple[torch.nn.Module, dict[str, torch.nn.Module], None]:
    target = build_model(dataclasses.replace(FLAVORS["tiny"], max_seq_len=max_seq_len), seed=0)
    small = dataclasses.replace(FLAVORS["debug"], vocab_size=FLAVORS["tiny"].vocab_size, max_seq_len=max_seq_len)
    drafts = {"debug (random)": build_model(small, seed=1), "self": build_model(target.cfg, seed=0)}
    return prepare_model(target.eval()), {k: prepare_model(m.eval()) for k, m in drafts.items()}, None


def loaded_pair(target: str, draft: str) -> tuple[torch.nn.Module, dict[str, torch.nn.Module], object]:
    from trainforge.infer.loading import load_model

    t, d = load_model(target), load_model(draft)
    return prepare_model(t.model), {d.name: prepare_model(d.model)}, t.tokenizer


class MarkovChain:
    """Tokens 0..n-1 of a vocabulary, each followed by one of two tokens (0.9 / 0.1)."""

    def __init__(self, n: int, seed: int = 0):
        gen = torch.Generator().manual_seed(seed)
        self.n, self.succ, self.gen = n, torch.stack([torch.randperm(n, generator=gen)[:2] for _ in range(n)]), gen

    def sample(self, rows: int, T: int) -> torch.Tensor:
        x = torch.empty(rows, T, dtype=torch.long)
        x[:, 0] = torch.randint(self.n, (rows,), generator=self.gen)
        for t in range(1, T):
            x[:, t] = self.succ[x[:, t - 1], (torch.rand(rows, generator=self.gen) > 0.9).long()]
        return x


def trained_mtp_target(max_seq_len: int, steps: int, chain: MarkovChain) -> torch.nn.Module:
    """``tiny`` with one MTP depth, trained on ``chain`` (main + MTP cross-entropy, AdamW)."""
    model = build_model(dataclasses.replace(FLAVORS["tiny"], max_seq_len=max_seq_len, mtp_depth=1), seed=0)
    opt = torch.optim.AdamW(model.parameters(), lr=2e-3)
    t0 = time.perf_counter()
    for step in range(steps):
        x = chain.sample(8, 65)
        logits, (mtp1,) = model(x[:, :-1], mtp=True)
        loss = F.cross_entropy(logits.flatten(0, 1), x[:, 1:].flatten())
        mtp_loss = F.cross_entropy(mtp1.flatten(0, 1), x[:, 2:].flatten())
        opt.zero_grad()
        (loss + mtp_loss).backward()
        opt.step()
    print(f"trained tiny + MTP for {steps} steps in {time.perf_counter() - t0:.0f} s: loss {loss.item():.3f}, "
          f"mtp_loss {mtp_loss.item():.3f}")
    return prepare_model(model.eval())


def decode_tok_s(req) -> float:
    return (len(req.output_ids) - 1) / (req.finished_s - req.first_token_s)


def bench(target, make_drafter, k: int, prompts: list[list[int]], n: int, rounds: int) -> dict:
    ctx = max(map(len, prompts)) + n
    params = SamplingParams(max_new_tokens=n, temperature=0, ignore_eos=True)
    plain = Engine(target, EngineConfig(max_batch_size=1, max_context=ctx))
    spec = Engine(target, EngineConfig(max_batch_size=1, max_context=ctx, num_speculative_tokens=k),
                  drafter=make_drafter())
    ratios, plain_tps, spec_tps, identical = [], [], [], True
    for r in range(rounds):
        for prompt in prompts:
            out = {}
            for name in (("plain", "spec") if r % 2 == 0 else ("spec", "plain")):
                engine = plain if name == "plain" else spec
                out[name] = engine.generate([prompt], params)[0]
            identical &= out["plain"].output_ids == out["spec"].output_ids
            p, s = decode_tok_s(out["plain"]), decode_tok_s(out["spec"])
            plain_tps.append(p)
            spec_tps.append(s)
            ratios.append(s / p)
    q = statistics.quantiles(ratios, n=4) if len(ratios) > 1 else [ratios[0]] * 3
    st = spec.stats()
    return {"k": k, "plain_tok_s": statistics.median(plain_tps), "spec_tok_s": statistics.median(spec_tps),
            "ratio_median": q[1], "ratio_iqr": [q[0], q[2]], "samples": len(ratios), "identical": identical,
            "acceptance_rate": st["spec_acceptance_rate"], "mean_accepted_length": st["spec_mean_accepted_length"]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--target", default=None, help="target checkpoint or run directory (default: random tiny)")
    p.add_argument("--draft", default=None, help="draft checkpoint or run directory (with --target)")
    p.add_argument("--speculative", choices=("draft", "mtp"), default="draft",
                   help="draft: a draft model drafts; mtp: the target's own MTP module")
    p.add_argument("--train_steps", type=int, default=100, help="mtp without --target: training steps")
    p.add_argument("--k", type=int, nargs="+", default=[2, 4], help="num_speculative_tokens values")
    p.add_argument("--new_tokens", type=int, default=48)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--prompts", nargs="+", default=TEXT_PROMPTS, help="text prompts (with checkpoints)")
    p.add_argument("--json", default=None, help="also write every number here")
    a = p.parse_args()
    if a.speculative == "draft" and (a.target is None) != (a.draft is None):
        p.error("give both --target and --draft, or neither (random models)")
    torch.set_num_threads(a.threads)
    chain = None
    if a.speculative == "mtp":
        if a.target:
            from trainforge.infer.loading import load_model

            loaded = load_model(a.target)
            check_mtp_model(loaded.model.cfg)
            target, tok = prepare_model(loaded.model), loaded.tokenizer
        else:
            chain = MarkovChain(64)
            target, tok = trained_mtp_target(512, a.train_steps, chain), None
        drafters = {"mtp": MTPDrafter}
    else:
        if a.target:
            target, drafts, tok = loaded_pair(a.target, a.draft)
        else:
            target, drafts, tok = random_pair(max_seq_len=512)
        drafters = {name: (lambda d=d: DraftModelDrafter(d)) for name, d in drafts.items()}
    if tok is not None:
        prompts = [tok.encode(t).ids for t in a.prompts]
    elif chain is not None:
        prompts = [chain.sample(1, n)[0].tolist() for n in (8, 24)]
    else:
        gen = torch.Generator().manual_seed(0)
        prompts = [torch.randint(0, target.cfg.vocab_size, (n,), generator=gen).tolist() for n in (8, 24)]
    print(f"target {target.cfg.dim}d x {target.cfg.n_layers} layers; batch 1, temperature 0, {a.new_tokens} new "
          f"tokens, {len(prompts)} prompts x {a.rounds} rounds, {a.threads} thread(s)")
    head = f"{'draft':<18} {'k':>2} {'plain tok/s':>11} {'spec tok/s':>10} {'ratio (IQR)':>20} " \
           f"{'mean len':>8}  acceptance per position  identical"
    print(head)
    results = []
    for name, make_drafter in drafters.items():
        for k in a.k:
            t0 = time.perf_counter()
            r = {"draft": name, **bench(target, make_drafter, k, prompts, a.new_tokens, a.rounds),
                 "wall_s": time.perf_counter() - t0}
            results.append(r)
            iqr = f"{r['ratio_median']:.2f} ({r['ratio_iqr'][0]:.2f}-{r['ratio_iqr'][1]:.2f})"
            acc = " ".join(f"{x:.2f}" for x in r["acceptance_rate"])
            print(f"{name:<18} {k:>2} {r['plain_tok_s']:>11.1f} {r['spec_tok_s']:>10.1f} {iqr:>20} "
                  f"{r['mean_accepted_length']:>8.2f}  {acc:<23}  {r['identical']}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
