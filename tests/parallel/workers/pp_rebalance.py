"""`trainforge train` with the stage-balance plan replaced by a perfectly even prediction,
so any measured imbalance counts as drift: forces the re-balance path deterministically.

Run as a script (the CLI's arguments), or ``predict_even_balance`` as a cli_many prepare
step on every rank (torchrun.Prepared with every_rank): the patch then holds for the rest
of that launch."""

import sys

import trainforge.parallel.apply as apply

_measured_plan = apply.pipeline_boundaries


def _even_prediction(*args, **kwargs):
    boundaries, predicted = _measured_plan(*args, **kwargs)
    return boundaries, None if predicted is None else [1.0] * len(predicted)


def predict_even_balance() -> None:
    apply.pipeline_boundaries = _even_prediction


if __name__ == "__main__":
    predict_even_balance()
    from trainforge.cli import main

    sys.exit(main(sys.argv[1:]))
