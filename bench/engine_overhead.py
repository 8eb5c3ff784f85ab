"""The engine's own cost per step, with the model's forward taken out, for A/B runs of two
trees (``bench/ab_worktree.py --script_root``):

    python bench/engine_overhead.py --json out.json

The runner's ``decode`` (and its prefill) is replaced by a function that returns fixed logits,
so what is timed is the engine around it: scheduling, the batch layout, sampling, reading
tokens, stop checks, rows leaving. Reported in microseconds of this process's CPU time per decode step (lower is
better), for one request and for a batch of 32 joining and leaving, best of ``--repeats``.
On a shared machine the end-to-end probe (``bench/engine_speed.py``) moves by more than the
engine's share of a step; this isolates that share. Uses only APIs old trees have too.
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from trainforge.infer.engine import Engine, EngineConfig
from trainforge.infer.sampling import SamplingParams
from trainforge.model import FLAVORS, build_model


def stubbed(engine: Engine) -> Engine:
    V = engine.model.cfg.vocab_size
    logits = torch.randn(engine.config.max_batch_size, V, generator=torch.Generator().manual_seed(0))
    engine.runner.decode = lambda B, S: logits[:B]
    engine.runner.prefill = lambda tokens, slots, *a, **k: logits[:1]
    engine.runner.prefill_packed = lambda tokens, slots, lengths: logits[:len(lengths)]
    return engine


def us_per_step(engine: Engine, prompts: list[list[int]], params: SamplingParams, repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats + 1):  # the first is a warm-up
        steps0, c0 = engine.counters["decode_steps"], time.process_time()
        engine.generate(prompts, params)
        best = min(best, (time.process_time() - c0) / (engine.counters["decode_steps"] - steps0) * 1e6)
    return best


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=400)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--json", required=True)
    a = p.parse_args()
    torch.set_num_threads(1)
    cfg = FLAVORS["tiny"]
    model = build_model(cfg, seed=0).eval().requires_grad_(False)
    params = SamplingParams(max_new_tokens=a.steps, temperature=0, ignore_eos=True)
    out = {}
    with torch.no_grad():
        one = stubbed(Engine(model, EngineConfig(max_batch_size=1, max_queue=1, max_context=a.steps + 8)))
        out["batch1_us_per_step"] = us_per_step(one, [[1, 2, 3]], params, a.repeats)
        many = stubbed(Engine(model, EngineConfig(max_batch_size=32, max_queue=64, max_context=a.steps + 8)))
        budgets = [SamplingParams(max_new_tokens=a.steps // 4 + 3 * i, temperature=0, ignore_eos=True)
                   for i in range(48)]
        out["batch32_us_per_step"] = us_per_step(many, [[1 + i, 2, 3] for i in range(48)], budgets, a.repeats)
    with open(a.json, "w") as f:
        json.dump(out, f)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
