"""Weight and config conversion between ``Transformer`` and Hugging Face ``LlamaForCausalLM``.

Our attention applies rotary embeddings in HF's "rotate half" layout (the two halves
of each head are rotated against each other, not interleaved pairs), so the query and
key projections need no row permutation: converting weights is renaming keys only.
Tensors are passed through untouched (same objects, same dtype), so a round trip is exact.

Tied embeddings: both ``Transformer.state_dict()`` and ``LlamaForCausalLM.state_dict()``
list the shared matrix under both names, and both modules' strict ``load_state_dict``
want both names. So the converters emit the output/lm_head key as the *same tensor* as
the embedding, and accept input with or without it (HF's ``save_pretrained`` drops
``lm_head.weight`` when tied). To write such a dict with ``safetensors.torch.save_file``,
drop ``lm_head.weight`` first: safetensors refuses tensors that share memory.

The config dicts follow ``transformers`` 5 (``rope_parameters``, ``dtype``) and also carry
the 4.x spellings (``rope_theta``, ``torch_dtype``) with the same values, so a written
``config.json`` loads in either major version. This module is hand-written because
transformers ships converters *into* HF from Meta's layout, not from ours.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from trainforge.errors import CheckpointError
from trainforge.model.config import ModelConfig
from trainforge.model.preflight import HF_KEYS, check_shape

# Non-persistent in current transformers, but stored in some older checkpoints
# (per layer, ``model.layers.{i}.self_attn.rotary_emb.inv_freq``); recomputed from the config.
_IGNORED_HF_SUFFIX = "rotary_emb.inv_freq"

_LAYER_NAMES = (  # (ours, HF) relative to ``layers.{i}.`` / ``model.layers.{i}.``
    ("attention.wq.weight", "self_attn.q_proj.weight"),
    ("attention.wk.weight", "self_attn.k_proj.weight"),
    ("attention.wv.weight", "self_attn.v_proj.weight"),
    ("attention.wo.weight", "self_attn.o_proj.weight"),
    ("feed_forward.w1.weight", "mlp.gate_proj.weight"),
    ("feed_forward.w2.weight", "mlp.down_proj.weight"),
    ("feed_forward.w3.weight", "mlp.up_proj.weight"),
    ("attention_norm.weight", "input_layernorm.weight"),
    ("ffn_norm.weight", "post_attention_layernorm.weight"),
)


def _key_table(cfg: ModelConfig) -> list[tuple[str, str, tuple[int, ...]]]:
    """(our key, HF key, expected shape) for every weight of ``cfg``, output projection last."""
    _refuse_hourglass(cfg)
    d, hd, f = cfg.dim, cfg.head_dim, cfg.ffn_hidden_dim
    layer_shapes = {
        "attention.wq.weight": (cfg.n_heads * hd, d),
        "attention.wk.weight": (cfg.n_kv_heads * hd, d),
        "attention.wv.weight": (cfg.n_kv_heads * hd, d),
        "attention.wo.weight": (d, cfg.n_heads * hd),
        "feed_forward.w1.weight": (f, d),
        "feed_forward.w2.weight": (d, f),
        "feed_forward.w3.weight": (f, d),
        "attention_norm.weight": (d,),
        "ffn_norm.weight": (d,),
    }
    table = [("tok_embeddings.weight", "model.embed_tokens.weight", (cfg.vocab_size, d))]
    for i in range(cfg.n_layers):
        table += [(f"layers.{i}.{ours}", f"model.layers.{i}.{hf}", layer_shapes[ours]) for ours, hf in _LAYER_NAMES]
    table.append(("norm.weight", "model.norm.weight", (d,)))
    table.append(("output.weight", "lm_head.weight", (cfg.vocab_size, d)))
    return table


def _refuse_hourglass(cfg: ModelConfig) -> None:
    """An hourglass model (hourglass.py) is not a Llama: its shortened blocks are narrower and
    its pools have no Hugging Face counterpart, so it is never written as one."""
    if cfg.is_hourglass:
        from trainforge.errors import ConfigError

        raise ConfigError(f"model.hourglass = {cfg.hourglass!r}: hourglass models have no Hugging Face layout; "
                          "keep the trainforge checkpoint (export a dense model)")


def _convert(sd: dict[str, torch.Tensor], cfg: ModelConfig, src: int, what: str) -> dict[str, torch.Tensor]:
    """Rename keys of ``sd`` from side ``src`` (0 = ours, 1 = HF) to the other side.

    Raises ``CheckpointError`` naming every missing, unexpected or mis-shaped key."""
    if cfg.is_moe:
        raise CheckpointError(f"{what} state dict: the Hugging Face layout here is LlamaForCausalLM's, which has "
                              "no experts; mixture-of-experts models convert as Glm4MoeForCausalLM or "
                              "MixtralForCausalLM (model/hf_moe.py), or DeepseekV3ForCausalLM with latent "
                              "attention (model/hf_deepseek.py)")
    if cfg.is_mla:
        raise CheckpointError(f"{what} state dict: the Hugging Face layout here is LlamaForCausalLM's; latent-"
                              "attention (MLA) models convert as DeepseekV3ForCausalLM (model/hf_deepseek.py)")
    if cfg.mtp_depth:
        raise CheckpointError(f"{what} state dict: the Hugging Face layout here is LlamaForCausalLM's, which has "
                              f"no multi-token prediction modules (model.mtp_depth = {cfg.mtp_depth}); drop them by "
                              "training with model.mtp_depth = 0, or use a DeepSeek-V3 model (model/hf_deepseek.py)")
    table = _key_table(cfg)
    dst = 1 - src
    emb_src, emb_dst = table[0][src], table[0][dst]
    out_src, out_dst = table[-1][src], table[-1][dst]
    if src == 1:
        sd = {k: v for k, v in sd.items() if not k.endswith(_IGNORED_HF_SUFFIX)}

    expected = {row[src] for row in table}
    missing = sorted(expected - sd.keys())
    if cfg.tie_embeddings and out_src in missing:
        missing.remove(out_src)  # tied: the embedding stands in for the output projection
    unexpected = sorted(sd.keys() - expected)
    if missing or unexpected:
        raise CheckpointError(
            f"{what} state dict does not match the model config (n_layers={cfg.n_layers}, "
            f"tie_embeddings={cfg.tie_embeddings}): missing keys {missing}, unexpected keys {unexpected}")

    bad_shapes = [f"{row[src]}: {tuple(sd[row[src]].shape)} != expected {row[2]}"
                  for row in table if row[src] in sd and tuple(sd[row[src]].shape) != row[2]]
    if bad_shapes:
        raise CheckpointError(f"{what} state dict has tensors of the wrong shape for the model config: "
                              + "; ".join(bad_shapes))

    if cfg.tie_embeddings and out_src in sd and sd[out_src] is not sd[emb_src] \
            and not torch.equal(sd[out_src], sd[emb_src]):
        raise CheckpointError(
            f"{what} state dict has {out_src} different from {emb_src}, but the model config has "
            f"tie_embeddings=True; set tie_embeddings=False to keep both matrices")

    out = {row[dst]: sd[row[src]] for row in table if row[src] in sd}
    if cfg.tie_embeddings:
        out[out_dst] = out[emb_dst]  # the same tensor, as the tied module's state_dict has it
    return out


def to_hf_state_dict(sd: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """Our ``Transformer`` state dict -> ``LlamaForCausalLM`` state dict (keys renamed,
    tensors shared, not copied). With ``cfg.tie_embeddings``, ``lm_head.weight`` is the
    embedding tensor itself, so ``LlamaForCausalLM.load_state_dict(strict=True)`` accepts it.

    Raises ``CheckpointError`` naming any missing, unexpected or mis-shaped key."""
    return _convert(sd, cfg, src=0, what="trainforge")


def from_hf_state_dict(sd: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """``LlamaForCausalLM`` state dict -> our ``Transformer`` state dict (keys renamed,
    tensors shared, not copied). ``*rotary_emb.inv_freq`` keys are ignored; with
    ``cfg.tie_embeddings``, ``lm_head.weight`` may be absent but must equal the embedding if present.

    Raises ``CheckpointError`` naming any missing, unexpected or mis-shaped key."""
    return _convert(sd, cfg, src=1, what="Hugging Face")


def key_map(cfg: ModelConfig) -> dict[str, str]:
    """Our weight key -> its HF key (the quantised export renames stored tensors with it)."""
    return {ours: theirs for ours, theirs, _ in _key_table(cfg)}


def rows_to_hf(cfg: ModelConfig, key: str, t: torch.Tensor) -> torch.Tensor:
    """A tensor indexed by the rows of our weight ``key`` (its codes, scales) in HF's row order:
    the Llama layout renames only."""
    return t


def rows_from_hf(cfg: ModelConfig, key: str, t: torch.Tensor, hf_config: dict[str, Any] | None = None
                 ) -> torch.Tensor:
    """The inverse of ``rows_to_hf``."""
    return t


def to_hf_config_dict(cfg: ModelConfig, dtype: str = "float32") -> dict[str, Any]:
    """A ``config.json`` dict for ``LlamaForCausalLM``; ``transformers.LlamaConfig(**d)`` accepts it.

    ``dtype`` is the dtype the weights are stored in ("float32", "bfloat16", ...).
    Token ids (bos/eos/pad) belong to the tokenizer and are left to the caller."""
    _refuse_hourglass(cfg)
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": cfg.dim,
        "intermediate_size": cfg.ffn_hidden_dim,
        "num_attention_heads": cfg.n_heads,
        "num_key_value_heads": cfg.n_kv_heads,
        "head_dim": cfg.head_dim,
        "num_hidden_layers": cfg.n_layers,
        "vocab_size": cfg.vocab_size,
        "rms_norm_eps": cfg.norm_eps,
        "max_position_embeddings": cfg.max_seq_len,
        "tie_word_embeddings": cfg.tie_embeddings,
        "attention_bias": False,
        "mlp_bias": False,
        "hidden_act": "silu",
        # transformers >= 5 reads rope_parameters and dtype; 4.x reads rope_theta and torch_dtype.
        "rope_parameters": {"rope_type": "default", "rope_theta": cfg.rope_theta},
        "rope_theta": cfg.rope_theta,
        "dtype": dtype,
        "torch_dtype": dtype,
    }


def _rope_theta(d: dict[str, Any]) -> float:
    """rope theta from a config.json dict, rejecting any rope scaling our model does not implement."""
    theta = d.get("rope_theta")
    for key in ("rope_parameters", "rope_scaling"):
        params = d.get(key)
        if params is None:
            continue
        if not isinstance(params, dict):
            raise CheckpointError(f"config.json key {key!r} must be a dict, got {params!r}")
        rope_type = params.get("rope_type", params.get("type", "default"))
        if rope_type != "default":
            raise CheckpointError(
                f"config.json key {key!r} has rope_type={rope_type!r}; trainforge models only "
                f"unscaled rope (rope_type 'default')")
        if params.get("partial_rotary_factor", 1.0) != 1.0:
            raise CheckpointError(f"config.json key {key!r} has partial_rotary_factor="
                                  f"{params['partial_rotary_factor']}; only full rotary embeddings are supported")
        theta = params.get("rope_theta", theta)
    return float(theta if theta is not None else 10000.0)


def _int_key(d: dict[str, Any], key: str, default: Any) -> Any:
    """``d[key]`` as an int when it is one (3.0 counts); anything else is returned for
    ``check_shape`` to refuse by name."""
    v = d.get(key)
    if v is None:
        v = default
    if isinstance(v, float) and v.is_integer():
        return int(v)
    return v


def model_config_from_hf(d: dict[str, Any]) -> ModelConfig:
    """``ModelConfig`` from a Hugging Face Llama ``config.json`` dict (or ``LlamaConfig.to_dict()``).

    Defaults for absent keys are ``LlamaConfig``'s. Raises ``CheckpointError`` naming
    the key when the checkpoint uses a feature our model does not implement."""
    if not isinstance(d, dict):
        raise CheckpointError(f"config.json holds a {type(d).__name__}, not a JSON object of Llama settings")
    model_type = d.get("model_type", "llama")
    if model_type != "llama":
        raise CheckpointError(f"config.json key 'model_type' is {model_type!r}; only 'llama' checkpoints convert "
                              "here ('deepseek_v3' ones through model/hf_deepseek.py)")
    for key in ("attention_bias", "mlp_bias"):
        if d.get(key, False):
            raise CheckpointError(f"config.json key {key!r} is true; trainforge models have no linear biases")
    if d.get("hidden_act", "silu") != "silu":
        raise CheckpointError(f"config.json key 'hidden_act' is {d['hidden_act']!r}; only 'silu' (SwiGLU) is supported")
    if d.get("partial_rotary_factor", 1.0) != 1.0:
        raise CheckpointError(f"config.json key 'partial_rotary_factor' is {d['partial_rotary_factor']}; "
                              f"only full rotary embeddings are supported")
    for key in ("hidden_size", "num_attention_heads", "num_hidden_layers", "vocab_size", "intermediate_size"):
        if key not in d:
            raise CheckpointError(f"config.json is missing required key {key!r}")
    values = {ours: _int_key(d, hf, default) for ours, hf, default in (
        ("dim", "hidden_size", None), ("n_heads", "num_attention_heads", None), ("n_layers", "num_hidden_layers", None),
        ("vocab_size", "vocab_size", None), ("ffn_hidden_dim", "intermediate_size", None),
        ("n_kv_heads", "num_key_value_heads", d.get("num_attention_heads")),
        ("max_seq_len", "max_position_embeddings", 2048))}
    # Named by their config.json keys, before anything divides by them or sizes a table.
    check_shape(values, HF_KEYS, prefix="config.json key", error=CheckpointError)
    dim, n_heads = values["dim"], values["n_heads"]
    head_dim = d.get("head_dim")
    if head_dim is not None and head_dim * n_heads != dim:
        raise CheckpointError(f"config.json key 'head_dim' is {head_dim}, but trainforge derives it as "
                              f"hidden_size / num_attention_heads = {dim // n_heads}")
    eps, theta = d.get("rms_norm_eps", 1e-6), _rope_theta(d)
    for key, v in (("rms_norm_eps", eps), ("rope_theta", theta)):
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0:
            raise CheckpointError(f"config.json key {key!r} = {v!r:.40}: must be a finite number > 0")
    return ModelConfig(
        dim=dim,
        n_layers=values["n_layers"],
        n_heads=n_heads,
        n_kv_heads=values["n_kv_heads"],
        vocab_size=values["vocab_size"],
        ffn_hidden_dim=values["ffn_hidden_dim"],
        norm_eps=float(eps),
        rope_theta=theta,
        max_seq_len=values["max_seq_len"],
        tie_embeddings=bool(d.get("tie_word_embeddings", False)),
    )
