"""The options of an inference session (``trainforge generate`` and ``serve``): which model to
load, how to quantise and prepare it, and its drafter. A typed section as the config's are
(``config_base._f``: default and help); the command line is generated from it
(``cli/options.py``) and ``infer/session.py`` reads it. Imports nothing heavy: ``--help`` runs
without torch."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from trainforge.config_base import _f

QUANTIZE_HELP = ("quantise a float checkpoint's linear layers (and MoE experts: int8 / int4) at load time: int8 per "
                 "channel, int4 per group, q8_0 / q4_0 in 32-value blocks on the C++ CPU kernels (llama.cpp's "
                 "formats) (see `trainforge quantize` for the offline step); auto = the grid a QAT checkpoint was "
                 "trained for ([qat]), else none")
GROUP_SIZE_HELP = ("int4 group size (32, 64, 128 or 256 on CPU); default: a QAT checkpoint's, else 128. A layer it does "
                   "not divide takes the largest multiple of 32 below it that does, else stays float")

WEIGHTS_HELP = ("which weights of a trainforge checkpoint: final (those the run ended with) or ema (their moving "
                "average, kept by a run trained with [ema])")


@dataclass
class SessionOptions:
    checkpoint: str | None = _f(None, "trainforge checkpoint or run directory (newest checkpoint), a Hugging Face "
                                      "Llama directory (config.json + *.safetensors) or a GGUF file",
                                required=True, metavar="PATH")
    weights: Literal["final", "ema"] = _f("final", WEIGHTS_HELP)
    device: str = _f("cpu", "torch device: cpu, cuda, cuda:1, ...")
    dtype: Literal["float32", "bfloat16", "float16"] = _f("float32", "parameter dtype (quantised layers keep "
                                                                     "their own)")
    quantize: Literal["auto", "none", "int8", "int4", "q8_0", "q4_0"] = _f("auto", QUANTIZE_HELP)
    group_size: int | None = _f(None, GROUP_SIZE_HELP)
    quant_kernel: str | None = _f(None, "kernel for quantised layers (fbgemm, int8pack, int4pack_cpu, torchao, "
                                        "blocks, dequant, reference), or 'measure' (time them here once, cached); "
                                        "default: the order measured for the device", metavar="KERNEL")
    no_fuse: bool = _f(False, "skip the fusion pass (QKV, gate+up, add+RMSNorm)")
    compile: bool = _f(False, "torch.compile the decode step (slow start on CPU)")
    speculative: str | None = _f(None, "speculative decoding: draft:CHECKPOINT drafts with a smaller model sharing "
                                       "the tokenizer (loaded with the same --device/--dtype, unquantised); mtp "
                                       "drafts with the model's own MTP module (a model trained with "
                                       "model.mtp_depth >= 1; depth 1 drafts every token)",
                                 metavar="draft:CHECKPOINT|mtp")
    num_speculative_tokens: int = _f(4, "tokens drafted per step with --speculative (>= 1)")
