"""``trainforge quantize``: a float checkpoint written with int8 / int4 / q8_0 / q4_0 weights."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from trainforge.cli.options import Command
from trainforge.config_base import _f
from trainforge.errors import TrainforgeError
from trainforge.infer.session_options import GROUP_SIZE_HELP

DESCRIPTION = ("Offline quantisation: write a checkpoint with int8 / int4 linear and MoE expert weights (scales "
               "beside them; routers stay fp32) that `generate` and `serve` load directly.")


@dataclass
class QuantizeOptions:
    checkpoint: str | None = _f(None, "float trainforge checkpoint / run directory, or a Hugging Face directory",
                                required=True, metavar="PATH")
    output: str | None = _f(None, "new directory for the quantised checkpoint", required=True, metavar="DIR")
    mode: Literal["int8", "int4", "q8_0", "q4_0"] | None = _f(
        None, "int8 per output channel, int4 per group, or q8_0 / q4_0: 32-value blocks with one fp16 scale "
              "(llama.cpp's formats, run by the C++ CPU kernels; routed experts stay float)", required=True)
    group_size: int | None = _f(None, GROUP_SIZE_HELP)


SECTIONS = {"quantisation": QuantizeOptions}
COMMAND = Command("quantize", DESCRIPTION, SECTIONS, model="checkpoint")


def run(argv: list[str]) -> int:
    parsed = COMMAND.parse(argv)
    if parsed is None:
        return 0
    a = parsed.section(QuantizeOptions)
    from trainforge.storage.output_paths import refuse_overlap

    refuse_overlap(a.output, "--output", [("--checkpoint", a.checkpoint)])
    if Path(a.output).exists():
        raise TrainforgeError(f"--output {a.output} exists; choose a new directory")
    from trainforge.infer.quantize_checkpoint import quantize_checkpoint
    from trainforge.infer.session import trained_grid

    mode, group_size, recorded = trained_grid(a.checkpoint, a.mode, a.group_size, "--mode")  # a QAT run: its grid
    for line in quantize_checkpoint(a.checkpoint, a.output, mode, group_size, fallback=recorded is None):
        print(line)
    return 0
