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
from trainforge.data.section import AugmentSection, CacheSection, is_list_of_tables
from trainforge.errors import ConfigError
from trainforge.monitor.section import MonitorSection
from trainforge.precision.section import PrecisionSection
from trainforge.train.control_section import AdaptiveLRSection, BadStepsSection, EarlyStopSection


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
        "directory written by `trainforge prepare` (holds manifest.json), or an fsspec URL of one (file://, "
        "http://, s3:// with its backend installed; read through the tiered cache); unset = the built-in "
        "corpus (Python standard library sources), prepared on first use",
    )
    vocab_size: int = _f(8192, "tokenizer vocabulary size when preparing the built-in corpus")
    cache_dir: str | None = _f(None, "where the built-in corpus is prepared; default ~/.cache/trainforge "
                                     "(not the shard cache: that is data.cache.dir)")
    prefetch_depth: int = _f(8, "tiered cache: shards fetched ahead of use, in the order the sampler will read them")
    fetch_workers: int = _f(4, "tiered cache: background threads fetching shards")
    on_corrupt: Literal["fail", "skip"] = _f(
        "fail", "a shard that fails its manifest sha256 (or is missing/truncated) in every tier: fail = stop the "
                "run naming it; skip = quarantine it (logged, counted) and read other windows in its place")
    timeout_s: float = _f(60.0, "longest wait for one shard (or the manifest) from data.path before the run "
                                "stops with an error")
    cache: CacheSection = field(default_factory=CacheSection, metadata={"help": "[data.cache] sub-table"})
    augment: AugmentSection = field(default_factory=AugmentSection, metadata={"help": "[data.augment] sub-table"})

    def validate(self) -> None:
        _require(257 <= self.vocab_size <= 1 << 20, "data.vocab_size", self.vocab_size,
                 "an integer in [257, 1048576] (byte-level BPE needs 256 byte tokens + specials)")
        _require(self.prefetch_depth >= 0, "data.prefetch_depth", self.prefetch_depth, "an integer >= 0 (0 = off)")
        _require(self.fetch_workers >= 1, "data.fetch_workers", self.fetch_workers, "an integer >= 1")
        _require(math.isfinite(self.timeout_s) and self.timeout_s > 0, "data.timeout_s", self.timeout_s,
                 "a number of seconds > 0")
        self.cache.validate()
        self.augment.validate()
        if self.path is not None:
            _require(self.path != "", "data.path", self.path, "a directory path or URL, or leave unset")
            from trainforge.data.sources import check_url, is_url

            if is_url(self.path):
                check_url(self.path)  # the protocol's fsspec backend is importable; nothing is fetched
            elif not (Path(self.path) / "manifest.json").is_file():
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
    lr_schedule: Literal["cosine", "wsd", "linear", "constant"] = _f(
        "cosine", "after the linear warmup: cosine or linear decay to min_lr_ratio at training.steps, wsd "
                  "(warmup-stable-decay: constant, then decay over the last decay_ratio of the steps), or constant")
    min_lr_ratio: float = _f(0.1, "decay floor as a fraction of lr (cosine, linear, wsd)")
    decay_ratio: float = _f(0.1, "wsd: fraction of training.steps spent decaying")
    decay_shape: Literal["linear", "sqrt", "cosine"] = _f("linear", "wsd: shape of the final decay")
    warmup_steps: int = _f(30, "linear warmup steps")
    grad_clip: float = _f(1.0, "clip the global gradient norm to this; 0 = off")
    seed: int = _f(1234, "seed for weights, data order and sampling")
    val_interval: int = _f(100, "run validation every this many steps (and at the end); 0 = only at the end")
    val_batches: int = _f(8, "micro-batches per validation pass")
    log_interval: int = _f(10, "print a log line every this many steps")
    device: str = _f("auto", "auto (cuda if present, else cpu), cpu, cuda, or cuda:N")
    threads: int = _f(0, "torch intra-op threads; 0 = leave torch's default")
    loss_chunk_tokens: int = _f(0, "output projection + cross-entropy this many tokens at a time, recomputed "
                                   "in backward (never the whole logits tensor: less memory, ~7% more forward "
                                   "FLOPs on small); 0 = all at once. Single-device or DDP runs")

    def validate(self) -> None:
        for name in ("steps", "batch_size", "grad_accum_steps", "seq_len", "val_batches", "log_interval"):
            v = getattr(self, name)
            _require(v >= 1, f"training.{name}", v, "an integer >= 1")
        for name in ("warmup_steps", "val_interval", "threads", "seed", "loss_chunk_tokens"):
            v = getattr(self, name)
            _require(v >= 0, f"training.{name}", v, "an integer >= 0")
        _require(math.isfinite(self.lr) and self.lr > 0, "training.lr", self.lr, "a finite number > 0")
        _require(0.0 <= self.min_lr_ratio <= 1.0, "training.min_lr_ratio", self.min_lr_ratio, "a number in [0, 1]")
        _require(0.0 < self.decay_ratio <= 1.0, "training.decay_ratio", self.decay_ratio, "a number in (0, 1]")
        if self.lr_schedule == "wsd":
            decay_steps = max(1, round(self.decay_ratio * self.steps))
            _require(self.warmup_steps + decay_steps <= self.steps, "training.decay_ratio", self.decay_ratio,
                     f"with lr_schedule = wsd, warmup_steps ({self.warmup_steps}) + decay_ratio x steps "
                     f"({decay_steps}) must not exceed training.steps ({self.steps}); lower one of them")
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
    fallback: bool = _f(False, "on resume, skip a corrupt newest checkpoint (sha256 mismatch, unreadable or "
                               "missing file) with a warning and load the newest intact one; false = refuse")

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
class DistributedSection:
    timeout_s: float = _f(600.0, "longest wait for another rank in one collective (and at start-up) before this "
                                 "rank fails with exit code 4: a hung or dead peer ends the job instead of "
                                 "blocking it forever")

    def validate(self) -> None:
        _require(math.isfinite(self.timeout_s) and self.timeout_s > 0, "distributed.timeout_s", self.timeout_s,
                 "a number of seconds > 0")


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
    distributed: DistributedSection = field(default_factory=DistributedSection)
    sample: SampleSection = field(default_factory=SampleSection)
    compression: CompressionSection = field(default_factory=CompressionSection)
    precision: PrecisionSection = field(default_factory=PrecisionSection)
    adaptive_lr: AdaptiveLRSection = field(default_factory=AdaptiveLRSection)
    early_stop: EarlyStopSection = field(default_factory=EarlyStopSection)
    bad_steps: BadStepsSection = field(default_factory=BadStepsSection)
    monitor: MonitorSection = field(default_factory=MonitorSection)

    def validate(self) -> "Config":
        for f in dataclasses.fields(self):
            getattr(self, f.name).validate()
        if self.parallel.pp > 1 and any(t.get("name") == "seq_curriculum" for t in self.data.augment.transforms):
            raise ConfigError("config key 'data.augment.transforms': seq_curriculum changes the sequence length, "
                              "which pipeline parallelism (parallel.pp > 1) fixes; remove it or use pp = 1")
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
    if tp is list or origin is list:
        # Lists of tables (data.augment.transforms). On the command line the value is TOML text.
        if from_cli and isinstance(value, str):
            try:
                value = tomllib.loads(f"v = {value}")["v"]
            except tomllib.TOMLDecodeError as e:
                raise ConfigError(f"config key '{key}' = {value!r} is not a TOML list ({e}); write e.g. "
                                  "'[{name = \"token_replace\", p = 0.1}]'") from None
        if is_list_of_tables(value):
            return [dict(v) for v in value]
        raise ConfigError(f"config key '{key}' = {value!r} has the wrong type: expected a list of tables, "
                          "e.g. [{name = \"token_replace\", p = 0.1}]")
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


def _set(obj: Any, table: str, parts: list[str], value: Any, from_cli: bool) -> None:
    """Set ``table.<parts>`` on the section object ``obj``. A part naming a nested section
    (``data.cache``) descends; a dict value there sets that sub-table's keys."""
    hints = typing.get_type_hints(type(obj))
    name = f"{table}.{parts[0]}"
    if parts[0] not in hints:
        raise ConfigError(f"unknown config key '{name}': known keys in [{table}] are {sorted(hints)}")
    tp = hints[parts[0]]
    if dataclasses.is_dataclass(tp):
        sub = getattr(obj, parts[0])
        if len(parts) > 1:
            _set(sub, name, parts[1:], value, from_cli)
            return
        if not isinstance(value, dict):
            raise ConfigError(f"config key '{name}' = {value!r}: it is a table; write [{name}] with keys "
                              f"{sorted(typing.get_type_hints(tp))}, or --{name}.KEY VALUE")
        for key, v in value.items():
            _set(sub, name, [key], v, from_cli)
        return
    if len(parts) > 1:
        raise ConfigError(f"unknown config key '{name}.{'.'.join(parts[1:])}': '{name}' is a value, not a table")
    setattr(obj, parts[0], _coerce(name, value, tp, from_cli))


def _apply(cfg: Config, section: str, key: str, value: Any, from_cli: bool) -> None:
    sections = {f.name: f for f in dataclasses.fields(Config)}
    if section not in sections:
        raise ConfigError(f"unknown config section '{section}' (in '{section}.{key}'): "
                          f"known sections are {sorted(sections)}")
    _set(getattr(cfg, section), section, key.split("."), value, from_cli)


def config_from_dict(data: dict[str, Any], source: str = "config") -> Config:
    """Build a Config from nested ``{section: {key: value}}`` (TOML or JSON shaped);
    a sub-table (``[data.cache]``) is a nested dict.

    Unknown sections/keys and wrong types raise ConfigError; ranges are checked by
    ``Config.validate``, which the caller runs after applying overrides."""
    cfg = Config()
    for section, values in data.items():
        if not isinstance(values, dict):
            raise ConfigError(f"{source}: '{section}' must be a [section] table, got {values!r}")
        for key, value in values.items():
            _apply(cfg, section, key, value, from_cli=False)
    return cfg


def _merge(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    """``over`` on top of ``base``, table by table (a file's [data.cache] keeps the base's other keys)."""
    out = dict(base)
    for key, value in over.items():
        out[key] = _merge(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out


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


def read_toml_file(path: Path, what: str) -> dict[str, Any]:
    """The TOML table in ``path``; ConfigError naming the file (and the byte offset of
    bytes that are not UTF-8: TOML is UTF-8 only) when it cannot be read or parsed."""
    try:
        raw = path.read_bytes()
    except OSError as e:
        raise ConfigError(f"{what} {path} could not be read ({e.strerror})") from None
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ConfigError(f"{what} {path} is not UTF-8 text (byte 0x{raw[e.start]:02x} at offset {e.start}); "
                          "save it as UTF-8") from None
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{what} {path} is not valid TOML: {' '.join(str(e).split())}") from None


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
        file_data = read_toml_file(p, "config file")
        data = _merge(data, file_data)
    cfg = config_from_dict(data, source)
    for section, key, raw in parse_overrides(overrides or []):
        _apply(cfg, section, key, raw, from_cli=True)
    return cfg.validate()


def config_to_dict(cfg: Config) -> dict[str, dict[str, Any]]:
    return dataclasses.asdict(cfg)


def _toml_key(key: str) -> str:
    return key if key and all(c.isalnum() or c in "_-" for c in key) else _toml_value(key)


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, list):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    if isinstance(value, dict):  # inline table
        return "{" + ", ".join(f"{_toml_key(k)} = {_toml_value(v)}" for k, v in value.items()) + "}"
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


def _toml_table(lines: list[str], name: str, values: dict[str, Any]) -> None:
    # A table's own keys first: TOML puts every key after [data.cache] into data.cache.
    lines.append(f"[{name}]")
    for key, value in values.items():
        if value is not None and not isinstance(value, dict):
            lines.append(f"{key} = {_toml_value(value)}")
    lines.append("")
    for key, value in values.items():
        if isinstance(value, dict):
            _toml_table(lines, f"{name}.{key}", value)


def config_to_toml(cfg: Config) -> str:
    """TOML text of the resolved config (unset optional keys are omitted: TOML has no null)."""
    lines = ["# resolved trainforge config: `trainforge train --config` accepts this file", ""]
    for section, values in config_to_dict(cfg).items():
        _toml_table(lines, section, values)
    return "\n".join(lines)


def _help_rows(prefix: str, cls: type) -> list[str]:
    rows = []
    for f in dataclasses.fields(cls):
        if dataclasses.is_dataclass(f.default_factory):  # type: ignore[arg-type]
            rows += _help_rows(f"{prefix}.{f.name}", f.default_factory)  # type: ignore[arg-type]
            continue
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()  # type: ignore[misc]
        rows.append(f"  --{prefix}.{f.name} (default {default!r}): {f.metadata.get('help', '')}")
    return rows


def config_help() -> str:
    """One line per key, for ``trainforge train --help``."""
    rows = []
    for sec_field in dataclasses.fields(Config):
        rows += _help_rows(sec_field.name, sec_field.default_factory)  # type: ignore[arg-type]
    return "\n".join(rows)
