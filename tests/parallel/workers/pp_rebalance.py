"""`trainforge train` with the stage-balance plan replaced by a perfectly even prediction,
so any measured imbalance counts as drift: forces the re-balance path deterministically."""

import sys

import trainforge.parallel.apply as apply

_measured_plan = apply.pipeline_boundaries


def _even_prediction(*args, **kwargs):
    boundaries, predicted = _measured_plan(*args, **kwargs)
    return boundaries, None if predicted is None else [1.0] * len(predicted)


apply.pipeline_boundaries = _even_prediction

from trainforge.cli import main  # noqa: E402

sys.exit(main(sys.argv[1:]))
