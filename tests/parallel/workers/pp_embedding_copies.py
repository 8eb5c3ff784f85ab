"""`trainforge train` that, as each rank closes its trainer, saves the copies of the token
embedding its pipeline stages hold to RUN_DIR/embedding_rank<r>.pt (a list: none on a
middle stage, one on the first or last, two where one rank holds both; full tensors), so a test can
check that the first and the last stage's copies of an MTP model stay identical."""

import sys

import torch
from torch.distributed.tensor import DTensor

from trainforge.train.trainer import Trainer

_close = Trainer.close


def _close_saving_embeddings(self, failed: bool = False):
    # FSDP2 shards: gathered (a collective of the stage's dp ranks, which all hold one copy).
    copies = [(p.full_tensor() if isinstance(p, DTensor) else p).detach().clone()
              for part in self.model_parts for name, p in part.named_parameters() if name == "tok_embeddings.weight"]
    torch.save(copies, self.run_dir / f"embedding_rank{self.dist.rank}.pt")
    _close(self, failed)


Trainer.close = _close_saving_embeddings

from trainforge.cli import main  # noqa: E402

sys.exit(main(sys.argv[1:]))
