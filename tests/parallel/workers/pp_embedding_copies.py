"""`trainforge train` that, as each rank closes its trainer, saves the copies of the token
embedding its pipeline stages hold to RUN_DIR/embedding_rank<r>.pt (a list: none on a
middle stage, one on the first or last, two where one rank holds both; full tensors), so a test can
check that the first and the last stage's copies of an MTP model stay identical.

Run as a script (the CLI's arguments), or ``save_embeddings_at_close`` as a cli_many prepare
step on every rank (torchrun.Prepared with every_rank): the patch then holds for the rest of
that launch."""

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


def save_embeddings_at_close() -> None:
    Trainer.close = _close_saving_embeddings


if __name__ == "__main__":
    save_embeddings_at_close()
    from trainforge.cli import main

    sys.exit(main(sys.argv[1:]))
