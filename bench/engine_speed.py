"""A short engine speed probe, for A/B runs of two trees (``bench/ab_worktree.py``).

    python bench/engine_speed.py --size 90m --json out.json

The engine's batch-1 decode tok/s for fp32, int8 and int4 (fused, quantised in memory),
continuous batching of 32 requests (generated tok/s), and optionally Hugging Face
``generate()`` (``--hf``), on seeded random weights. Each number is the best of ``--repeats``
runs (after a warm-up): on a shared machine the fastest run is the one least disturbed.
Beside each wall-clock rate, ``*_cpu_tok_s`` counts tokens per second of this process's CPU
time over the whole request (prefill included): with ``--threads 1`` it does not move when
other processes take the cores in turn, which makes A/B ratios on a shared machine usable.
``bench/inference.py`` is the full benchmark; this probe runs in a minute so that many
interleaved rounds fit. It uses only APIs that trees before the one-forward redesign also
have (the engine fused its model itself there; ``prepare_model`` does it now).
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import time

import numpy as np
import torch

from trainforge.infer.engine import Engine, EngineConfig
from trainforge.infer.quantize import quantize_model
from trainforge.infer.sampling import SamplingParams
from trainforge.model import FLAVORS, build_model

try:
    from trainforge.infer.prepare import prepare_model
except ImportError:  # a tree before the redesign: Engine fuses and packs itself
    def prepare_model(model):
        return model

SIZES = {"tiny": FLAVORS["tiny"], "90m": dataclasses.replace(FLAVORS["small"], vocab_size=8192)}


def decode_tok_s(engine: Engine, prompt: list[int], n: int) -> tuple[float, float]:
    """(decode tok/s by the wall clock, tokens per CPU second of the whole request)."""
    c0 = time.process_time()
    req = engine.generate([prompt], SamplingParams(max_new_tokens=n, temperature=0, ignore_eos=True))[0]
    return (n - 1) / (req.finished_s - req.first_token_s), n / (time.process_time() - c0)


def best(fn, repeats: int) -> tuple[float, float]:
    fn()  # warm-up
    runs = [fn() for _ in range(repeats)]
    return max(r[0] for r in runs), max(r[1] for r in runs)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--size", default="tiny", choices=list(SIZES))
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--new_tokens", type=int, default=32)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--batch_new_tokens", type=int, default=16)
    p.add_argument("--hf", action="store_true", help="also Hugging Face generate()")
    p.add_argument("--json", required=True)
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    cfg = SIZES[a.size]
    base = build_model(cfg, seed=0).eval().requires_grad_(False)
    prompt = torch.randint(0, cfg.vocab_size, (16,), generator=torch.Generator().manual_seed(1)).tolist()
    ctx = 16 + a.new_tokens
    out: dict[str, float] = {}
    group = next(g for g in (128, 64, 32) if cfg.dim % g == 0 and cfg.ffn_hidden_dim % g == 0)
    models = {"fp32": copy.deepcopy(base)}
    for mode, kw in (("int8", {}), ("int4", {"group_size": group})):
        models[mode] = copy.deepcopy(base)
        quantize_model(models[mode], mode, pack=False, **kw)
    with torch.no_grad():
        engines = {k: Engine(prepare_model(m), EngineConfig(max_batch_size=1, max_queue=1, max_context=ctx))
                   for k, m in models.items()}
        for k, e in engines.items():
            out[f"{k}_tok_s"], out[f"{k}_cpu_tok_s"] = best(lambda: decode_tok_s(e, prompt, a.new_tokens), a.repeats)
        rng = np.random.default_rng(a.batch)
        prompts = [rng.integers(0, cfg.vocab_size, int(rng.integers(8, 49))).tolist() for _ in range(a.batch)]
        params = SamplingParams(max_new_tokens=a.batch_new_tokens, temperature=0, ignore_eos=True)
        batched = Engine(models["fp32"], EngineConfig(max_batch_size=a.batch, max_queue=a.batch,
                                                      max_context=48 + a.batch_new_tokens))

        def run_batched() -> tuple[float, float]:
            t0, c0 = time.perf_counter(), time.process_time()
            batched.generate(prompts, params)
            n = a.batch * a.batch_new_tokens
            return n / (time.perf_counter() - t0), n / (time.process_time() - c0)
        out[f"batch{a.batch}_tok_s"], out[f"batch{a.batch}_cpu_tok_s"] = best(run_batched, max(1, a.repeats - 1))
        if a.hf:
            import transformers

            from trainforge.model.hf import to_hf_config_dict, to_hf_state_dict

            hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(**to_hf_config_dict(cfg),
                                                                        attn_implementation="sdpa")).eval()
            hf.load_state_dict(to_hf_state_dict(base.state_dict(), cfg), strict=True)

            def run_hf() -> tuple[float, float]:
                stamps: list[float] = []
                c0 = time.process_time()

                class Stamp(transformers.StoppingCriteria):
                    def __call__(self, input_ids, scores, **kwargs):
                        stamps.append(time.perf_counter())
                        return torch.zeros(input_ids.shape[0], dtype=torch.bool)
                hf.generate(torch.tensor([prompt]), max_new_tokens=a.new_tokens, min_new_tokens=a.new_tokens,
                            do_sample=False, stopping_criteria=[Stamp()], pad_token_id=0, eos_token_id=None)
                return (a.new_tokens - 1) / (stamps[-1] - stamps[0]), a.new_tokens / (time.process_time() - c0)
            out["hf_tok_s"], out["hf_cpu_tok_s"] = best(run_hf, a.repeats)
            out["fp32_vs_hf"] = out["fp32_tok_s"] / out["hf_tok_s"]
            out["fp32_vs_hf_cpu"] = out["fp32_cpu_tok_s"] / out["hf_cpu_tok_s"]
    with open(a.json, "w") as f:
        json.dump(out, f)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
