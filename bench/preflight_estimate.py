"""How close the preflight memory estimate (``model/preflight.py``) comes to the real peak.

For each (flavor, batch, seq_len) a fresh process builds the model, runs two fp32 AdamW
training steps on random tokens and reports its peak memory: ``torch.cuda.max_memory_allocated``
on CUDA, peak RSS minus the RSS after start-up (torch imported, nothing built) on CPU. The
estimate is what the Trainer's preflight computes for the same shape. Preflight refuses a run
only when the estimate exceeds all available memory, so an estimate within tens of percent
is enough; this script says how far it is on the device at hand.

    python bench/preflight_estimate.py                       # CPU: debug and tiny shapes
    python bench/preflight_estimate.py --device cuda --shapes tiny:8:1024,small:8:1024,small:4:2048
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import resource
import subprocess
import sys


def _rss_now_bytes() -> int:
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def worker(flavor: str, batch: int, seq: int, device: str, vocab: int) -> dict:
    import torch

    from trainforge.model import FLAVORS, build_model
    from trainforge.model.preflight import training_estimate

    cfg = dataclasses.replace(FLAVORS[flavor], vocab_size=vocab, max_seq_len=seq)
    dev = torch.device(device)
    base = _rss_now_bytes()
    model = build_model(cfg, dev, seed=0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    if dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats(dev)
    for _ in range(2):
        x = torch.randint(0, vocab, (batch, seq), device=dev)
        logits = model(x)
        loss = torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), x.flatten())
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
        peak = torch.cuda.max_memory_allocated(dev)
    else:
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - base
    est = training_estimate(cfg, batch, seq)
    return {"flavor": flavor, "batch": batch, "seq_len": seq, "device": device, "params_M": cfg.num_params() / 1e6,
            "measured_MiB": peak / 2**20, "estimate_MiB": est.total / 2**20, "ratio": est.total / max(peak, 1),
            "parts_MiB": {k: round(v / 2**20, 1) for k, v in est.parts.items()}}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cpu")
    p.add_argument("--shapes", default="debug:8:256,debug:8:2048,tiny:8:256,tiny:4:1024",
                   help="comma-separated flavor:batch:seq_len")
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--json", default=None, help="also write the rows to this file")
    p.add_argument("--_worker", default=None, help=argparse.SUPPRESS)
    a = p.parse_args()
    if a._worker:
        flavor, batch, seq = a._worker.split(":")
        print(json.dumps(worker(flavor, int(batch), int(seq), a.device, a.vocab)))
        return
    rows = []
    print(f"{'shape':<18} {'params':>8} {'measured':>10} {'estimate':>10} {'est/meas':>9}")
    for shape in a.shapes.split(","):
        r = subprocess.run([sys.executable, __file__, "--device", a.device, "--vocab", str(a.vocab),
                            "--_worker", shape], capture_output=True, text=True)
        if r.returncode != 0:
            print(f"{shape:<18} failed: {r.stderr.strip().splitlines()[-1] if r.stderr.strip() else r.returncode}")
            continue
        row = json.loads(r.stdout.strip().splitlines()[-1])
        rows.append(row)
        print(f"{shape:<18} {row['params_M']:>7.1f}M {row['measured_MiB']:>9.0f}M {row['estimate_MiB']:>9.0f}M "
              f"{row['ratio']:>9.2f}")
    if a.json:
        with open(a.json, "w") as fh:
            json.dump(rows, fh, indent=1)


if __name__ == "__main__":
    main()
