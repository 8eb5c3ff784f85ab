"""One int4 group-size policy for every command that quantises (``quantize --mode int4``,
``export --quantize int4``, ``generate``/``serve --quantize int4``).

The requested group size (default 128) is used for every layer whose input dim it divides.
Another layer falls back to the largest multiple of 32 below it that divides its input dim
(32 is what the CPU kernels group by: ``int4.py``), and stays float only when there is none.
No single group size serves every built-in flavor with the fast kernels: ``tiny``'s
feed-forward output projection has in_features 704 = 64 x 11 (so 128 falls back to 64) and
``debug``'s / ``moe-tiny``'s 176 = 16 x 11 has no multiple of 32 at all.

A QAT run's grid is the exception: its layers are served and exported exactly as training
fake-quantised them, so a layer the recorded group size does not divide stays float, as it
trained (``fallback=False``).

Both commands report what the rule did with the same lines (``fallback_lines``).
"""

from __future__ import annotations

FALLBACK_UNIT = 32


def group_size_for(in_features: int, requested: int, fallback: bool = True) -> int | None:
    """The group size of a layer with ``in_features`` inputs: ``requested`` where it divides
    them, else (``fallback``) the largest multiple of 32 below ``requested`` that does; None:
    the layer stays float."""
    if in_features % requested == 0:
        return requested
    if fallback:
        for g in range(requested - requested % FALLBACK_UNIT, 0, -FALLBACK_UNIT):
            if g < requested and in_features % g == 0:
                return g
    return None


def why_float(in_features: int, requested: int, fallback: bool = True) -> str:
    if fallback:
        return (f"in_features {in_features}: not a multiple of group_size {requested}, nor of any multiple of "
                f"{FALLBACK_UNIT} below it")
    return f"in_features {in_features} is not a multiple of group_size {requested} (the QAT run kept it float)"


def fallback_lines(requested: int, group_sizes: dict[str, int], skipped: dict[str, str],
                   in_features: dict[str, tuple[int, ...]], fallback: bool = True) -> list[str]:
    """One line per input dim the requested group size does not divide: the layers' group size
    or that they stay float. ``group_sizes``: layer -> group size where it differs from
    ``requested``; ``skipped``: layer -> why it stays float (those ``requested`` does not divide
    are listed); ``in_features``: layer -> the input dims its group size must divide (a routed
    experts module exported: the model and the hidden dim); ``fallback``: as ``group_size_for``."""
    by_dim: dict[tuple[tuple[int, ...], int], list[str]] = {}  # (input dims, group size or 0: float) -> layers
    for name, g in group_sizes.items():
        by_dim.setdefault((in_features[name], g), []).append(name)
    for name in skipped:
        if name in in_features and any(d % requested for d in in_features[name]):
            by_dim.setdefault((in_features[name], 0), []).append(name)
    lines = []
    for (dims, g), names in sorted(by_dim.items()):
        names = sorted(names)
        which = ", ".join(names[:3]) + (f", ... ({len(names)} layers)" if len(names) > 3 else "")
        dim = " and ".join(str(d) for d in dims)
        then = f"group_size {g}" if g else ("float (no multiple of 32 below it divides it)" if fallback
                                             else "float, as the QAT run trained it")
        lines.append(f"int4: group_size {requested} does not divide in_features {dim} of {which}: {then}")
    return lines
