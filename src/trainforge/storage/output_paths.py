"""An output never overlaps an input: every command that writes (``prepare``, ``export``,
``quantize``, ``train`` from ``model.init_from``, ``report``) refuses an output path that is,
contains or lies inside one of the paths it reads, symlinks resolved, before anything is
touched and whatever ``--force`` says. ``export --checkpoint runs/a --output runs/a --force``
would otherwise replace the run it reads with the export.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path

from trainforge.errors import TrainforgeError


class OverlappingPathsError(TrainforgeError):
    """An output path is, contains or lies inside an input path."""


def _real(p: str | Path) -> Path:
    # resolve() follows every symlink of the existing part (a link to the input is the input) and
    # makes the not-yet-existing rest absolute; normcase for case-insensitive filesystems' spelling.
    return Path(os.path.normcase(Path(p).expanduser().resolve()))


def refuse_overlap(output: str | Path, output_flag: str, inputs: Iterable[tuple[str, str | Path]],
                   allow_inside: bool = False, has_force: bool = False) -> None:
    """Raise ``OverlappingPathsError`` (one line naming both paths) when ``output`` is, contains
    or lies inside any input. ``inputs``: (its flag or key, its path). ``allow_inside``: an output
    inside an input directory is fine (a new file written beside what is read, never replacing it:
    ``report``'s default ``RUN_DIR/report.html``); being or containing one still is not.
    ``has_force``: the command has a ``--force``, which the message says does not override this."""
    out = _real(output)
    for flag, path in inputs:
        src = _real(path)
        if out == src:
            how = "is the same path as"
        elif src.is_relative_to(out):
            how = "contains"
        elif out.is_relative_to(src) and not allow_inside:
            how = "lies inside"
        else:
            continue
        shown = f" ({src})" if str(src) not in (str(path), str(output)) else ""
        force = " (--force does not override this)" if has_force else ""
        fix = f"an {output_flag} outside it" if how == "lies inside" else f"another {output_flag}"
        raise OverlappingPathsError(f"{output_flag} {output} {how} {flag} {path}{shown}: writing there would "
                                    f"replace or change what is read{force}; choose {fix}")
