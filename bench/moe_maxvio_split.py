"""MaxVio_global of trained MoE checkpoints over a whole validation split.

``bench/moe_balance.py``'s in-run MaxVio_global uses the run's fixed validation set: the
first ``training.val_batches`` windows of the split, in order, i.e. a few thousand
contiguous tokens of one or two source files, whose routing is skewed by their content.
Wang et al. measure MaxVio_global over a whole validation set; this script does that for
each run directory given (its newest checkpoint), reading every window of the split.

    OMP_NUM_THREADS=1 python bench/moe_maxvio_split.py --split DATA/val_00000.bin --seq_len 64 \\
        --json out.json RUN_DIR [RUN_DIR ...]
"""

from __future__ import annotations

import argparse
import json

import numpy as np
import torch

from trainforge.infer.loading import load_model
from trainforge.model.moe import routers
from trainforge.train.moe_balance import max_violation


def maxvio_over_split(run_dir: str, tokens: np.ndarray, seq_len: int, rows: int = 32) -> dict:
    model = load_model(run_dir).model.eval()
    rs = [r for _, r in routers(model)]
    for r in rs:
        r.eval_load.zero_()
    n = (len(tokens) // seq_len) * seq_len
    windows = torch.from_numpy(tokens[:n].astype(np.int64)).view(-1, seq_len)
    with torch.no_grad():
        for i in range(0, windows.shape[0], rows):
            model(windows[i:i + rows])
    per_layer = max_violation(torch.stack([r.eval_load for r in rs]))
    return {"maxvio_global": per_layer.mean().item(), "layers": [round(v, 4) for v in per_layer.tolist()],
            "tokens": n}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("runs", nargs="+", help="run directories (their newest checkpoint is read)")
    p.add_argument("--split", required=True, help="a prepared split's token file (uint16), e.g. val_00000.bin")
    p.add_argument("--seq_len", type=int, required=True, help="the runs' training.seq_len")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--json")
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    tokens = np.fromfile(a.split, dtype=np.uint16)
    out = {}
    for run in a.runs:
        out[run] = maxvio_over_split(run, tokens, a.seq_len)
        print(f"{run}: MaxVio_global {out[run]['maxvio_global']:.3f} over {out[run]['tokens']:,} tokens, "
              f"per layer {out[run]['layers']}", flush=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
