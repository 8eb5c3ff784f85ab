"""Moved to ``trainforge.quant_formats.int4_groups`` (a format, below train and infer)."""
# shim: remove after merge
from trainforge.quant_formats.int4_groups import *  # noqa: F401,F403
from trainforge.quant_formats.int4_groups import FALLBACK_UNIT, fallback_lines, group_size_for, why_float  # noqa: F401
