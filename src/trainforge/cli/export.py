"""``trainforge export``: a checkpoint written as a Hugging Face directory (``infer/hf_export.py``)."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Literal

from trainforge.cli.options import Command
from trainforge.config_base import _f
from trainforge.errors import TrainforgeError
from trainforge.infer.session_options import WEIGHTS_HELP

DESCRIPTION = ("Write a checkpoint as a Hugging Face directory that transformers, vLLM and llm-compressor read: "
               "config.json, generation_config.json, model.safetensors (sharded with an index above "
               "--max_shard_gb), tokenizer.json + tokenizer_config.json. LlamaForCausalLM for dense models, "
               "DeepseekV3ForCausalLM (MTP layers included) for latent-attention MoE, Glm4MoeForCausalLM (sigmoid "
               "routing) or MixtralForCausalLM (softmax) for other MoE. --quantize writes int8/int4 linear weights "
               "in the compressed-tensors format.")


@dataclass
class ExportOptions:
    checkpoint: str | None = _f(None, "float trainforge checkpoint or run directory", required=True, metavar="PATH")
    output: str | None = _f(None, "new directory for the Hugging Face files", required=True, metavar="DIR")
    weights: Literal["final", "ema"] = _f("final", WEIGHTS_HELP)
    dtype: Literal["bf16", "fp16", "fp32"] = _f("fp32", "dtype of the float weights")  # hf_export.DTYPES
    quantize: Literal["none", "int8", "int4"] | None = _f(
        None, "int8 per output channel or int4 per group (compressed-tensors format); default: none, or the "
              "scheme a quantisation-aware run was trained with")
    group_size: int | None = _f(None, "int4 group size (default 128, or the QAT run's); a layer it does not "
                                      "divide takes the largest multiple of 32 below it that does, else stays "
                                      "float (as trainforge quantize)")
    max_shard_gb: float = _f(5.0, "split the weights into files of at most this size")
    force: bool = _f(False, "replace --output if it exists (only once the new one is complete)")


SECTIONS = {"export": ExportOptions}
COMMAND = Command("export", DESCRIPTION, SECTIONS, model="checkpoint")


def run(argv: list[str]) -> int:
    parsed = COMMAND.parse(argv)
    if parsed is None:
        return 0
    a = parsed.section(ExportOptions)
    if a.max_shard_gb <= 0:
        raise TrainforgeError(f"--max_shard_gb {a.max_shard_gb}: must be > 0")
    from trainforge.storage.output_paths import refuse_overlap

    refuse_overlap(a.output, "--output", [("--checkpoint", a.checkpoint)], has_force=True)  # before any read
    from trainforge.infer.hf_export import export
    from trainforge.infer.session import trained_grid

    # A QAT run exports on the grid it was trained for (its dequantised weights are then the
    # fake-quantised training weights, bit for bit).
    mode, group_size, recorded = trained_grid(a.checkpoint, a.quantize or "auto", a.group_size)
    t0 = time.perf_counter()
    r = export(a.checkpoint, a.output, dtype=a.dtype, quantize=mode, group_size=group_size, force=a.force,
               max_shard_bytes=int(a.max_shard_gb * 2**30), skip_indivisible=recorded is not None,
               weights=a.weights)
    dt = time.perf_counter() - t0
    for line in r.notes:  # int4: the per-layer group sizes, in the words quantize uses
        print(line)
    what = f", {len(r.quantized)} layers {mode}" if r.quantized else ""
    print(f"wrote {r.path}: {r.tensors} tensors, {r.bytes / 2**20:.1f} MiB in {len(r.files)} file(s){what}; "
          f"{dt:.1f} s")
    return 0
