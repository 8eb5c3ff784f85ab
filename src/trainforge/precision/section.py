"""``[precision]``: the typed config section of mixed precision, validated at the edge.

A named preset (``policy``) sets four dtypes; each ``*_dtype`` key left at ``auto``
takes the preset's value, any other value overrides it. Hardware is *not* consulted
here (validation must not run a benchmark): ``trainforge.precision.policy.build_policy``
turns the section plus the device into the dtypes actually used.

List-valued keys are comma-separated strings, like ``parallel.pp_split``, because the
TOML/CLI loader handles scalars only.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Literal

from trainforge.config_base import _f, _require

DTYPE_NAMES = ("fp32", "bf16", "fp16")
# Robustness order of the dynamic controller: fp16 has the least range, fp32 the most.
LADDER = ("fp16", "bf16", "fp32")

PRESETS: dict[str, dict[str, str]] = {
    "fp32": {"param_dtype": "fp32", "compute_dtype": "fp32", "reduce_dtype": "fp32", "optimizer_state_dtype": "fp32"},
    "bf16-mixed": {"param_dtype": "fp32", "compute_dtype": "bf16", "reduce_dtype": "fp32",
                   "optimizer_state_dtype": "fp32"},
    "fp16-mixed": {"param_dtype": "fp32", "compute_dtype": "fp16", "reduce_dtype": "fp32",
                   "optimizer_state_dtype": "fp32"},
    # Starts in bf16; the controller (dynamic.py) moves groups between its levels and fp32.
    "dynamic": {"param_dtype": "fp32", "compute_dtype": "bf16", "reduce_dtype": "fp32",
                "optimizer_state_dtype": "fp32"},
}

# Each entry matches a module by class name (any class in its MRO) or by an fnmatch
# pattern on its fully-qualified name. Norms (mean of squares overflows fp16), softmax,
# rotary tables, losses and MoE router/gating logits (top-k on near-ties flips in bf16)
# are the usual precision-sensitive parts. "*.gate" and "gate", not "*gate*": Hugging
# Face's SwiGLU "gate_proj" is an ordinary matmul and must stay in the compute dtype.
DEFAULT_FP32_MODULES = ("RMSNorm,LayerNorm,*norm,*rotary*,*rope*,Softmax,*softmax*,*loss*,CrossEntropyLoss,"
                        "*router*,*.gate,gate")

DtypeName = Literal["auto", "fp32", "bf16", "fp16"]

_GROUP_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


def parse_patterns(text: str) -> tuple[str, ...]:
    """``"RMSNorm, *norm"`` -> ("RMSNorm", "*norm"); "" -> (). Empty items are an error."""
    if not text.strip():
        return ()
    items = tuple(s.strip() for s in text.split(","))
    if any(not s for s in items):
        raise ValueError("empty item (doubled or trailing comma)")
    return items


def parse_groups(text: str) -> tuple[tuple[str, tuple[str, ...]], ...]:
    """``"attn:layers.*.attention,ffn:layers.*.feed_forward|output"`` ->
    (("attn", ("layers.*.attention",)), ("ffn", ("layers.*.feed_forward", "output")))."""
    groups = []
    for item in parse_patterns(text):
        name, sep, pats = item.partition(":")
        patterns = tuple(p.strip() for p in pats.split("|"))
        if not sep or not _GROUP_NAME.match(name.strip()) or any(not p for p in patterns):
            raise ValueError(f"{item!r} is not NAME:PATTERN[|PATTERN...]")
        groups.append((name.strip(), patterns))
    names = [g[0] for g in groups]
    if len(set(names)) != len(names) or "model" in names:
        raise ValueError("group names must be unique and not 'model' (the name of everything else)")
    return tuple(groups)


@dataclass
class PrecisionSection:
    policy: Literal["fp32", "bf16-mixed", "fp16-mixed", "dynamic"] = _f(
        "fp32", "preset: fp32, bf16-mixed, fp16-mixed (loss scaling), or dynamic (switches precision per "
                "module group on overflows and spikes)")
    param_dtype: DtypeName = _f("auto", "parameter storage dtype; auto = the preset's (fp32: autocast keeps "
                                        "fp32 weights); bf16/fp16 = pure low-precision weights")
    compute_dtype: DtypeName = _f("auto", "matmul dtype (torch.autocast); auto = the preset's")
    reduce_dtype: DtypeName = _f("auto", "dtype of the gradient reduce-scatter/all-reduce when sharded; "
                                         "auto = the preset's")
    optimizer_state_dtype: DtypeName = _f("auto", "AdamW state dtype: fp32 (fp32 master weights when "
                                                  "param_dtype is lower) or the param_dtype; auto = fp32")
    activation_dtype: DtypeName = _f("auto", "storage dtype of activations saved for backward (compute is "
                                             "unchanged); auto = bf16 under bf16 compute (the fp32 modules' "
                                             "saved inputs too), the requested low dtype when slow hardware "
                                             "keeps compute in fp32, else as computed; fp32 = as computed")
    recast_weights: bool = _f(True, "fp32 weights under autocast: backward casts each weight again instead of "
                                    "keeping autocast's low-precision copy alive from forward to backward "
                                    "(exact; saves 2 bytes per parameter at the memory peak, costs one cast "
                                    "per weight in backward)")
    fp32_modules: str = _f(DEFAULT_FP32_MODULES, "comma-separated class names or name patterns of modules "
                                                 "that always run in fp32 (autocast off inside)")
    force: bool = _f(False, "use the requested compute dtype even where the hardware probe measured it "
                            "slower than fp32")
    loss_scale_init: float = _f(65536.0, "fp16 only: initial dynamic loss scale")
    loss_scale_growth_steps: int = _f(2000, "fp16 only: overflow-free steps before the loss scale doubles")
    dynamic_groups: str = _f("", "dynamic only: comma-separated NAME:PATTERN[|PATTERN] module groups switched "
                                 "independently; empty = the whole model switches as one")
    dynamic_floor: Literal["auto", "fp16", "bf16"] = _f("auto", "dynamic only: cheapest precision the "
                                                                "controller may use; auto = the compute dtype")
    dynamic_interval_steps: int = _f(10, "dynamic only: steps between controller evaluations (each costs "
                                         "one host sync)")
    dynamic_loss_spike_ratio: float = _f(1.5, "dynamic only: loss above this multiple of its moving "
                                              "average is a spike")
    dynamic_grad_spike_ratio: float = _f(10.0, "dynamic only: grad norm above this multiple of its moving "
                                               "average is a spike")
    dynamic_grad_norm_max: float = _f(0.0, "dynamic only: grad norm above this is trouble; 0 = off")
    dynamic_max_overflows: int = _f(8, "dynamic only: more fp16 overflows (skipped steps) than this within "
                                       "dynamic_overflow_window_steps leave fp16")
    dynamic_overflow_window_steps: int = _f(100, "dynamic only: window of the overflow count, in steps")
    dynamic_min_loss_scale: float = _f(1.0, "dynamic only: a loss scale below this leaves fp16")
    dynamic_max_underflow_fraction: float = _f(0.0, "dynamic only: underflowed fraction of gradient "
                                                    "elements that leaves fp16; 0 = off")
    dynamic_calm_steps: int = _f(200, "dynamic only: consecutive calm steps before moving one level cheaper "
                                      "(doubles with each repeated failure of that level)")
    dynamic_min_dwell_steps: int = _f(20, "dynamic only: least steps between two switches of a group "
                                          "(non-finite values escalate at once)")

    def resolved_dtypes(self) -> dict[str, str]:
        """The preset with this section's overrides: param/compute/reduce/optimizer_state
        dtype names, before any hardware adjustment."""
        out = dict(PRESETS[self.policy])
        for key in out:
            if getattr(self, key) != "auto":
                out[key] = getattr(self, key)
        return out

    def validate(self) -> None:
        _require(self.policy in PRESETS, "precision.policy", self.policy, f"one of {sorted(PRESETS)}")
        for key in ("param_dtype", "compute_dtype", "reduce_dtype", "optimizer_state_dtype", "activation_dtype"):
            v = getattr(self, key)
            _require(v == "auto" or v in DTYPE_NAMES, f"precision.{key}", v, f"auto or one of {list(DTYPE_NAMES)}")
        d = self.resolved_dtypes()
        _require(d["param_dtype"] in ("fp32", d["compute_dtype"]), "precision.param_dtype", self.param_dtype,
                 f"fp32 or the compute dtype ({d['compute_dtype']}): weights stored in one low dtype and "
                 "multiplied in another would be cast on every use")
        _require(d["optimizer_state_dtype"] in ("fp32", d["param_dtype"]), "precision.optimizer_state_dtype",
                 self.optimizer_state_dtype, f"fp32 (master weights) or the param dtype ({d['param_dtype']}); "
                 "AdamW keeps its state in its parameters' dtype")
        act = self.activation_dtype
        _require(act in ("auto", "fp32", d["compute_dtype"]) or d["compute_dtype"] == "fp32",
                 "precision.activation_dtype", act,
                 f"auto, fp32 or the compute dtype ({d['compute_dtype']}); a third dtype is not supported")
        try:
            parse_patterns(self.fp32_modules)
        except ValueError as e:
            _require(False, "precision.fp32_modules", self.fp32_modules, f"comma-separated names/patterns ({e})")
        try:
            groups = parse_groups(self.dynamic_groups)
        except ValueError as e:
            _require(False, "precision.dynamic_groups", self.dynamic_groups, str(e))
        _require(math.isfinite(self.loss_scale_init) and self.loss_scale_init > 0, "precision.loss_scale_init",
                 self.loss_scale_init, "a finite number > 0 (e.g. 65536)")
        _require(self.loss_scale_growth_steps >= 1, "precision.loss_scale_growth_steps",
                 self.loss_scale_growth_steps, "an integer >= 1")
        if self.policy == "dynamic":
            _require(d["param_dtype"] == "fp32", "precision.param_dtype", self.param_dtype,
                     "fp32 (or auto) with policy = dynamic: a group switched to fp32 needs fp32 weights")
            if self.dynamic_floor != "auto":
                _require(LADDER.index(self.dynamic_floor) <= LADDER.index(d["compute_dtype"]),
                         "precision.dynamic_floor", self.dynamic_floor,
                         f"a precision no more robust than the starting compute dtype ({d['compute_dtype']})")
        else:
            _require(not groups, "precision.dynamic_groups", self.dynamic_groups,
                     "empty unless precision.policy = dynamic")
        _require(self.dynamic_interval_steps >= 1, "precision.dynamic_interval_steps", self.dynamic_interval_steps,
                 "an integer >= 1")
        for key in ("dynamic_loss_spike_ratio", "dynamic_grad_spike_ratio"):
            v = getattr(self, key)
            _require(math.isfinite(v) and v > 1.0, f"precision.{key}", v, "a finite number > 1")
        for key in ("dynamic_grad_norm_max", "dynamic_min_loss_scale"):
            v = getattr(self, key)
            _require(math.isfinite(v) and v >= 0, f"precision.{key}", v, "a finite number >= 0 (0 = off)")
        _require(0.0 <= self.dynamic_max_underflow_fraction < 1.0, "precision.dynamic_max_underflow_fraction",
                 self.dynamic_max_underflow_fraction, "a number in [0, 1) (0 = off)")
        for key in ("dynamic_max_overflows", "dynamic_overflow_window_steps", "dynamic_calm_steps"):
            v = getattr(self, key)
            _require(v >= 1, f"precision.{key}", v, "an integer >= 1")
        _require(self.dynamic_max_overflows < self.dynamic_overflow_window_steps, "precision.dynamic_max_overflows",
                 self.dynamic_max_overflows, "fewer than dynamic_overflow_window_steps")
        _require(self.dynamic_min_dwell_steps >= 0, "precision.dynamic_min_dwell_steps",
                 self.dynamic_min_dwell_steps, "an integer >= 0")
