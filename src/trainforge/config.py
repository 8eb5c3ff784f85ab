"""Typed run configuration: one dataclass per concern, loaded from TOML with
``--section.key value`` overrides, validated before any work starts.

Every field's ``help`` metadata is the CLI help (``trainforge train --help``).
Each component receives only its own section (``cfg.training``, ``cfg.data``...),
never the whole ``Config``.
"""

from __future__ import annotations

import dataclasses
import math
import tomllib
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from trainforge.compression.section import CompressionSection
from trainforge.config_base import _f, _require
from trainforge.errors import ConfigError
from trainforge.monitor.section import MonitorSection


@dataclass
class ModelSection:
    flavor: str = _f("tiny", "named model shape: debug, tiny, small, llama-1b, llama-8b, llama-70b, llama-405b")
    dim: int | None = _f(None, "override the flavor's hidden size")
    n_layers: int | None = _f(None, "override the flavor's number of transformer blocks")
    n_heads: int | None = _f(None, "override the flavor's number of query heads")
    n_kv_heads: int | None = _f(None, "override the flavor's number of key/value heads (GQA)")
    ffn_hidden_dim: int | None = _f(None, "override the flavor's SwiGLU hidden size")
    tie_embeddings: bool | None = _f(None, "share input embedding and output projection weights")

    def validate(self) -> None:
        from trainforge.model.config import FLAVORS

        _require(self.flavor in FLAVORS, "model.flavor", self.flavor, f"one of {sorted(FLAVORS)}")
        for name in ("dim", "n_layers", "n_heads", "n_kv_heads", "ffn_hidden_dim"):
            v = getattr(self, name)
            _require(v is None or v > 0, f"model.{name}", v, "a positive integer")


@dataclass
class DataSection:
    path: str | None = _f(
        None,
        "directory written by `trainforge prepare` (holds manifest.json); unset = the built-in "
        "corpus (Python standard library sources), prepared on first use",
    )
    vocab_size: int = _f(8192, "tokenizer vocabulary size when preparing the built-in corpus")
    cache_dir: str | None = _f(None, "where the built-in corpus is prepared; default ~/.cache/trainforge")

    def validate(self) -> None:
        _require(257 <= self.vocab_size <= 1 << 20, "data.vocab_size", self.vocab_size,
                 "an integer in [257, 1048576] (byte-level BPE needs 256 byte tokens + specials)")
        if self.path is not None:
            _require(self.path != "", "data.path", self.path, "a directory path, or leave unset")
            if not (Path(self.path) / "manifest.json").is_file():
                raise ConfigError(
                    f"config key 'data.path' = {self.path!r}: no manifest.json there; "
                    "run `trainforge prepare --input ... --output DIR` first, or unset data.path "
                    "to use the built-in corpus")


@dataclass
class TrainingSection:
    steps: int = _f(300, "optimizer steps to run")
    batch_size: int = _f(8, "sequences per micro-batch")
    grad_accum_steps: int = _f(1, "micro-batches accumulated per optimizer step")
    seq_len: int = _f(256, "tokens per sequence")
    lr: float = _f(1e-3, "peak learning rate, reached after warmup")
    min_lr_ratio: float = _f(0.1, "cosine decay floor as a fraction of lr")
    warmup_steps: int = _f(30, "linear warmup steps")
    grad_clip: float = _f(1.0, "clip the global gradient norm to this; 0 = off")
    seed: int = _f(1234, "seed for weights, data order and sampling")
    val_interval: int = _f(100, "run validation every this many steps (and at the end); 0 = only at the end")
    val_batches: int = _f(8, "micro-batches per validation pass")
    log_interval: int = _f(10, "print a log line every this many steps")
    device: str = _f("auto", "auto (cuda if present, else cpu), cpu, cuda, or cuda:N")
    threads: int = _f(0, "torch intra-op threads; 0 = leave torch's default")

    def validate(self) -> None:
        for name in ("steps", "batch_size", "grad_accum_steps", "seq_len", "val_batches", "log_interval"):
            v = getattr(self, name)
            _require(v >= 1, f"training.{name}", v, "an integer >= 1")
        for name in ("warmup_steps", "val_interval", "threads", "seed"):
            v = getattr(self, name)
            _require(v >= 0, f"training.{name}", v, "an integer >= 0")
        _require(math.isfinite(self.lr) and self.lr > 0, "training.lr", self.lr, "a finite number > 0")
        _require(0.0 <= self.min_lr_ratio <= 1.0, "training.min_lr_ratio", self.min_lr_ratio, "a number in [0, 1]")
        _require(math.isfinite(self.grad_clip) and self.grad_clip >= 0, "training.grad_clip", self.grad_clip,
                 "a number >= 0 (0 turns clipping off)")
        _require(self.device == "auto" or self.device == "cpu" or self.device.startswith("cuda"),
                 "training.device", self.device, "auto, cpu, cuda or cuda:N")


@dataclass
class OptimizerSection:
    name: Literal["adamw"] = _f("adamw", "optimizer (AdamW; more come with later issues)")
    beta1: float = _f(0.9, "AdamW beta1")
    beta2: float = _f(0.95, "AdamW beta2")
    eps: float = _f(1e-8, "AdamW epsilon")
    weight_decay: float = _f(0.1, "decoupled weight decay on matrices (not on norms or biases)")
    implementation: Literal["auto", "fused", "foreach", "for-loop"] = _f(
        "auto", "AdamW kernel: auto picks fused where the device supports it, else foreach")

    def validate(self) -> None:
        for name in ("beta1", "beta2"):
            v = getattr(self, name)
            _require(0.0 <= v < 1.0, f"optimizer.{name}", v, "a number in [0, 1)")
        _require(self.eps > 0, "optimizer.eps", self.eps, "a number > 0")
        _require(self.weight_decay >= 0, "optimizer.weight_decay", self.weight_decay, "a number >= 0")


@dataclass
class CheckpointSection:
    interval: int = _f(100, "save a checkpoint every this many steps (and always at the end); 0 = only at the end")
    keep_last: int = _f(3, "how many most recent checkpoints to keep")

    def validate(self) -> None:
        _require(self.interval >= 0, "checkpoint.interval", self.interval, "an integer >= 0")
        _require(self.keep_last >= 1, "checkpoint.keep_last", self.keep_last, "an integer >= 1")


@dataclass
class ParallelSection:
    dp_replicate: int = _f(1, "data-parallel replicas (DDP, or the replicate axis of HSDP: across nodes)")
    dp_shard: int = _f(-1, "FSDP2 shards per replica; -1 = whatever the other axes leave of the world size")
    tp: int = _f(1, "tensor-parallel degree (DTensor; keep within a node)")
    pp: int = _f(1, "pipeline stages")
    pp_schedule: Literal["gpipe", "1f1b", "interleaved-1f1b", "zbv", "dualpipev"] = _f(
        "1f1b", "pipeline schedule")
    microbatches: int = _f(0, "pipeline microbatches per step; 0 = 2 x the number of stages")
    pp_split: str = _f("auto", "stage boundaries: auto (measured), even, or comma-separated first layer of "
                               "each stage, e.g. 0,5,9")
    pp_memory_limit_mb: int = _f(0, "auto split: most memory one stage may use (weights, grads, AdamW state, "
                                    "activations of in-flight microbatches); 0 = no limit")
    rebalance_threshold: float = _f(0.0, "re-split the pipeline (checkpoint, re-measure, continue) when the "
                                         "slowest stage's imbalance exceeds the planned one by this fraction; "
                                         "0 = off; needs pp_split = auto")
    rebalance_min_steps: int = _f(100, "steps between two pipeline re-balances")
    sequence_parallel: bool = _f(True, "shard norms and residuals along the sequence between TP regions")
    loss_parallel: bool = _f(True, "compute cross-entropy on vocab-sharded logits under TP")
    activation_checkpointing: Literal["none", "full"] = _f("none", "recompute each block's activations "
                                                                   "in backward")
    compile: bool = _f(False, "torch.compile each transformer block (after TP and activation checkpointing, "
                              "before data parallel); ~1.0x on CPU, costs tens of seconds at start")

    def validate(self) -> None:
        for name in ("dp_replicate", "tp", "pp"):
            v = getattr(self, name)
            _require(v >= 1, f"parallel.{name}", v, "an integer >= 1")
        _require(self.dp_shard == -1 or self.dp_shard >= 1, "parallel.dp_shard", self.dp_shard,
                 "an integer >= 1, or -1 to fill")
        _require(self.pp_memory_limit_mb >= 0, "parallel.pp_memory_limit_mb", self.pp_memory_limit_mb,
                 "an integer >= 0 (0 = no limit)")
        _require(self.rebalance_threshold >= 0, "parallel.rebalance_threshold", self.rebalance_threshold,
                 "a number >= 0 (0 = off)")
        _require(self.rebalance_min_steps >= 1, "parallel.rebalance_min_steps", self.rebalance_min_steps,
                 "an integer >= 1")
        _require(self.microbatches >= 0, "parallel.microbatches", self.microbatches, "an integer >= 0 (0 = auto)")
        if self.pp_split not in ("auto", "even"):
            try:
                bounds = [int(x) for x in self.pp_split.split(",")]
            except ValueError:
                bounds = []
            _require(bool(bounds) and bounds[0] == 0 and bounds == sorted(set(bounds)), "parallel.pp_split",
                     self.pp_split, "auto, even, or increasing comma-separated layer indices starting at 0")


@dataclass
class SampleSection:
    prompt: str = _f("def ", "prompt for the sample printed after training")
    max_new_tokens: int = _f(64, "tokens to sample after training; 0 = no sample")
    temperature: float = _f(0.8, "sampling temperature; 0 = greedy")
    top_k: int = _f(50, "keep the k most likely tokens; 0 = off")

    def validate(self) -> None:
        _require(self.max_new_tokens >= 0, "sample.max_new_tokens", self.max_new_tokens, "an integer >= 0")
        _require(self.temperature >= 0, "sample.temperature", self.temperature, "a number >= 0")
        _require(self.top_k >= 0, "sample.top_k", self.top_k, "an integer >= 0")


@dataclass
class Config:
    model: ModelSection = field(default_factory=ModelSection)
    data: DataSection = field(default_factory=DataSection)
    training: TrainingSection = field(default_factory=TrainingSection)
    optimizer: OptimizerSection = field(default_factory=OptimizerSection)
    checkpoint: CheckpointSection = field(default_factory=CheckpointSection)
    parallel: ParallelSection = field(default_factory=ParallelSection)
    sample: SampleSection = field(default_factory=SampleSection)
    compression: CompressionSection = field(default_factory=CompressionSection)
    monitor: MonitorSection = field(default_factory=MonitorSection)

    def validate(self) -> "Config":
        for f in dataclasses.fields(self):
            getattr(self, f.name).validate()
        return self


# ---------------------------------------------------------------------------
# Loading: TOML -> dict -> typed sections, with CLI overrides applied on top.

_TRUE = {"true", "1", "yes", "on"}
_FALSE = {"false", "0", "no", "off"}


def _coerce(key: str, value: Any, tp: Any, from_cli: bool) -> Any:
    """Check ``value`` against the annotated type ``tp``; CLI strings are parsed first."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if value is None or (from_cli and isinstance(value, str) and value.lower() in ("none", "null")):
            return None
        return _coerce(key, value, args[0], from_cli)
    if origin is Literal:
        choices = typing.get_args(tp)
        _require(value in choices, key, value, f"one of {list(choices)}")
        return value
    try:
        if tp is bool:
            if from_cli and isinstance(value, str) and value.lower() in _TRUE | _FALSE:
                return value.lower() in _TRUE
            if isinstance(value, bool):
                return value
        elif tp is int:
            if from_cli and isinstance(value, str):
                return int(value)
            if isinstance(value, int) and not isinstance(value, bool):
                return value
        elif tp is float:
            if from_cli and isinstance(value, str):
                return float(value)
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                return float(value)
        elif tp is str:
            if isinstance(value, str):
                return value
    except ValueError:
        pass
    raise ConfigError(f"config key '{key}' = {value!r} has the wrong type: expected {getattr(tp, '__name__', tp)}")


def _section_types(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _apply(cfg: Config, section: str, key: str, value: Any, from_cli: bool) -> None:
    sections = {f.name: f for f in dataclasses.fields(Config)}
    if section not in sections:
        raise ConfigError(f"unknown config section '{section}' (in '{section}.{key}'): "
                          f"known sections are {sorted(sections)}")
    sec = getattr(cfg, section)
    hints = _section_types(type(sec))
    if key not in hints:
        raise ConfigError(f"unknown config key '{section}.{key}': known keys in [{section}] are {sorted(hints)}")
    setattr(sec, key, _coerce(f"{section}.{key}", value, hints[key], from_cli))


def config_from_dict(data: dict[str, Any], source: str = "config") -> Config:
    """Build a Config from nested ``{section: {key: value}}`` (TOML or JSON shaped).

    Unknown sections/keys and wrong types raise ConfigError; ranges are checked by
    ``Config.validate``, which the caller runs after applying overrides."""
    cfg = Config()
    for section, values in data.items():
        if not isinstance(values, dict):
            raise ConfigError(f"{source}: '{section}' must be a [section] table, got {values!r}")
        for key, value in values.items():
            _apply(cfg, section, key, value, from_cli=False)
    return cfg


def parse_overrides(args: list[str]) -> list[tuple[str, str, str]]:
    """``["--training.steps", "10", "--model.flavor=debug"]`` -> [(section, key, raw)]."""
    out = []
    i = 0
    while i < len(args):
        arg = args[i]
        if not arg.startswith("--") or "." not in arg:
            raise ConfigError(f"unexpected argument {arg!r}: overrides look like --section.key VALUE")
        name = arg[2:]
        if "=" in name:
            name, raw = name.split("=", 1)
            i += 1
        else:
            if i + 1 >= len(args):
                raise ConfigError(f"override {arg} has no value: write {arg} VALUE")
            raw = args[i + 1]
            i += 2
        section, _, key = name.partition(".")
        out.append((section, key, raw))
    return out


def load_config(path: str | Path | None = None, overrides: list[str] | None = None,
                base: dict[str, Any] | None = None) -> Config:
    """Resolve a run's config: defaults <- ``base`` dict <- TOML file <- CLI overrides.

    Raises ConfigError naming the key and what is allowed; nothing is written."""
    data: dict[str, Any] = dict(base or {})
    source = "config"
    if path is not None:
        p = Path(path)
        source = str(p)
        if not p.is_file():
            raise ConfigError(f"config file {p} does not exist")
        try:
            file_data = tomllib.loads(p.read_text())
        except tomllib.TOMLDecodeError as e:
            raise ConfigError(f"config file {p} is not valid TOML: {e}") from None
        for section, values in file_data.items():
            if isinstance(values, dict) and isinstance(data.get(section), dict):
                data[section] = {**data[section], **values}
            else:
                data[section] = values
    cfg = config_from_dict(data, source)
    for section, key, raw in parse_overrides(overrides or []):
        _apply(cfg, section, key, raw, from_cli=True)
    return cfg.validate()


def config_to_dict(cfg: Config) -> dict[str, dict[str, Any]]:
    return dataclasses.asdict(cfg)


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, (int, float)):
        return repr(value)
    # TOML basic string: escape quote, backslash and control characters; everything
    # else literal (JSON's \ud800-style surrogate pairs are not valid TOML escapes).
    out = []
    for ch in str(value):
        if ch in '"\\':
            out.append("\\" + ch)
        elif ord(ch) < 0x20 or ord(ch) == 0x7F:
            out.append(f"\\u{ord(ch):04x}")
        else:
            out.append(ch)
    return '"' + "".join(out) + '"'


def config_to_toml(cfg: Config) -> str:
    """TOML text of the resolved config (unset optional keys are omitted: TOML has no null)."""
    lines = ["# resolved trainforge config: `trainforge train --config` accepts this file", ""]
    for section, values in config_to_dict(cfg).items():
        lines.append(f"[{section}]")
        for key, value in values.items():
            if value is None:
                continue
            lines.append(f"{key} = {_toml_value(value)}")
        lines.append("")
    return "\n".join(lines)


def config_help() -> str:
    """One line per key, for ``trainforge train --help``."""
    rows = []
    for sec_field in dataclasses.fields(Config):
        sec_cls = sec_field.default_factory  # type: ignore[misc]
        for f in dataclasses.fields(sec_cls):
            default = f.default
            rows.append(f"  --{sec_field.name}.{f.name} (default {default!r}): {f.metadata.get('help', '')}")
    return "\n".join(rows)
