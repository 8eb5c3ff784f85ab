"""`trainforge train` without its per-logging-window observers, for ``plan_validation_measured``:
the comm-share profiler (``torch.profiler`` over a whole step) and the per-dtype memory
tracking run on the last step of every logging window, and a step-time benchmark logs every
step, so they would run on every step it times (on a CPU, the profiler alone triples the
step). The training itself is unchanged. Run under torchrun in place of ``-m trainforge``."""

import contextlib
import sys

from trainforge.train import step_stats, trainer


@contextlib.contextmanager
def _not_profiled(self, enabled: bool):
    yield


step_stats.CommShareProbe.measure = _not_profiled
# The loop sets measure_memory before each step; reading it back as False skips the tracking.
trainer.Trainer.measure_memory = property(lambda self: False, lambda self, value: None)

from trainforge.cli import main  # noqa: E402

sys.exit(main(sys.argv[1:]))
