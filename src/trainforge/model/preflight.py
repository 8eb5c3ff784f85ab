"""Preflight: shape validation and a memory estimate, checked before anything is allocated.

A shape from a config (the ``[model]`` section + ``training.seq_len``, or a Hugging Face
``config.json``) is refused here, naming the key, when it is not a model (0 heads, a dim
the heads do not divide) or when the run it implies cannot fit in the memory this machine
has. Without this, 0 heads is a ZeroDivisionError and ``training.seq_len = 100000000``
spends minutes building rotary tables before the allocator gives up.

The estimate is rough on purpose (it decides only whether to refuse, and refuses only when
the estimate exceeds *all* available memory), and every term is a formula of the shape.
Measured on CPU (peak RSS of two fp32 AdamW steps, debug and tiny at 8 x 256 .. 8 x 2048)
it lands within about 25% of the real peak:

* rotary tables: the peak while ``rope_tables`` builds them, ``14 * positions * head_dim``
  bytes (fp32 freqs (T, D/2) + emb (T, D) + cos + sin), 8 of which stay;
* training state: ``16 * N`` bytes for N parameters (fp32 weights + grads + AdamW's two
  moments; bf16 weights + grads + fp32 master + moments is also 16) per rank, divided by
  the number of ways the state is sharded, but never below the full fp32 model that every
  rank builds before sharding (``4 * N``);
* activations, fp32: ``(20 * dim + 6 * ffn_hidden_dim)`` elements per token per layer (what
  autograd keeps: norm inputs, q/k/v before and after rotary, attention output, the SwiGLU
  intermediates; plus the gradients alive during backward; SDPA's flash kernel keeps no
  (T, T) scores), for ``batch_size * seq_len`` tokens over ``n_layers / pp`` layers, divided
  by tp; with activation checkpointing only each block's input (``dim``) plus one block's set;
* logits: fp32 logits, their float copy for the loss and their gradient, ``12 * tokens *
  vocab`` bytes (tokens = the loss chunk when ``training.loss_chunk_tokens`` is set, else
  ``(1 + mtp_depth)`` x the batch's tokens: each MTP depth has its own logits; MTP blocks
  count as layers);
* inference: weights at the load dtype (int8 / int4 linears when quantised), rotary tables,
  and the KV pool ``2 * n_layers * n_kv_heads * head_dim * slots`` elements (latent attention:
  ``n_layers * (kv_lora_rank + qk_rope_head_dim) * slots``, ``attention_cache.cache_layout``).

Available memory: ``torch.cuda.mem_get_info`` on CUDA; on CPU ``MemAvailable`` of
/proc/meminfo (``os.sysconf`` elsewhere), lowered to a cgroup v2 memory limit when one is
set, and shared by the processes of this host (``LOCAL_WORLD_SIZE``).

Pure functions on shapes and sizes (plus the one memory probe); imports nothing from
train/, infer/, parallel/ or precision/, so training and inference both call it.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from trainforge.errors import ConfigError, TrainforgeError
from trainforge.model.cache_layout import kv_bytes_per_token

if TYPE_CHECKING:
    from trainforge.model.config import ModelConfig

# Positions beyond int32 break index arithmetic in attention kernels; anything near it is
# refused by the memory estimate long before on any machine that exists.
MAX_POSITIONS = 2**31 - 1

# Sane model limits, checked in O(1) before anything counts, builds or allocates layer by layer
# (``num_params`` loops over the layers; a config, a GGUF block_count or a config.json
# num_hidden_layers of 10^9 spent ~15 minutes there, deaf to SIGTERM's stop, before the memory
# estimate could refuse it). Each is 10x or more beyond the largest published model: 126 layers
# (Llama 3.1 405B; depth studies train ~1,000), widths up to 73,728 (PaLM 540B's feed-forward),
# 262,144 tokens (Gemma 3), 384 routed experts (Kimi K2). Within them the per-layer work takes
# milliseconds and the memory estimate (in bytes, against this machine) decides.
MAX_LAYERS = 10_000
MAX_WIDTH = 1 << 20  # dim, heads, feed-forward and expert widths, latent ranks and head dims
MAX_VOCAB = 1 << 24
MAX_EXPERTS = 1 << 16
_SHAPE_LIMITS = {"dim": MAX_WIDTH, "n_layers": MAX_LAYERS, "n_heads": MAX_WIDTH, "n_kv_heads": MAX_WIDTH,
                 "vocab_size": MAX_VOCAB, "ffn_hidden_dim": MAX_WIDTH, "max_seq_len": MAX_POSITIONS}

# User-facing names of ModelConfig's fields, per source of the shape.
MODEL_KEYS = {"dim": "model.dim", "n_layers": "model.n_layers", "n_heads": "model.n_heads",
              "n_kv_heads": "model.n_kv_heads", "vocab_size": "the data's vocab_size",
              "ffn_hidden_dim": "model.ffn_hidden_dim", "max_seq_len": "training.seq_len"}
HF_KEYS = {"dim": "hidden_size", "n_layers": "num_hidden_layers", "n_heads": "num_attention_heads",
           "n_kv_heads": "num_key_value_heads", "vocab_size": "vocab_size", "ffn_hidden_dim": "intermediate_size",
           "max_seq_len": "max_position_embeddings"}

# Mixture-of-experts fields of ModelConfig (each a [model] key of the same name).
MOE_KEYS = ("n_routed_experts", "n_shared_experts", "n_activated_experts", "moe_inter_dim", "n_dense_layers",
            "score_func", "route_scale", "norm_topk_prob", "n_group", "topk_group", "bias_update_rate",
            "aux_loss_alpha", "seq_aux_loss_alpha")

# Multi-head latent attention and YaRN fields of ModelConfig (each a [model] key of the same name).
MLA_KEYS = ("q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "rope_factor",
            "rope_original_max_seq_len", "rope_beta_fast", "rope_beta_slow", "rope_mscale", "rope_mscale_all_dim")

GiB = 2**30


def fmt_bytes(n: float) -> str:
    for unit, size in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n / 2**10:.1f} KiB"


# -- shapes ----------------------------------------------------------------------------------

def check_shape(values: dict[str, object], keys: dict[str, str] = MODEL_KEYS, prefix: str = "config key",
                error: type[TrainforgeError] = ConfigError) -> None:
    """Raise ``error`` naming the key (``{prefix} '{keys[field]}'``) unless ``values``
    (ModelConfig field -> value) is a buildable shape: positive integer sizes, heads that
    divide dim, kv heads that divide heads, an even head dim, at most MAX_POSITIONS, and every
    size within the model limits above (O(1): before any per-layer work)."""
    def name(f: str) -> str:
        return f"{prefix} '{keys[f]}'"

    for f in ("dim", "n_layers", "n_heads", "n_kv_heads", "vocab_size", "ffn_hidden_dim", "max_seq_len"):
        v = values[f]
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise error(f"{name(f)} = {v!r:.80}: must be a positive integer")
        if f != "max_seq_len" and v > _SHAPE_LIMITS[f]:  # positions: named below with the tables' size
            raise error(f"{name(f)} = {v}: more than {_SHAPE_LIMITS[f]:,}, beyond any real model; use a smaller "
                        "value")
    dim, heads, kv = values["dim"], values["n_heads"], values["n_kv_heads"]
    if dim % heads:  # type: ignore[operator]
        raise error(f"{name('dim')} = {dim} must be divisible by {name('n_heads')} = {heads}")
    if heads % kv:  # type: ignore[operator]
        raise error(f"{name('n_heads')} = {heads} must be divisible by {name('n_kv_heads')} = {kv} (GQA groups)")
    head_dim = dim // heads  # type: ignore[operator]
    if head_dim % 2:
        raise error(f"head dim {name('dim')} / {name('n_heads')} = {head_dim} must be even for rotary embeddings")
    positions = values["max_seq_len"]
    if positions > MAX_POSITIONS:  # type: ignore[operator]
        raise error(f"{name('max_seq_len')} = {positions}: more than 2^31 positions (the rotary tables alone "
                    f"would need ~{fmt_bytes(rotary_bytes(head_dim, positions))}); use at most "  # type: ignore[arg-type]
                    f"{MAX_POSITIONS}")


def check_mtp_depth(depth: object, key: str = "model.mtp_depth", error: type[TrainforgeError] = ConfigError) -> None:
    """Raise ``error`` naming ``key`` unless ``depth`` (MTP modules) is an integer >= 0."""
    if isinstance(depth, bool) or not isinstance(depth, int) or not 0 <= depth <= MAX_LAYERS:
        raise error(f"config key '{key}' = {depth!r:.80}: must be an integer from 0 to {MAX_LAYERS:,} (the number "
                    "of multi-token prediction modules; DeepSeek-V3 uses 1, 0 turns MTP off)")


def check_moe(values: dict[str, object], n_layers: int, prefix: str = "model.",
              error: type[TrainforgeError] = ConfigError) -> None:
    """Raise ``error`` naming the ``[model]`` key unless the MoE fields (``MOE_KEYS`` ->
    value, ``n_routed_experts`` > 0) describe a router that can be built and routed."""
    def bad(f: str, why: str) -> TrainforgeError:
        return error(f"config key '{prefix}{f}' = {values[f]!r}: {why}")

    limits = {"moe_inter_dim": MAX_WIDTH, "n_dense_layers": MAX_LAYERS}
    for f in ("n_routed_experts", "n_activated_experts", "moe_inter_dim", "n_group", "topk_group"):
        v = values[f]
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise bad(f, "must be a positive integer for a mixture-of-experts model")
    for f in ("n_shared_experts", "n_dense_layers"):
        v = values[f]
        if isinstance(v, bool) or not isinstance(v, int) or v < 0:
            raise bad(f, "must be an integer >= 0")
    for f in ("n_routed_experts", "n_activated_experts", "moe_inter_dim", "n_group", "topk_group", "n_shared_experts",
              "n_dense_layers"):
        if values[f] > limits.get(f, MAX_EXPERTS):  # type: ignore[operator]
            raise bad(f, f"more than {limits.get(f, MAX_EXPERTS):,}, beyond any real model; use a smaller value")
    for f in ("route_scale", "bias_update_rate", "aux_loss_alpha", "seq_aux_loss_alpha"):
        v = values[f]
        if not isinstance(v, (int, float)) or v != v or v < 0 or (f == "route_scale" and v == 0):
            raise bad(f, "must be a finite number >= 0" + (" (and > 0)" if f == "route_scale" else ""))
    E, k, g, tg = (values[f] for f in ("n_routed_experts", "n_activated_experts", "n_group", "topk_group"))
    if values["score_func"] not in ("sigmoid", "softmax"):
        raise bad("score_func", "must be sigmoid (DeepSeek-V3) or softmax (Mixtral)")
    if values["n_dense_layers"] > n_layers:  # type: ignore[operator]
        raise bad("n_dense_layers", f"exceeds model.n_layers = {n_layers}")
    if E % g:  # type: ignore[operator]
        raise bad("n_group", f"must divide model.n_routed_experts = {E} (experts are split into equal groups)")
    if g > 1 and E // g < 2:  # type: ignore[operator]
        raise bad("n_group", f"leaves fewer than 2 experts per group (n_routed_experts = {E}); groups are "
                             "ranked by the sum of their top-2 scores")
    if tg > g:  # type: ignore[operator]
        raise bad("topk_group", f"exceeds model.n_group = {g}")
    if k > tg * (E // g):  # type: ignore[operator]
        raise bad("n_activated_experts", f"exceeds the {tg * (E // g)} experts in the model.topk_group = {tg} "
                                         f"groups a token may use")


def check_mla(values: dict[str, object], prefix: str = "model.", error: type[TrainforgeError] = ConfigError) -> None:
    """Raise ``error`` naming the ``[model]`` key unless the latent-attention and YaRN fields
    (``MLA_KEYS`` -> value) describe an attention that can be built: with ``kv_lora_rank`` > 0
    positive head dims (an even rotary one); with 0 (standard attention) none of them set."""
    def bad(f: str, why: str) -> TrainforgeError:
        return error(f"config key '{prefix}{f}' = {values[f]!r}: {why}")

    def is_int(v: object) -> bool:
        return isinstance(v, int) and not isinstance(v, bool)

    for f in ("q_lora_rank", "kv_lora_rank"):
        if not is_int(values[f]) or values[f] < 0:  # type: ignore[operator]
            raise bad(f, "must be an integer >= 0 (0 = full rank / no latent attention)")
    for f in ("q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"):
        if is_int(values[f]) and values[f] > MAX_WIDTH:  # type: ignore[operator]
            raise bad(f, f"more than {MAX_WIDTH:,}, beyond any real model; use a smaller value")
    if values["kv_lora_rank"] == 0:
        for f in ("q_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"):
            if values[f]:
                raise bad(f, f"needs multi-head latent attention: set {prefix}kv_lora_rank > 0 (e.g. "
                             f"{prefix}flavor = dsv3-debug) or leave {prefix}{f} at 0")
        if values["rope_factor"] != 1:
            raise bad("rope_factor", f"YaRN scaling is implemented for latent attention only: set {prefix}"
                                     f"kv_lora_rank > 0 or {prefix}rope_factor = 1")
        return
    for f in ("qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "rope_original_max_seq_len"):
        if not is_int(values[f]) or values[f] < 1:  # type: ignore[operator]
            raise bad(f, "must be a positive integer for a latent-attention model")
    if values["qk_rope_head_dim"] % 2:  # type: ignore[operator]
        raise bad("qk_rope_head_dim", "must be even (rotary embeddings rotate pairs)")
    for f in ("rope_factor", "rope_beta_fast", "rope_beta_slow", "rope_mscale", "rope_mscale_all_dim"):
        v = values[f]
        if isinstance(v, bool) or not isinstance(v, (int, float)) or v != v or v in (float("inf"), float("-inf")):
            raise bad(f, "must be a finite number")
    if values["rope_factor"] < 1:  # type: ignore[operator]
        raise bad("rope_factor", "must be >= 1 (1 = no YaRN scaling; DeepSeek-V3 uses 40)")
    for f in ("rope_mscale", "rope_mscale_all_dim"):
        if values[f] < 0:  # type: ignore[operator]
            raise bad(f, "must be >= 0")
    if not 0 < values["rope_beta_slow"] < values["rope_beta_fast"]:  # type: ignore[operator]
        raise bad("rope_beta_slow", f"must be > 0 and below {prefix}rope_beta_fast = {values['rope_beta_fast']} "
                                    "(YaRN interpolates between the two rotation counts)")


# -- the estimate ------------------------------------------------------------------------------

@dataclass(frozen=True)
class MemoryEstimate:
    """Bytes per part ("rotary tables", "activations", ...); see the module docstring."""

    parts: dict[str, int] = field(default_factory=dict)

    @property
    def total(self) -> int:
        return sum(self.parts.values())

    def largest(self) -> str:
        return max(self.parts, key=lambda k: self.parts[k])

    def describe(self) -> str:
        return ", ".join(f"{k} {fmt_bytes(v)}" for k, v in sorted(self.parts.items(), key=lambda kv: -kv[1]) if v)


def rotary_bytes(head_dim: int, positions: int) -> int:
    """Peak bytes while building the fp32 cos/sin tables for ``positions``."""
    return 14 * positions * head_dim + 12 * positions


def training_estimate(cfg: "ModelConfig", batch_size: int, seq_len: int, *, state_shards: int = 1,
                      layer_shards: int = 1, tp: int = 1, activation_checkpointing: bool = False,
                      loss_chunk_tokens: int = 0) -> MemoryEstimate:
    """Per-rank bytes of a training run. ``state_shards``: ways the parameters, grads and
    optimizer state are split (dp_shard x tp x pp); ``layer_shards``: pipeline stages."""
    n = cfg.num_params()
    tokens = batch_size * seq_len
    per_token_layer = 20 * cfg.dim + 6 * cfg.ffn_hidden_dim
    # MTP blocks (model/mtp.py) run after the main ones, unsharded by pipelining (refused with MTP).
    layers = -(-cfg.n_layers // layer_shards) + cfg.mtp_depth
    if activation_checkpointing:
        act_elems = tokens * (cfg.dim * layers + per_token_layer)
    else:
        act_elems = tokens * per_token_layer * layers
    # Unchunked, every MTP depth's logits are alive with the main ones until backward.
    logit_tokens = min(tokens, loss_chunk_tokens) if loss_chunk_tokens else tokens * (1 + cfg.mtp_depth)
    return MemoryEstimate({
        "rotary tables": rotary_bytes(cfg.rope_head_dim, cfg.max_seq_len),
        "weights + grads + AdamW": max(4 * n, 16 * n // max(state_shards, 1)),
        "activations": 4 * act_elems // max(tp, 1),
        "logits": 12 * logit_tokens * cfg.vocab_size // max(tp, 1),
    })


def inference_estimate(cfg: "ModelConfig", param_bytes: float, kv_slots: int, kv_bytes: int,
                       quantized_bytes: float | None = None) -> MemoryEstimate:
    """Bytes to load ``cfg`` for inference: weights (``param_bytes`` per parameter, or
    ``quantized_bytes`` per linear and routed-expert weight of a quantised checkpoint), rotary
    tables and a KV pool of ``kv_slots`` token slots at ``kv_bytes`` per element. MoE routers
    are counted in fp32 (inference keeps them so, unquantised)."""
    n = cfg.num_params()
    emb = cfg.vocab_size * cfg.dim
    router = cfg.n_moe_layers * cfg.dim * cfg.n_routed_experts
    if quantized_bytes is None:
        weights = (n - router) * param_bytes + router * 4
    else:  # embedding and norms stay float; every linear (output projection included) and expert is quantised
        weights = emb * param_bytes + router * 4 + (n - emb - router) * quantized_bytes
    return MemoryEstimate({
        "rotary tables": rotary_bytes(cfg.rope_head_dim, cfg.max_seq_len),
        "weights": int(weights),
        "KV pool": int(kv_bytes_per_token(cfg, kv_bytes) * kv_slots),
    })


# -- what the machine has -------------------------------------------------------------------------

def _cgroup_free() -> int | None:
    try:
        limit = Path("/sys/fs/cgroup/memory.max").read_text().strip()
        if limit == "max":
            return None
        return int(limit) - int(Path("/sys/fs/cgroup/memory.current").read_text())
    except (OSError, ValueError):
        return None


def host_available_bytes() -> int | None:
    """Memory a new allocation can get on this host, or None when unknown."""
    avail = None
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                avail = int(line.split()[1]) * 1024
                break
    except (OSError, ValueError, IndexError):
        pass
    if avail is None:
        try:
            avail = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        except (ValueError, OSError, AttributeError):
            return None
    cg = _cgroup_free()
    return min(avail, cg) if cg is not None else avail


def available_bytes(device) -> tuple[int, str] | None:
    """(bytes free for this process on ``device``, where that figure comes from), or None
    when unknown (meta, mps, ...): then nothing is refused."""
    import torch

    device = torch.device(device)
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free), f"free on {device}"
    if device.type != "cpu":
        return None
    avail = host_available_bytes()
    if avail is None:
        return None
    local = max(int(os.environ.get("LOCAL_WORLD_SIZE", "1") or 1), 1)
    if local > 1:
        return avail // local, f"host memory available / {local} processes"
    return avail, "host memory available"


def check_fits(estimate: MemoryEstimate, available: tuple[int, str] | None,
               blame: dict[str, tuple[str, str]], error: type[TrainforgeError] = ConfigError) -> None:
    """Raise ``error`` when ``estimate`` exceeds ``available``. ``blame`` maps a part to
    (the key = value to name, the fix), the largest part choosing; "*" is the default."""
    if available is None or estimate.total <= available[0]:
        return
    subject, fix = blame.get(estimate.largest(), blame["*"])
    raise error(f"{subject}: the run needs ~{fmt_bytes(estimate.total)} ({estimate.describe()}) but this machine "
                f"has {fmt_bytes(available[0])} available ({available[1]}); {fix}")


def check_training(cfg: "ModelConfig", flavor: str, batch_size: int, seq_len: int, device, *,
                   state_shards: int = 1, layer_shards: int = 1, tp: int = 1,
                   activation_checkpointing: bool = False, loss_chunk_tokens: int = 0,
                   available: tuple[int, str] | None | str = "probe") -> MemoryEstimate:
    """The trainer's preflight: ConfigError naming training.seq_len / training.batch_size
    or model.flavor when the run cannot fit. ``available`` defaults to probing ``device``."""
    est = training_estimate(cfg, batch_size, seq_len, state_shards=state_shards, layer_shards=layer_shards, tp=tp,
                            activation_checkpointing=activation_checkpointing, loss_chunk_tokens=loss_chunk_tokens)
    sizes = (f"training.seq_len = {seq_len}", "lower training.seq_len or training.batch_size")
    check_fits(est, available_bytes(device) if available == "probe" else available, {  # type: ignore[arg-type]
        "rotary tables": (f"training.seq_len = {seq_len}", "lower training.seq_len"),
        "activations": sizes, "logits": sizes,
        "*": (f"model.flavor = {flavor!r} ({cfg.num_params() / 1e6:,.0f}M parameters)",
              "choose a smaller model.flavor, or shard it over more processes (parallel.dp_shard)")})
    return est


def check_inference(cfg: "ModelConfig", device, param_bytes: float, kv_slots: int, kv_bytes: int, *,
                    positions_key: str, where: str, quantized_bytes: float | None = None,
                    available: tuple[int, str] | None | str = "probe",
                    error: type[TrainforgeError] = ConfigError) -> MemoryEstimate:
    """Inference loading's preflight; ``positions_key`` names the source of max_seq_len
    (e.g. "config.json key 'max_position_embeddings'"), ``where`` the checkpoint."""
    est = inference_estimate(cfg, param_bytes, kv_slots, kv_bytes, quantized_bytes)
    check_fits(est, available_bytes(device) if available == "probe" else available, {  # type: ignore[arg-type]
        "rotary tables": (f"{where}: {positions_key} = {cfg.max_seq_len}",
                          "lower it (the rotary tables cover every position)"),
        "KV pool": (f"{where}: a KV pool of {kv_slots} token slots",
                    "lower --max_context, --max_batch_size or --n_blocks"),
        "*": (f"{where}: {cfg.num_params() / 1e6:,.0f}M parameters",
              "load it in a smaller --dtype, with --quantize, or on a larger device")}, error)
    return est


def check_writable_dir(path: str | Path, what: str) -> None:
    """Raise ConfigError naming ``path`` unless a file can be created in it (or, when it
    does not exist yet, in its nearest existing parent). Leaves nothing behind. A probe
    file, not ``os.access``: root ignores permission bits, but not read-only mounts."""
    import tempfile

    path = Path(path)
    probe_dir = path
    while not probe_dir.exists() and probe_dir != probe_dir.parent:
        probe_dir = probe_dir.parent
    try:
        fd, tmp = tempfile.mkstemp(prefix=".trainforge-write-probe-", dir=probe_dir)
        os.close(fd)
        os.unlink(tmp)
    except OSError as e:
        raise ConfigError(f"{what} {path} is not writable ({e.strerror} in {probe_dir}); choose another "
                          "directory or fix its permissions") from None
