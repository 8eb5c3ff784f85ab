"""Worker: train several runs one after another in ONE torchrun launch, each through the
real Trainer (as ``trainforge train`` does), sharing the process group. Saves a launch,
the imports and the rendezvous per run (~10 s each on 2 cores); the runs themselves are
unchanged: every Trainer seeds its own weights and data order from its config.

usage: train_many.py OUT_DIR RUNS_JSON   (RUNS_JSON: {"run name": [config overrides...], ...};
each run writes OUT_DIR/<run name>/metrics.jsonl)"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from trainforge.config import load_config
from trainforge.parallel.distributed import destroy_distributed
from trainforge.train.trainer import Trainer


def main() -> None:
    out, runs = Path(sys.argv[1]), json.loads(sys.argv[2])
    for name, overrides in runs.items():
        trainer = Trainer(load_config(None, overrides), out / name, progress=False)
        try:
            trainer.fit()
        finally:
            trainer.close()
    destroy_distributed()


if __name__ == "__main__":
    main()
