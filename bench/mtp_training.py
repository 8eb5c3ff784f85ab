"""Training step time with multi-token prediction (one MTP depth, lambda 0.3) against the
same model without it, in the same process, alternating.

    OMP_NUM_THREADS=1 python -m bench.mtp_training --flavor dsv3-tiny --samples 20

Both models start from the same seed (the main weights are identical: the MTP module is
built after them), train on the same random batches (``--batch`` x ``--seq_len`` tokens of
the flavor's vocabulary) with AdamW, and each sample is ``--steps`` optimizer steps of one of
them: forward, the loss (``train/mtp_loss.py``'s ``MTPLoss`` for the MTP model, plain
cross-entropy for the other), backward, clip, step. Samples alternate A B B A ... and the
ratio time(MTP) / time(plain) is paired per sample pair; its median and IQR are the
result, beside the analytic ratio of training FLOPs per token (``ModelConfig.flops_per_token``).
The validation-loss comparison needs real training: the trainforge CLI runs recorded in
docs/benchmarks-archive.md. A benchmark, not a test: it prints a line (and ``--json``) and exits 0.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import time

import torch
import torch.nn.functional as F

from trainforge.model import FLAVORS, build_model
from trainforge.train.mtp_loss import MTPLoss
from trainforge.train.section import TrainingSection


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--flavor", default="dsv3-tiny")
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq_len", type=int, default=256)
    p.add_argument("--steps", type=int, default=2, help="optimizer steps per sample")
    p.add_argument("--samples", type=int, default=20, help="samples per model")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--json", default=None)
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    cfgs = {"plain": dataclasses.replace(FLAVORS[a.flavor], mtp_depth=0),
            "mtp": dataclasses.replace(FLAVORS[a.flavor], mtp_depth=1)}
    models = {k: build_model(c, seed=0) for k, c in cfgs.items()}
    opts = {k: torch.optim.AdamW(m.parameters(), lr=1e-3) for k, m in models.items()}
    tcfg = TrainingSection(seq_len=a.seq_len, batch_size=a.batch)
    tcfg.validate()
    mtp_loss = MTPLoss(1, tcfg)
    gen = torch.Generator().manual_seed(0)
    V = cfgs["plain"].vocab_size

    def train(name: str) -> float:
        model, opt = models[name], opts[name]
        t0 = time.perf_counter()
        for _ in range(a.steps):
            full = torch.randint(0, V, (a.batch, a.seq_len + 1), generator=gen)
            x, y = full[:, :-1], full[:, 1:]
            if name == "mtp":
                loss = mtp_loss(model, model, x, y)
            else:
                loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
        return time.perf_counter() - t0

    train("plain"), train("mtp")  # warm-up
    times: dict[str, list[float]] = {"plain": [], "mtp": []}
    for i in range(a.samples):
        for name in (("plain", "mtp") if i % 2 == 0 else ("mtp", "plain")):
            times[name].append(train(name))
    ratios = [m / p for m, p in zip(times["mtp"], times["plain"])]
    q = statistics.quantiles(ratios, n=4)
    tokens = a.steps * a.batch * a.seq_len
    flops = cfgs["mtp"].flops_per_token(a.seq_len) / cfgs["plain"].flops_per_token(a.seq_len)
    out = {"flavor": a.flavor, "tokens_per_sample": tokens, "samples": a.samples,
           "plain_tok_s": tokens / statistics.median(times["plain"]),
           "mtp_tok_s": tokens / statistics.median(times["mtp"]),
           "time_ratio_median": q[1], "time_ratio_iqr": [q[0], q[2]], "flops_ratio": flops}
    print(f"{a.flavor} batch {a.batch} x {a.seq_len}, {a.samples} paired samples of {a.steps} steps: "
          f"plain {out['plain_tok_s']:.0f} tok/s, MTP {out['mtp_tok_s']:.0f} tok/s; step time MTP / plain "
          f"{q[1]:.3f} (IQR {q[0]:.3f}-{q[2]:.3f}); training FLOPs per token MTP / plain {flops:.3f}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
