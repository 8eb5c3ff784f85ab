"""``python -m trainforge`` behaves as the ``trainforge`` console script, so
``torchrun ... -m trainforge train ...`` works."""

from trainforge.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
