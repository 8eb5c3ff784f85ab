"""Conversion between trainforge's mixture-of-experts models with standard (GQA) attention
and two Hugging Face classes: ``config.json`` <-> ``ModelConfig`` and state dicts both ways.
``loading/loader.py`` reads such directories, ``infer/hf_export.py`` writes them. (Latent
attention converts as DeepSeek-V3, ``model/hf_deepseek.py``; dense models as Llama, ``model/hf.py``.)

Which class (the router decides; each computes exactly what our ``MoE`` does):

* ``score_func = "sigmoid"`` -> ``Glm4MoeForCausalLM`` (``glm4_moe``): DeepSeek-V3's router
  (sigmoid scores, ``e_score_correction_bias`` = our ``expert_bias`` added for selection only,
  groups ranked by their top-2 biased scores, ``topk_group`` of ``n_group`` kept, -inf mask, the
  chosen unbiased scores renormalised, times ``routed_scaling_factor``), shared experts
  (``n_shared_experts`` x ``moe_intermediate_size`` wide), the first ``first_k_dense_replace``
  blocks dense, and Llama's attention (q/k/v/o, rotate-half rotary, as ours). Written with
  ``partial_rotary_factor = 1.0`` (transformers' default for glm4_moe is 0.5), ``use_qk_norm``
  and ``attention_bias`` false. ``n_shared_experts = 0`` is written as transformers itself saves
  it: zero-width shared-expert tensors, whose output is exactly 0.
* ``score_func = "softmax"`` -> ``MixtralForCausalLM``: softmax over all experts, top-k, always
  renormalised, no selection bias, no groups, no scale, no shared experts, no dense blocks.
  Anything else is refused naming the ``[model]`` key to change. (Qwen3-MoE always normalises
  queries and keys per head, Qwen2-MoE gates its shared expert with a sigmoid: neither is ours.)

Experts: files hold one tensor per expert (``mlp.experts.{e}.gate_proj/up_proj/down_proj``;
Mixtral's ``block_sparse_moe.experts.{e}.w1/w3/w2``, the names of ours), transformers' in-memory
state dict the fused ``mlp.experts.gate_up_proj`` (E, 2·inter, dim) and ``down_proj`` (E, dim,
inter). Both are read; the files' layout is written. Ours are stacked: w1 (gate), w3 (up), w2 (down).

MTP (glm4_moe only): written and read as ``model.layers.{num_hidden_layers + d}``, the
DeepSeek-V3 layout GLM-4.5's checkpoints use (``hf_deepseek``'s docstring). ``Glm4MoeForCausalLM``
itself reports such a layer as unexpected keys and runs without it; the logits are the main model's.
"""

from __future__ import annotations

from typing import Any

import torch

from trainforge.errors import CheckpointError, TrainforgeError
from trainforge.model.config import ModelConfig
# The DeepSeek-V3 layout's MoE and MTP names are glm4_moe's too; its checks are shared.
from trainforge.model.hf_deepseek import (_DENSE, _EXPERTS, _MOE, _MTP, _MTP_SHARED, _NORMS, _check_shapes,
                                          _num, _same, add_experts_and_copies, check_hf_keys, check_our_keys,
                                          compressed_tensors, stack_experts_and_tie, unfuse_experts)
from trainforge.model.hf import _rope_theta

GLM4_MOE, MIXTRAL = "glm4_moe", "mixtral"
_ATTENTION = (("attention.wq.weight", "self_attn.q_proj.weight"), ("attention.wk.weight", "self_attn.k_proj.weight"),
              ("attention.wv.weight", "self_attn.v_proj.weight"), ("attention.wo.weight", "self_attn.o_proj.weight"))
_SHARED = tuple(row for row in _MOE if "shared_experts" in row[0])
_MIXTRAL_ROUTER = (("feed_forward.router.gate.weight", "block_sparse_moe.gate.weight"),)
_MIXTRAL_EXPERTS = (("w1", "w1"), ("w2", "w2"), ("w3", "w3"))
_BIAS = "feed_forward.router.expert_bias"
_IGNORED_SUFFIX = "rotary_emb.inv_freq"


def is_hf_moe(d: Any) -> bool:
    """Whether a config.json dict describes one of this module's classes."""
    return isinstance(d, dict) and d.get("model_type") in (GLM4_MOE, MIXTRAL)


def family(cfg: ModelConfig) -> str:
    """``"glm4_moe"`` or ``"mixtral"`` for ``cfg``; ``CheckpointError`` naming the ``[model]`` key
    when neither class computes what ``cfg``'s model does."""
    if not cfg.is_moe or cfg.is_mla:
        raise CheckpointError("the Glm4Moe / Mixtral layouts are for mixture-of-experts models with standard "
                              "attention; dense models convert as Llama (model/hf.py), latent attention as "
                              "DeepSeek-V3 (model/hf_deepseek.py)")
    if cfg.score_func == "sigmoid":
        if cfg.n_routed_experts < 2:
            raise CheckpointError(f"model.n_routed_experts = {cfg.n_routed_experts}: Glm4MoeForCausalLM ranks "
                                  "expert groups by their top-2 scores and needs at least 2 experts")
        return GLM4_MOE
    fix = "; or use score_func = 'sigmoid' (exported as Glm4MoeForCausalLM, which has all of these)"
    refusals = (("n_shared_experts", cfg.n_shared_experts, 0, "has no shared experts"),
                ("n_dense_layers", cfg.n_dense_layers, 0, "has no dense blocks"),
                ("n_group", cfg.n_group, 1, "has no group-limited routing"),
                ("route_scale", cfg.route_scale, 1.0, "does not scale the routing weights"),
                ("norm_topk_prob", cfg.norm_topk_prob, True, "always renormalises the chosen weights"),
                ("mtp_depth", cfg.mtp_depth, 0, "has no multi-token prediction modules"))
    for key, value, want, why in refusals:
        if value != want:
            raise CheckpointError(f"model.{key} = {value!r}: a softmax-routed MoE exports as MixtralForCausalLM, "
                                  f"which {why}; set model.{key} = {want!r}{fix}")
    return MIXTRAL


def _blocks(cfg: ModelConfig) -> list[tuple[int, str, str]]:
    """(layer index, our prefix, HF prefix) of every block, then one per MTP depth."""
    n = cfg.n_layers
    return ([(i, f"layers.{i}.", f"model.layers.{i}.") for i in range(n)]
            + [(n + d, f"mtp.{d}.block.", f"model.layers.{n + d}.") for d in range(cfg.mtp_depth)])


def _key_table(cfg: ModelConfig, fam: str) -> list[tuple[str, str]]:
    """(our key, HF key) for every weight but the routed experts, Mixtral's absent selection
    bias and the MTP copies of the embedding and head; the output projection last."""
    table = [("tok_embeddings.weight", "model.embed_tokens.weight")]
    for layer, ours, hf in _blocks(cfg):
        if not cfg.is_moe_layer(layer):
            ffn = _DENSE
        elif fam == MIXTRAL:
            ffn = _MIXTRAL_ROUTER
        else:
            ffn = _MOE if cfg.n_shared_experts else tuple(r for r in _MOE if r not in _SHARED)
        table += [(ours + o, hf + h) for o, h in (*_NORMS, *_ATTENTION, *ffn)]
    n = cfg.n_layers
    for d in range(cfg.mtp_depth):
        table += [(f"mtp.{d}.{o}", f"model.layers.{n + d}.{h}") for o, h in _MTP]
    return table + [("norm.weight", "model.norm.weight"), ("output.weight", "lm_head.weight")]


def _expert_table(cfg: ModelConfig, fam: str) -> list[tuple[str, list[str]]]:
    """(our stacked key, [HF per-expert keys]) for every MoE block."""
    names, mlp = (_MIXTRAL_EXPERTS, "block_sparse_moe") if fam == MIXTRAL else (_EXPERTS, "mlp")
    return [(f"{ours}feed_forward.experts.{o}", [f"{hf}{mlp}.experts.{e}.{h}.weight"
                                                for e in range(cfg.n_routed_experts)])
            for layer, ours, hf in _blocks(cfg) if cfg.is_moe_layer(layer) for o, h in names]


def _empty_shared(cfg: ModelConfig) -> dict[str, tuple[int, int]]:
    """glm4_moe with ``n_shared_experts = 0``: transformers' zero-width shared-expert tensors."""
    if cfg.n_shared_experts:
        return {}
    shapes = {"gate_proj": (0, cfg.dim), "up_proj": (0, cfg.dim), "down_proj": (cfg.dim, 0)}
    return {f"{hf}mlp.shared_experts.{p}.weight": s for layer, _, hf in _blocks(cfg) if cfg.is_moe_layer(layer)
            for p, s in shapes.items()}


def _unfuse(sd: dict[str, torch.Tensor], fam: str) -> dict[str, torch.Tensor]:
    """transformers' in-memory layout (``mlp.experts.gate_up_proj`` / ``down_proj``, Mixtral's
    router as ``mlp.gate``) as the files' per-expert keys; a files' dict as it is."""
    if not any(k.endswith("mlp.experts.gate_up_proj") for k in sd):
        return sd
    if fam != MIXTRAL:
        return unfuse_experts(sd)
    sd = unfuse_experts(sd, ("w1", "w3", "w2"), lambda p: p.replace(".mlp.", ".block_sparse_moe."))
    return {k.replace(".mlp.gate.", ".block_sparse_moe.gate."): v for k, v in sd.items()}


def from_hf_state_dict(sd: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """A ``Glm4MoeForCausalLM`` / ``MixtralForCausalLM`` state dict (files' or in-memory layout;
    which class from ``cfg.score_func``) -> our ``Transformer`` state dict, MTP layers included.
    Experts are stacked (a copy); a Mixtral router's selection bias is zeros; other tensors are
    passed through. Raises ``CheckpointError`` naming missing, unexpected or mis-shaped keys."""
    fam = family(cfg)
    sd = _unfuse({k: v for k, v in sd.items() if not k.endswith(_IGNORED_SUFFIX)}, fam)
    table, experts, empty = _key_table(cfg, fam), _expert_table(cfg, fam), _empty_shared(cfg)
    n = cfg.n_layers
    copies = {f"model.layers.{n + d}.{h}": o for d in range(cfg.mtp_depth) for o, h in _MTP_SHARED}
    check_hf_keys(sd, {h for _, h in table} | {h for _, hs in experts for h in hs}, copies.keys() | empty.keys(),
                  cfg)
    nonempty = [k for k, shape in empty.items() if k in sd and tuple(sd[k].shape) != shape]
    if nonempty:
        raise CheckpointError(f"Hugging Face state dict: {nonempty[0]} has shape {tuple(sd[nonempty[0]].shape)}, "
                              "but config.json has n_shared_experts = 0 (zero-width shared experts)")
    out = stack_experts_and_tie({o: sd[h] for o, h in table if h in sd}, sd, experts, cfg)
    if fam == MIXTRAL:  # no selection bias in Mixtral: ours is zero
        for layer, ours, _ in _blocks(cfg):
            if cfg.is_moe_layer(layer):
                out[ours + _BIAS] = torch.zeros(cfg.n_routed_experts, device=out["tok_embeddings.weight"].device)
    _check_shapes(out, cfg, {o: h for o, h in table} | {o: f"{hs[0]} .. {hs[-1]} (stacked)" for o, hs in experts})
    for h, o in copies.items():  # our MTP modules use the main embedding and head
        if h in sd and not _same(sd[h], out[o]):
            raise CheckpointError(f"Hugging Face state dict: {h} differs from the main model's; trainforge's "
                                  "multi-token prediction modules share the main embedding and output head")
    return out


def to_hf_state_dict(sd: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """Our ``Transformer`` state dict -> the files' layout of ``Glm4MoeForCausalLM`` (sigmoid
    routing) or ``MixtralForCausalLM`` (softmax): per-expert weights (views into our stacked
    tensors), MTP depth d as ``model.layers.{n_layers + d}`` with the main embedding and head as
    its copies (the same objects; the streaming writer writes each name's bytes). Raises
    ``CheckpointError`` naming missing or unexpected keys, a config neither class expresses
    (``family``), or a softmax router with a nonzero selection bias (Mixtral has none)."""
    fam = family(cfg)
    table, experts = _key_table(cfg, fam), _expert_table(cfg, fam)
    biases = [ours + _BIAS for layer, ours, _ in _blocks(cfg) if fam == MIXTRAL and cfg.is_moe_layer(layer)]
    check_our_keys(sd, {o for o, _ in table} | {o for o, _ in experts} | set(biases), cfg)
    biased = [k for k in biases if bool(sd[k].any())]
    if biased:
        raise CheckpointError(f"{biased[0]} is nonzero (trained with model.bias_update_rate > 0): "
                              "MixtralForCausalLM has no selection bias, so its experts would differ; train "
                              "with model.bias_update_rate = 0, or use score_func = 'sigmoid' (Glm4MoeForCausalLM)")
    out = {h: sd[o] for o, h in table if o in sd}
    ref = sd["tok_embeddings.weight"]
    out.update({k: ref.new_empty(shape) for k, shape in _empty_shared(cfg).items()})
    return add_experts_and_copies(out, sd, experts, cfg)


# -- config.json ----------------------------------------------------------------------------------

def field_to_hf(model_type: str) -> dict[str, str]:
    """ModelConfig field -> the config.json key of a Glm4Moe or Mixtral directory (what an
    error about its shape names)."""
    glm = model_type == GLM4_MOE
    return {**_FIELD_TO_HF, "n_routed_experts": "n_routed_experts" if glm else "num_local_experts",
            "moe_inter_dim": "moe_intermediate_size" if glm else "intermediate_size",
            "tie_embeddings": "tie_word_embeddings"}


_FIELD_TO_HF = {"dim": "hidden_size", "n_layers": "num_hidden_layers", "n_heads": "num_attention_heads",
                "n_kv_heads": "num_key_value_heads", "vocab_size": "vocab_size", "ffn_hidden_dim": "intermediate_size",
                "max_seq_len": "max_position_embeddings", "n_activated_experts": "num_experts_per_tok",
                "n_shared_experts": "n_shared_experts", "n_dense_layers": "first_k_dense_replace",
                "route_scale": "routed_scaling_factor", "n_group": "n_group", "topk_group": "topk_group",
                "mtp_depth": "num_nextn_predict_layers"}


def to_hf_config_dict(cfg: ModelConfig, dtype: str = "float32") -> dict[str, Any]:
    """A ``config.json`` dict for ``Glm4MoeForCausalLM`` or ``MixtralForCausalLM`` (``family``);
    ``transformers.AutoConfig.for_model(**d)`` accepts it. Token ids are left to the caller."""
    fam = family(cfg)
    common = {
        "hidden_size": cfg.dim, "num_hidden_layers": cfg.n_layers, "num_attention_heads": cfg.n_heads,
        "num_key_value_heads": cfg.n_kv_heads, "head_dim": cfg.head_dim, "vocab_size": cfg.vocab_size,
        "rms_norm_eps": cfg.norm_eps, "max_position_embeddings": cfg.max_seq_len,
        "tie_word_embeddings": cfg.tie_embeddings, "hidden_act": "silu",
        "num_experts_per_tok": cfg.n_activated_experts, "rope_theta": cfg.rope_theta, "dtype": dtype,
        "torch_dtype": dtype}
    if fam == MIXTRAL:
        return {"architectures": ["MixtralForCausalLM"], "model_type": MIXTRAL, **common,
                "intermediate_size": cfg.moe_inter_dim, "num_local_experts": cfg.n_routed_experts,
                "sliding_window": None, "router_jitter_noise": 0.0,
                "rope_parameters": {"rope_type": "default", "rope_theta": cfg.rope_theta}}
    return {"architectures": ["Glm4MoeForCausalLM"], "model_type": GLM4_MOE, **common,
            "intermediate_size": cfg.ffn_hidden_dim, "moe_intermediate_size": cfg.moe_inter_dim,
            "n_routed_experts": cfg.n_routed_experts, "n_shared_experts": cfg.n_shared_experts,
            "first_k_dense_replace": cfg.n_dense_layers, "routed_scaling_factor": cfg.route_scale,
            "n_group": cfg.n_group, "topk_group": cfg.topk_group, "norm_topk_prob": True,
            "num_nextn_predict_layers": cfg.mtp_depth, "attention_bias": False, "use_qk_norm": False,
            # glm4_moe's default is 0.5 (GLM-4.5 rotates half of each head); ours rotates all of it.
            "partial_rotary_factor": 1.0,
            "rope_parameters": {"rope_type": "default", "rope_theta": cfg.rope_theta, "partial_rotary_factor": 1.0}}


def key_map(cfg: ModelConfig) -> dict[str, str]:
    """Our weight key -> its HF key, routed experts left out (the quantised export renames
    stored tensors with it)."""
    return dict(_key_table(cfg, family(cfg)))


def expert_key_map(cfg: ModelConfig) -> dict[str, list[str]]:
    """Our stacked expert key (``...experts.w1``) -> its per-expert HF weight keys, expert order."""
    return dict(_expert_table(cfg, family(cfg)))


def rows_to_hf(cfg: ModelConfig, key: str, t: torch.Tensor) -> torch.Tensor:
    """Rows of our weight ``key`` in HF's order: both classes use our half-split rotary layout."""
    return t


def rows_from_hf(cfg: ModelConfig, key: str, t: torch.Tensor, hf_config: dict[str, Any] | None = None
                 ) -> torch.Tensor:
    return t


def _refuse(d: dict[str, Any], rules: tuple[tuple[str, Any, str], ...]) -> None:
    for key, want, why in rules:
        if key in d and d[key] != want and not (want is None and d[key] is None):
            raise CheckpointError(f"config.json key {key!r} = {d[key]!r:.80}: {why}")


def model_config_from_hf(d: dict[str, Any], mtp_weights: bool = True) -> ModelConfig:
    """``ModelConfig`` from a ``glm4_moe`` or ``mixtral`` ``config.json`` dict (or the class's
    ``to_dict()``); absent keys take transformers' defaults. glm4_moe's ``num_nextn_predict_layers``
    becomes ``mtp_depth`` only when ``mtp_weights`` (the files hold those layers; ``save_pretrained``
    writes the key without them). Raises ``CheckpointError`` naming the config.json key of any
    value trainforge does not implement or that does not form a model."""
    if not is_hf_moe(d):
        raise CheckpointError(f"config.json key 'model_type' is {d.get('model_type') if isinstance(d, dict) else d!r}"
                              f"; expected {GLM4_MOE!r} or {MIXTRAL!r}")
    glm = d["model_type"] == GLM4_MOE
    _refuse(d, (("hidden_act", "silu", "only 'silu' (SwiGLU) is implemented"),
                ("attention_bias", False, "trainforge's projections have no biases"),
                ("use_qk_norm", False, "trainforge's attention has no per-head query/key norm"),
                ("norm_topk_prob", True, "trainforge's sigmoid router always renormalises the chosen weights"),
                *(() if compressed_tensors(d) else (("quantization_config", None, "quantised weights are not loaded "
                                                     "(other than compressed-tensors int8/int4); dequantise them "
                                                     "first"),))))
    if not glm and d.get("sliding_window") is not None \
            and d["sliding_window"] < d.get("max_position_embeddings", 131072):
        raise CheckpointError(f"config.json key 'sliding_window' = {d['sliding_window']!r}: trainforge's "
                              "attention is full causal attention (no sliding window)")
    if glm:  # transformers takes rope_parameters' factor, else the top-level one, else glm4_moe's 0.5
        params = d.get("rope_parameters") if isinstance(d.get("rope_parameters"), dict) else {}
        factor = params.get("partial_rotary_factor", d.get("partial_rotary_factor", 0.5))
        if factor != 1.0:
            raise CheckpointError(f"config.json key 'partial_rotary_factor' = {factor!r} (glm4_moe's default is "
                                  "0.5): trainforge rotates the whole head; only 1.0 is supported")
    for key in ("hidden_size", "num_hidden_layers", "num_attention_heads", "vocab_size", "intermediate_size",
                *(("moe_intermediate_size", "n_routed_experts") if glm else ())):
        if d.get(key) is None:
            raise CheckpointError(f"config.json is missing required key {key!r}")
    n_heads, dim = _num(d, "num_attention_heads", None), _num(d, "hidden_size", None)
    head_dim = d.get("head_dim")
    if head_dim is not None and head_dim * n_heads != dim:
        raise CheckpointError(f"config.json key 'head_dim' is {head_dim}, but trainforge derives it as "
                              f"hidden_size / num_attention_heads = {dim // n_heads if n_heads else '?'}")
    values: dict[str, Any] = dict(
        dim=dim, n_layers=_num(d, "num_hidden_layers", None), n_heads=n_heads,
        n_kv_heads=_num(d, "num_key_value_heads", n_heads), vocab_size=_num(d, "vocab_size", None),
        ffn_hidden_dim=_num(d, "intermediate_size", None),
        norm_eps=_num(d, "rms_norm_eps", 1e-5, float),
        max_seq_len=_num(d, "max_position_embeddings", 131072),
        tie_embeddings=bool(d.get("tie_word_embeddings", False)),
        rope_theta=_rope_theta({"rope_theta": 10000.0 if glm else 1e6, **d}),
        n_activated_experts=_num(d, "num_experts_per_tok", 8 if glm else 2))
    if glm:
        values.update(n_routed_experts=_num(d, "n_routed_experts", None),
                      moe_inter_dim=_num(d, "moe_intermediate_size", None),
                      n_shared_experts=_num(d, "n_shared_experts", 1), n_dense_layers=_num(d, "first_k_dense_replace", 1),
                      score_func="sigmoid", route_scale=_num(d, "routed_scaling_factor", 1.0, float),
                      n_group=_num(d, "n_group", 1), topk_group=_num(d, "topk_group", 1), norm_topk_prob=True)
        values["n_dense_layers"] = min(values["n_dense_layers"], values["n_layers"])
        depth = _num(d, "num_nextn_predict_layers", 0) if mtp_weights else 0
        if depth < 0:
            raise CheckpointError(f"config.json key 'num_nextn_predict_layers' = {depth}: must be an integer >= 0")
        values["mtp_depth"] = depth
    else:  # Mixtral's intermediate_size is each expert's width; it has no dense blocks
        values.update(n_routed_experts=_num(d, "num_local_experts", 8), moe_inter_dim=values["ffn_hidden_dim"],
                      score_func="softmax", norm_topk_prob=True)
    try:
        return ModelConfig(**values)
    except TrainforgeError as e:  # named by ModelConfig's fields: rename them to config.json's keys
        msg = str(e)
        for ours, theirs in field_to_hf(d["model_type"]).items():
            msg = msg.replace(f"config key 'model.{ours}'", f"config.json key '{theirs}'")
            msg = msg.replace(f"config key '{ours}'", f"config.json key '{theirs}'")
            msg = msg.replace(f"model.{ours}", f"'{theirs}'")
        raise CheckpointError(msg) from None
