"""Conversion between trainforge's DeepSeek-V3 models (latent attention + sigmoid-routed MoE
+ MTP) and Hugging Face's ``DeepseekV3ForCausalLM``: ``config.json`` <-> ``ModelConfig`` and
state dicts both ways. ``loading/loader.py`` reads such directories, ``infer/hf_export.py``
writes them.

Experts: the released files (and transformers' ``save_pretrained``) store one tensor per
expert, ``mlp.experts.{e}.gate_proj/up_proj/down_proj.weight``; transformers holds them in
memory fused, ``gate_up_proj`` (E, 2·inter, dim) and ``down_proj`` (E, dim, inter). Both are
read; the per-expert layout is written. Ours are stacked: w1 (gate), w3 (up), w2 (down).
The router's ``gate.e_score_correction_bias`` is our ``router.expert_bias``.

MTP: the released checkpoints store MTP depth d as ``model.layers.{num_hidden_layers + d}``
(a normal block's ``self_attn`` / ``mlp`` / norms plus ``enorm``, ``hnorm``, ``eh_proj``,
``shared_head.norm``, and copies of the embedding ``embed_tokens`` and of the head
``shared_head.head``) <-> ``Transformer.mtp[d]`` (enorm, hnorm, proj, block, norm). They are
kept on load and written back. ``DeepseekV3ForCausalLM`` itself drops that layer on load
(reported as unexpected keys); transformers loads it only into its separate ``MtpModel`` for
``generate(use_mtp=True)``, and only for the 61-layer checkpoint (its key pattern names layer 61).

Expert-group masking: DeepSeek's reference ``Gate`` masks the experts of unchosen groups with
-inf before the top-k; so does transformers 5's ``DeepseekV3TopkRouter`` and so does our
``Router``. transformers 4.x and the checkpoints' remote code masked with 0.0, which differs
only when fewer than k experts of the kept groups have a biased score above 0 (possible: the
selection bias is negative for overloaded experts); no option is needed for parity with the
installed transformers (``tests/test_hf_deepseek.py::test_group_mask_is_minus_inf``).

Names: wq <-> q_proj, wq_a <-> q_a_proj, q_norm <-> q_a_layernorm, wq_b <-> q_b_proj,
wkv_a <-> kv_a_proj_with_mqa, kv_norm <-> kv_a_layernorm, wkv_b <-> kv_b_proj, wo <-> o_proj.

Rotary layout: HF with ``rope_interleave=True`` (the released checkpoints) rotates
interleaved pairs (x0, x1), (x2, x3), ...; ``MLA`` rotates halves (``llama.apply_rope``).
Rotating interleaved pairs of x is rotating halves of x's de-interleaved copy
[x0, x2, ..., x1, x3, ...], and q·k is unchanged when q and k are permuted alike, so the
conversion permutes the output rows of the rope dims of the query projection (per head)
and of ``wkv_a`` (its last qk_rope_head_dim rows) once; ``rope_interleave=False`` needs no
permutation.
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from trainforge.errors import CheckpointError, TrainforgeError
from trainforge.model.config import ModelConfig

# (ours, HF) per attention parameter; names relative to the attention module.
ATTENTION_NAMES = (("wq.weight", "q_proj.weight"), ("wq_a.weight", "q_a_proj.weight"),
                   ("q_norm.weight", "q_a_layernorm.weight"), ("wq_b.weight", "q_b_proj.weight"),
                   ("wkv_a.weight", "kv_a_proj_with_mqa.weight"), ("kv_norm.weight", "kv_a_layernorm.weight"),
                   ("wkv_b.weight", "kv_b_proj.weight"), ("wo.weight", "o_proj.weight"))


def deinterleave(rope_dim: int) -> torch.Tensor:
    """Index (rope_dim,): even dims then odd dims (interleaved pairs -> halves)."""
    return torch.cat((torch.arange(0, rope_dim, 2), torch.arange(1, rope_dim, 2)))


def _permute_rope_rows(w: torch.Tensor, cfg: ModelConfig, name: str, index: torch.Tensor) -> torch.Tensor:
    """Reorder the rope rows of a query projection (per head: the last rope rows of each
    nope+rope block) or of ``wkv_a`` (its last rope rows) by ``index``; other weights as they are."""
    nope, rope = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim
    if name in ("wq.weight", "wq_b.weight"):
        w = w.view(cfg.n_heads, nope + rope, -1)
        return torch.cat((w[:, :nope], w[:, nope:][:, index]), dim=1).reshape(cfg.n_heads * (nope + rope), -1)
    if name == "wkv_a.weight":
        return torch.cat((w[:cfg.kv_lora_rank], w[cfg.kv_lora_rank:][index]), dim=0)
    return w


def attention_from_hf(hf: dict[str, torch.Tensor], cfg: ModelConfig, rope_interleave: bool = True
                      ) -> dict[str, torch.Tensor]:
    """An ``MLA`` state dict from a ``DeepseekV3Attention`` one (names relative to the module)."""
    index = deinterleave(cfg.qk_rope_head_dim) if rope_interleave else None
    out = {}
    for ours, theirs in ATTENTION_NAMES:
        if theirs in hf:
            w = hf[theirs]
            out[ours] = _permute_rope_rows(w, cfg, ours, index) if index is not None else w
    return out


def attention_to_hf(sd: dict[str, torch.Tensor], cfg: ModelConfig, rope_interleave: bool = True
                    ) -> dict[str, torch.Tensor]:
    """The inverse of ``attention_from_hf``."""
    index = torch.argsort(deinterleave(cfg.qk_rope_head_dim)) if rope_interleave else None
    out = {}
    for ours, theirs in ATTENTION_NAMES:
        if ours in sd:
            w = sd[ours]
            out[theirs] = _permute_rope_rows(w, cfg, ours, index) if index is not None else w
    return out


# -- whole checkpoint ---------------------------------------------------------------------------

# A router's expert_bias and MTP keys are named below; these are the per-block renames.
_NORMS = (("attention_norm.weight", "input_layernorm.weight"), ("ffn_norm.weight", "post_attention_layernorm.weight"))
_DENSE = (("feed_forward.w1.weight", "mlp.gate_proj.weight"), ("feed_forward.w2.weight", "mlp.down_proj.weight"),
          ("feed_forward.w3.weight", "mlp.up_proj.weight"))
_MOE = (("feed_forward.router.gate.weight", "mlp.gate.weight"),
        ("feed_forward.router.expert_bias", "mlp.gate.e_score_correction_bias"),
        ("feed_forward.shared_experts.w1.weight", "mlp.shared_experts.gate_proj.weight"),
        ("feed_forward.shared_experts.w2.weight", "mlp.shared_experts.down_proj.weight"),
        ("feed_forward.shared_experts.w3.weight", "mlp.shared_experts.up_proj.weight"))
_EXPERTS = (("w1", "gate_proj"), ("w2", "down_proj"), ("w3", "up_proj"))  # our stacked (E, ...) <-> per expert
# The released MTP layer's own weights (beside its block); ``embed_tokens`` and
# ``shared_head.head`` are copies of the main model's embedding and output head.
_MTP = (("enorm.weight", "enorm.weight"), ("hnorm.weight", "hnorm.weight"), ("proj.weight", "eh_proj.weight"),
        ("norm.weight", "shared_head.norm.weight"))
_MTP_SHARED = (("tok_embeddings.weight", "embed_tokens.weight"), ("output.weight", "shared_head.head.weight"))
# Non-persistent in transformers, stored by some older checkpoints; recomputed from the config.
_IGNORED_SUFFIX = "rotary_emb.inv_freq"


def _block_table(cfg: ModelConfig, layer: int, ours: str, hf: str) -> list[tuple[str, str]]:
    """(our key, HF key) of one block's weights, routed experts excluded (``_expert_table``)."""
    low_rank_q = ("wq_a.weight", "q_norm.weight", "wq_b.weight")
    attn = [(f"attention.{o}", f"self_attn.{h}") for o, h in ATTENTION_NAMES
            if (o == "wq.weight") == (cfg.q_lora_rank == 0) or (o not in low_rank_q and o != "wq.weight")]
    ffn = _MOE if cfg.is_moe_layer(layer) else _DENSE
    return [(ours + o, hf + h) for o, h in (*_NORMS, *attn, *ffn)]


def _expert_table(cfg: ModelConfig) -> list[tuple[str, list[str]]]:
    """(our stacked key, [HF per-expert keys]) for every MoE block, MTP blocks included."""
    out = []
    for layer, ours, hf in _blocks(cfg):
        if cfg.is_moe_layer(layer):
            out += [(f"{ours}feed_forward.experts.{o}",
                     [f"{hf}mlp.experts.{e}.{h}.weight" for e in range(cfg.n_routed_experts)]) for o, h in _EXPERTS]
    return out


def _blocks(cfg: ModelConfig) -> list[tuple[int, str, str]]:
    """(layer index, our prefix, HF prefix) of every block: the main ones, then one per MTP depth
    (HF layer ``num_hidden_layers + depth``, as in the released checkpoints)."""
    n = cfg.n_layers
    return ([(i, f"layers.{i}.", f"model.layers.{i}.") for i in range(n)]
            + [(n + d, f"mtp.{d}.block.", f"model.layers.{n + d}.") for d in range(cfg.mtp_depth)])


def _key_table(cfg: ModelConfig) -> list[tuple[str, str]]:
    """(our key, HF key) for every weight but the routed experts and the MTP copies of the
    shared embedding and head; the output projection last."""
    table = [("tok_embeddings.weight", "model.embed_tokens.weight")]
    for layer, ours, hf in _blocks(cfg):
        table += _block_table(cfg, layer, ours, hf)
    n = cfg.n_layers
    for d in range(cfg.mtp_depth):
        table += [(f"mtp.{d}.{o}", f"model.layers.{n + d}.{h}") for o, h in _MTP]
    table += [("norm.weight", "model.norm.weight"), ("output.weight", "lm_head.weight")]
    return table


def _expected_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Our state dict's shapes, from the model built on the meta device (nothing allocated)."""
    from trainforge.model.llama import Transformer

    with torch.device("meta"):
        model = Transformer(cfg)
    return {k: tuple(v.shape) for k, v in model.state_dict().items()}


def _listing(keys: list[str], limit: int = 8) -> str:
    return str(keys[:limit])[:-1] + (f", ... ({len(keys) - limit} more)]" if len(keys) > limit else "]")


def _unfuse_experts(sd: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """transformers' in-memory layout (``DeepseekV3ForCausalLM.state_dict()``: per block
    ``mlp.experts.gate_up_proj`` (E, 2·inter, dim) and ``mlp.experts.down_proj`` (E, dim,
    inter)) as the per-expert keys of the files; other dicts as they are."""
    return unfuse_experts(sd)


def unfuse_experts(sd: dict[str, torch.Tensor], names: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj"),
                   prefix_of: Callable[[str], str] = lambda p: p) -> dict[str, torch.Tensor]:
    """Fused ``...mlp.experts.gate_up_proj`` / ``down_proj`` as per-expert ``{prefix_of(p)}{e}.{name}.weight``
    keys (``names``: gate, up, down); a dict without fused experts as it is. Shared with ``hf_moe``."""
    fused = [k for k in sd if k.endswith("mlp.experts.gate_up_proj")]
    if not fused:
        return sd
    sd = dict(sd)
    for k in fused:
        prefix = k[:-len("gate_up_proj")]
        gate_up, down = sd.pop(k), sd.pop(prefix + "down_proj", None)
        if down is None or gate_up.dim() != 3 or gate_up.shape[1] % 2:
            raise CheckpointError(f"Hugging Face state dict: {k} of shape {tuple(gate_up.shape)} needs "
                                  f"{prefix}down_proj beside it and an even dim 1 (gate and up stacked)")
        gate, up = gate_up.chunk(2, dim=1)
        out = prefix_of(prefix)
        for e in range(gate_up.shape[0]):
            sd[f"{out}{e}.{names[0]}.weight"], sd[f"{out}{e}.{names[1]}.weight"] = gate[e], up[e]
            sd[f"{out}{e}.{names[2]}.weight"] = down[e]
    return sd


def stack_experts_and_tie(out: dict[str, torch.Tensor], sd: dict[str, torch.Tensor],
                          experts: list[tuple[str, list[str]]], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """``out`` (our names) plus the stacked experts (a copy) and the tied output projection,
    refusing experts of differing shapes and an untied ``lm_head`` under tie_word_embeddings.
    Shared with ``hf_moe``."""
    for o, hs in experts:
        shapes = {tuple(sd[h].shape) for h in hs}
        if len(shapes) != 1:
            raise CheckpointError(f"Hugging Face state dict: the experts {hs[0]} .. {hs[-1]} differ in shape "
                                  f"({sorted(shapes)})")
        out[o] = torch.stack([sd[h] for h in hs])
    if cfg.tie_embeddings:
        if "lm_head.weight" in sd and not _same(sd["lm_head.weight"], sd["model.embed_tokens.weight"]):
            raise CheckpointError("Hugging Face state dict has lm_head.weight different from "
                                  "model.embed_tokens.weight, but config.json has tie_word_embeddings = true")
        out["output.weight"] = out["tok_embeddings.weight"]
    return out


def _rope_permute(cfg: ModelConfig, key: str, w: torch.Tensor, index: torch.Tensor | None) -> torch.Tensor:
    name = key.rsplit("attention.", 1)[-1] if ".attention." in f".{key}" else None
    if index is None or name is None:
        return w
    return _permute_rope_rows(w, cfg, name, index)


def from_hf_state_dict(sd: dict[str, torch.Tensor], cfg: ModelConfig, rope_interleave: bool = True
                       ) -> dict[str, torch.Tensor]:
    """A ``DeepseekV3ForCausalLM`` state dict (the files' per-expert layout, or transformers'
    in-memory fused one) -> our ``Transformer`` state dict, MTP layers
    (``model.layers.{n_layers + d}``) included. Experts are stacked (a copy); the rotary rows
    of the query and ``wkv_a`` projections are permuted when ``rope_interleave``; other tensors
    are passed through. Raises ``CheckpointError`` naming missing, unexpected or mis-shaped keys."""
    sd = _unfuse_experts({k: v for k, v in sd.items() if not k.endswith(_IGNORED_SUFFIX)}, cfg)
    table, experts = _key_table(cfg), _expert_table(cfg)
    n = cfg.n_layers
    copies = {f"model.layers.{n + d}.{h}": o for d in range(cfg.mtp_depth) for o, h in _MTP_SHARED}
    check_hf_keys(sd, {h for _, h in table} | {h for _, hs in experts for h in hs}, copies.keys(), cfg,
                  f"q_lora_rank={cfg.q_lora_rank or None}")
    index = deinterleave(cfg.qk_rope_head_dim) if rope_interleave else None
    names = {o: h for o, h in table} | {o: f"{hs[0]} .. {hs[-1]} (stacked)" for o, hs in experts}
    # Before the rotary rows are permuted: a query projection that does not fit the heads would not reshape.
    _check_shapes({o: sd[h] for o, h in table if h in sd}, cfg, names)
    out = stack_experts_and_tie({o: _rope_permute(cfg, o, sd[h], index) for o, h in table if h in sd}, sd, experts,
                                cfg)
    _check_shapes(out, cfg, names)
    # trainforge's MTP modules use the main embedding and head: a stored copy must be exactly that.
    for h, o in copies.items():
        if h in sd and not _same(sd[h], out[o]):
            main = "model.embed_tokens.weight" if o == "tok_embeddings.weight" else "lm_head.weight"
            raise CheckpointError(f"Hugging Face state dict: {h} differs from {main}; trainforge's multi-token "
                                  "prediction modules share the main model's embedding and output head")
    return out


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a is b or (a.shape == b.shape and torch.equal(a, b.to(a.dtype)))


def _check_shapes(out: dict[str, torch.Tensor], cfg: ModelConfig, names: dict[str, str]) -> None:
    want = _expected_shapes(cfg)
    bad = [f"{names.get(k, k)}: {tuple(v.shape)} != expected {want[k]}" for k, v in out.items()
           if k in want and tuple(v.shape) != want[k]]
    if bad:
        raise CheckpointError("Hugging Face state dict has tensors of the wrong shape for config.json: "
                              + "; ".join(bad[:8]) + (f" ... ({len(bad) - 8} more)" if len(bad) > 8 else ""))


def to_hf_state_dict(sd: dict[str, torch.Tensor], cfg: ModelConfig, rope_interleave: bool = True
                     ) -> dict[str, torch.Tensor]:
    """Our ``Transformer`` state dict -> the ``DeepseekV3ForCausalLM`` files' layout: per-expert
    weights (views into our stacked tensors), rotary rows permuted back to the interleaved layout,
    and per MTP depth the released layer ``model.layers.{n_layers + d}`` with ``embed_tokens`` and
    ``shared_head.head`` as the main model's tensors (the same objects). Tensors that share memory
    must be cloned for ``safetensors.torch.save_file``; trainforge writes each name's bytes itself
    (``storage/safetensors_stream.py``). Raises
    ``CheckpointError`` naming missing or unexpected keys."""
    table, experts = _key_table(cfg), _expert_table(cfg)
    check_our_keys(sd, {o for o, _ in table} | {o for o, _ in experts}, cfg)
    index = torch.argsort(deinterleave(cfg.qk_rope_head_dim)) if rope_interleave else None
    out = {h: _rope_permute(cfg, o, sd[o], index) for o, h in table if o in sd}
    return add_experts_and_copies(out, sd, experts, cfg)


def check_hf_keys(sd: dict[str, torch.Tensor], expected: set[str], extra: Any, cfg: ModelConfig,
                  describe: str = "") -> None:
    """``CheckpointError`` naming the keys of the HF state dict ``sd`` missing from ``expected``
    or beyond it and ``extra`` (keys allowed but not required); a tied ``lm_head`` may be
    absent. ``describe``: more config.json values for the message. Shared with ``hf_moe``."""
    missing = sorted(expected - sd.keys())
    if cfg.tie_embeddings and "lm_head.weight" in missing:
        missing.remove("lm_head.weight")
    unexpected = sorted(sd.keys() - expected - set(extra))
    if missing or unexpected:
        raise CheckpointError(
            f"Hugging Face state dict does not match config.json (num_hidden_layers={cfg.n_layers}, "
            f"first_k_dense_replace={cfg.n_dense_layers}, num_nextn_predict_layers={cfg.mtp_depth}"
            f"{', ' + describe if describe else ''}): missing keys {_listing(missing)}, unexpected keys "
            f"{_listing(unexpected)}")


def check_our_keys(sd: dict[str, torch.Tensor], expected: set[str], cfg: ModelConfig) -> None:
    """``CheckpointError`` naming the keys of our state dict ``sd`` missing from or beyond
    ``expected`` (a tied output projection may be absent). Shared with ``hf_moe``."""
    missing = sorted(expected - sd.keys())
    if cfg.tie_embeddings and "output.weight" in missing:
        missing.remove("output.weight")
    unexpected = sorted(sd.keys() - expected)
    if missing or unexpected:
        raise CheckpointError(f"trainforge state dict does not match the model config: missing keys "
                              f"{_listing(missing)}, unexpected keys {_listing(unexpected)}")


def add_experts_and_copies(out: dict[str, torch.Tensor], sd: dict[str, torch.Tensor],
                           experts: list[tuple[str, list[str]]], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """``out`` (HF names) plus each expert's weights (views into our stacked tensors), the tied
    head, and per MTP depth the main embedding and head as that layer's copies (the same
    objects). Shared with ``hf_moe``: both layouts write experts and MTP layers alike."""
    for o, hs in experts:
        out.update({h: sd[o][e] for e, h in enumerate(hs)})
    if cfg.tie_embeddings:
        out["lm_head.weight"] = out["model.embed_tokens.weight"]
    n = cfg.n_layers
    main = {"tok_embeddings.weight": "model.embed_tokens.weight", "output.weight": "lm_head.weight"}
    for d in range(cfg.mtp_depth):
        out.update({f"model.layers.{n + d}.{h}": out[main[o]] for o, h in _MTP_SHARED})
    return out


def key_map(cfg: ModelConfig) -> dict[str, str]:
    """Our weight key -> its HF key, routed experts and the MTP copies left out (the quantised
    export renames stored tensors with it)."""
    return dict(_key_table(cfg))


def expert_key_map(cfg: ModelConfig) -> dict[str, list[str]]:
    """Our stacked expert key (``...experts.w1``) -> its per-expert HF weight keys, expert order."""
    return dict(_expert_table(cfg))


def rows_to_hf(cfg: ModelConfig, key: str, t: torch.Tensor, rope_interleave: bool = True) -> torch.Tensor:
    """A tensor indexed by the rows of our weight ``key`` (its quantised codes, scales, zero
    points) in HF's row order: the query and ``wkv_a`` rope rows back to interleaved. Rows are
    quantised independently, so permuting codes equals quantising the permuted weight."""
    index = torch.argsort(deinterleave(cfg.qk_rope_head_dim)) if rope_interleave else None
    return _rope_permute(cfg, key, t, index)


def rows_from_hf(cfg: ModelConfig, key: str, t: torch.Tensor, hf_config: dict[str, Any] | None = None
                 ) -> torch.Tensor:
    """The inverse of ``rows_to_hf`` (``hf_config``'s ``rope_interleave``, default true)."""
    interleave = bool((hf_config or {}).get("rope_interleave", True))
    return _rope_permute(cfg, key, t, deinterleave(cfg.qk_rope_head_dim) if interleave else None)


# -- config.json ----------------------------------------------------------------------------------

MODEL_TYPE = "deepseek_v3"

# ModelConfig field <- config.json key, for the fields a ConfigError from ModelConfig may name.
FIELD_TO_HF = {"dim": "hidden_size", "n_layers": "num_hidden_layers", "n_heads": "num_attention_heads",
                "n_kv_heads": "num_attention_heads", "vocab_size": "vocab_size", "ffn_hidden_dim": "intermediate_size",
                "max_seq_len": "max_position_embeddings", "n_routed_experts": "n_routed_experts",
                "n_shared_experts": "n_shared_experts", "n_activated_experts": "num_experts_per_tok",
                "moe_inter_dim": "moe_intermediate_size", "n_dense_layers": "first_k_dense_replace",
                "route_scale": "routed_scaling_factor", "n_group": "n_group", "topk_group": "topk_group",
                "q_lora_rank": "q_lora_rank", "kv_lora_rank": "kv_lora_rank", "qk_nope_head_dim": "qk_nope_head_dim",
                "qk_rope_head_dim": "qk_rope_head_dim", "v_head_dim": "v_head_dim",
                "rope_factor": "rope_scaling.factor",
                "rope_original_max_seq_len": "rope_scaling.original_max_position_embeddings",
                "rope_beta_fast": "rope_scaling.beta_fast", "rope_beta_slow": "rope_scaling.beta_slow",
                "rope_mscale": "rope_scaling.mscale", "rope_mscale_all_dim": "rope_scaling.mscale_all_dim",
                "mtp_depth": "num_nextn_predict_layers"}
_YARN_KEYS = (("rope_factor", "factor", 1.0), ("rope_original_max_seq_len", "original_max_position_embeddings", None),
              ("rope_beta_fast", "beta_fast", 32.0), ("rope_beta_slow", "beta_slow", 1.0),
              ("rope_mscale", "mscale", 1.0), ("rope_mscale_all_dim", "mscale_all_dim", 0.0))


def compressed_tensors(d: dict[str, Any]) -> bool:
    """Whether config.json's weights are in the compressed-tensors format (``loading/loader.py``
    reads its int8/int4 schemes and refuses the others by name)."""
    qc = d.get("quantization_config")
    return isinstance(qc, dict) and qc.get("quant_method") == "compressed-tensors"


def is_deepseek_v3(d: Any) -> bool:
    """Whether a config.json dict describes a ``DeepseekV3ForCausalLM``."""
    return isinstance(d, dict) and d.get("model_type") == MODEL_TYPE


def _num(d: dict[str, Any], key: str, default: Any, kind: type = int) -> Any:
    """``d[key]`` (``default`` when absent or null) as ``kind``; a float like 3.0 counts as an int."""
    v = d.get(key)
    if v is None:
        v = default
    if v is None:
        raise CheckpointError(f"config.json is missing required key {key!r}")
    if kind is int and isinstance(v, float) and v.is_integer():
        v = int(v)
    if isinstance(v, bool) or not isinstance(v, (int, float)) or (kind is int and not isinstance(v, int)):
        raise CheckpointError(f"config.json key {key!r} = {v!r}: must be {'an integer' if kind is int else 'a number'}")
    return kind(v)


def _rope(d: dict[str, Any]) -> dict[str, Any]:
    """rope_theta and the YaRN fields from ``rope_parameters`` (transformers 5) or
    ``rope_scaling`` (the released checkpoints, transformers 4)."""
    out: dict[str, Any] = {"rope_theta": _num(d, "rope_theta", 10000.0, float)}
    for key in ("rope_scaling", "rope_parameters"):
        params = d.get(key)
        if params is None:
            continue
        if not isinstance(params, dict):
            raise CheckpointError(f"config.json key {key!r} must be a JSON object, got {params!r:.80}")
        rope_type = params.get("rope_type", params.get("type", "default"))
        if "rope_theta" in params:
            out["rope_theta"] = _num(params, "rope_theta", None, float)
        if rope_type == "default":
            continue
        if rope_type != "yarn":
            raise CheckpointError(f"config.json key {key!r} has rope_type {rope_type!r}; trainforge implements "
                                  "YaRN ('yarn', DeepSeek-V3's) and unscaled rotary embeddings ('default')")
        for ours, theirs, default in _YARN_KEYS:
            if default is None:
                default = d.get("max_position_embeddings")
            try:
                out[ours] = _num(params, theirs, default, int if ours == "rope_original_max_seq_len" else float)
            except CheckpointError as e:
                raise CheckpointError(str(e).replace(f"key {theirs!r}", f"key '{key}.{theirs}'")) from None
    return out


def model_config_from_hf(d: dict[str, Any], mtp_weights: bool = True) -> ModelConfig:
    """``ModelConfig`` from a ``DeepseekV3ForCausalLM`` ``config.json`` dict (the released
    checkpoints' keys, or ``DeepseekV3Config.to_dict()``). ``num_nextn_predict_layers`` becomes
    ``mtp_depth`` when ``mtp_weights`` (the files hold the MTP layers; directories written by
    transformers' ``save_pretrained`` do not, though their config keeps the key). Defaults for
    absent keys are ``DeepseekV3Config``'s. Raises ``CheckpointError`` naming the config.json key
    of any value trainforge does not implement or that does not form a model."""
    if not is_deepseek_v3(d):
        raise CheckpointError(f"config.json key 'model_type' is {d.get('model_type') if isinstance(d, dict) else d!r}"
                              f"; expected {MODEL_TYPE!r}")
    refusals = (("hidden_act", "silu", "only 'silu' (SwiGLU) is implemented"),
                ("attention_bias", False, "trainforge's projections have no biases"),
                ("scoring_func", "sigmoid", "DeepSeek-V3's router scores with 'sigmoid'; use a softmax router "
                                            "through trainforge's own config (model.score_func)"),
                ("topk_method", "noaux_tc", "only 'noaux_tc' (group-limited top-k with a selection bias, "
                                            "DeepSeek-V3's) is implemented"),
                ("moe_layer_freq", 1, "only every block from first_k_dense_replace on being MoE (1) is implemented"),
                ("norm_topk_prob", True, "trainforge's sigmoid router always renormalises the chosen weights"))
    if not compressed_tensors(d):
        refusals += (("quantization_config", None, "quantised (e.g. FP8) weights are not loaded; dequantise them "
                                                   "to bf16 first (DeepSeek's inference/fp8_cast_bf16.py)"),)
    for key, want, why in refusals:
        if key in d and d[key] != want and not (want is None and d[key] is None):
            raise CheckpointError(f"config.json key {key!r} = {d[key]!r:.80}: {why}")
    for key in ("hidden_size", "num_hidden_layers", "num_attention_heads", "vocab_size", "intermediate_size",
                "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "moe_intermediate_size",
                "n_routed_experts", "num_experts_per_tok"):
        if d.get(key) is None:
            raise CheckpointError(f"config.json is missing required key {key!r}")
    n_heads = _num(d, "num_attention_heads", None)
    values = dict(
        dim=_num(d, "hidden_size", None), n_layers=_num(d, "num_hidden_layers", None), n_heads=n_heads,
        # MLA's keys and values have one head per query head; num_key_value_heads plays no part.
        n_kv_heads=n_heads, vocab_size=_num(d, "vocab_size", None), ffn_hidden_dim=_num(d, "intermediate_size", None),
        norm_eps=_num(d, "rms_norm_eps", 1e-6, float), max_seq_len=_num(d, "max_position_embeddings", 4096),
        tie_embeddings=bool(d.get("tie_word_embeddings", False)),
        n_routed_experts=_num(d, "n_routed_experts", None), n_shared_experts=_num(d, "n_shared_experts", 1),
        n_activated_experts=_num(d, "num_experts_per_tok", None), moe_inter_dim=_num(d, "moe_intermediate_size", None),
        n_dense_layers=_num(d, "first_k_dense_replace", 3), score_func="sigmoid",
        route_scale=_num(d, "routed_scaling_factor", 2.5, float), norm_topk_prob=True,
        n_group=_num(d, "n_group", 1), topk_group=_num(d, "topk_group", 1),
        q_lora_rank=_num(d, "q_lora_rank", 0), kv_lora_rank=_num(d, "kv_lora_rank", None),
        qk_nope_head_dim=_num(d, "qk_nope_head_dim", None), qk_rope_head_dim=_num(d, "qk_rope_head_dim", None),
        v_head_dim=_num(d, "v_head_dim", None), **_rope(d))
    if values["n_shared_experts"] < 1:
        raise CheckpointError(f"config.json key 'n_shared_experts' = {values['n_shared_experts']}: "
                              "DeepseekV3's MoE block always has shared experts (>= 1)")
    if values["kv_lora_rank"] < 1:
        raise CheckpointError(f"config.json key 'kv_lora_rank' = {values['kv_lora_rank']}: must be a positive integer")
    # A dense checkpoint (first_k_dense_replace >= num_hidden_layers) still routes its MTP block.
    values["n_dense_layers"] = min(values["n_dense_layers"], values["n_layers"])
    depth = _num(d, "num_nextn_predict_layers", 0) if mtp_weights else 0
    if depth < 0:
        raise CheckpointError(f"config.json key 'num_nextn_predict_layers' = {depth}: must be an integer >= 0")
    values["mtp_depth"] = depth
    try:
        return ModelConfig(**values)
    except TrainforgeError as e:  # named by ModelConfig's fields: rename them to config.json's keys
        msg = str(e)
        for ours, theirs in FIELD_TO_HF.items():
            msg = msg.replace(f"config key 'model.{ours}'", f"config.json key '{theirs}'")
            msg = msg.replace(f"config key '{ours}'", f"config.json key '{theirs}'")
            msg = msg.replace(f"model.{ours}", f"'{theirs}'")
        raise CheckpointError(msg) from None


def to_hf_config_dict(cfg: ModelConfig, dtype: str = "float32") -> dict[str, Any]:
    """A ``config.json`` dict for ``DeepseekV3ForCausalLM`` (``transformers.DeepseekV3Config(**d)``
    accepts it), with ``rope_interleave`` true (``to_hf_state_dict``'s default layout). Rotary
    settings are written both as transformers 5's ``rope_parameters`` and as the released
    checkpoints' ``rope_theta`` + ``rope_scaling``. Token ids are left to the caller."""
    if not (cfg.is_mla and cfg.is_moe and cfg.score_func == "sigmoid" and cfg.n_shared_experts >= 1):
        raise CheckpointError("the DeepseekV3ForCausalLM layout needs latent attention (kv_lora_rank > 0) and a "
                              "sigmoid-routed MoE with shared experts (n_routed_experts > 0, score_func = sigmoid, "
                              "n_shared_experts >= 1), as the dsv3-* flavors have")
    rope: dict[str, Any] = {"rope_type": "default", "rope_theta": cfg.rope_theta}
    scaling = None
    if cfg.rope_factor > 1:
        scaling = {"factor": cfg.rope_factor, "original_max_position_embeddings": cfg.rope_original_max_seq_len,
                   "beta_fast": cfg.rope_beta_fast, "beta_slow": cfg.rope_beta_slow, "mscale": cfg.rope_mscale,
                   "mscale_all_dim": cfg.rope_mscale_all_dim}
        rope = {"rope_type": "yarn", "rope_theta": cfg.rope_theta, **scaling}
        scaling = {"type": "yarn", **scaling}
    return {
        "architectures": ["DeepseekV3ForCausalLM"], "model_type": MODEL_TYPE,
        "hidden_size": cfg.dim, "num_hidden_layers": cfg.n_layers, "num_attention_heads": cfg.n_heads,
        "num_key_value_heads": cfg.n_heads, "vocab_size": cfg.vocab_size, "intermediate_size": cfg.ffn_hidden_dim,
        "rms_norm_eps": cfg.norm_eps, "max_position_embeddings": cfg.max_seq_len,
        "tie_word_embeddings": cfg.tie_embeddings, "hidden_act": "silu", "attention_bias": False,
        "q_lora_rank": cfg.q_lora_rank or None, "kv_lora_rank": cfg.kv_lora_rank,
        "qk_nope_head_dim": cfg.qk_nope_head_dim, "qk_rope_head_dim": cfg.qk_rope_head_dim,
        "v_head_dim": cfg.v_head_dim, "rope_interleave": True,
        "n_routed_experts": cfg.n_routed_experts, "n_shared_experts": cfg.n_shared_experts,
        "num_experts_per_tok": cfg.n_activated_experts, "moe_intermediate_size": cfg.moe_inter_dim,
        "first_k_dense_replace": cfg.n_dense_layers, "moe_layer_freq": 1, "n_group": cfg.n_group,
        "topk_group": cfg.topk_group, "routed_scaling_factor": cfg.route_scale, "norm_topk_prob": True,
        "scoring_func": "sigmoid", "topk_method": "noaux_tc", "num_nextn_predict_layers": cfg.mtp_depth,
        "rope_parameters": rope, "rope_theta": cfg.rope_theta, "rope_scaling": scaling,
        "dtype": dtype, "torch_dtype": dtype,
    }
