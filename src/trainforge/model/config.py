"""Model shapes. ``ModelConfig`` is everything the single-device model needs;
``FLAVORS`` are named shapes, from a < 1M-parameter test model to Llama 3.1 405B.

The real-size flavors follow the published Llama 3.x shapes so the planner and
memory estimates can build them on the meta device (no memory is allocated).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from trainforge.model.preflight import (MLA_KEYS, MODEL_KEYS, MOE_KEYS, check_mla, check_moe, check_mtp_depth,
                                      check_shape)

# Direct construction (checkpoint metadata, tests): the field names themselves.
_FIELD_KEYS = {**MODEL_KEYS, "vocab_size": "model.vocab_size", "max_seq_len": "model.max_seq_len"}


@dataclass(frozen=True)
class ModelConfig:
    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    vocab_size: int
    ffn_hidden_dim: int
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    max_seq_len: int = 2048
    tie_embeddings: bool = False
    # Mixture of experts (model/moe.py); n_routed_experts = 0 is a dense model.
    n_routed_experts: int = 0
    n_shared_experts: int = 0
    n_activated_experts: int = 0  # top-k
    moe_inter_dim: int = 0  # each expert's SwiGLU width
    n_dense_layers: int = 0  # the first blocks keep the dense FeedForward
    score_func: str = "softmax"  # "sigmoid" (DeepSeek-V3) or "softmax" (Mixtral)
    route_scale: float = 1.0
    norm_topk_prob: bool = True  # softmax: renormalise the chosen weights (sigmoid always does)
    n_group: int = 1  # group-limited routing: experts in n_group groups,
    topk_group: int = 1  # tokens choose among the topk_group best groups
    bias_update_rate: float = 0.0  # loss-free balancing gamma (train/moe_balance.py); 0 = off
    aux_loss_alpha: float = 0.0  # batch-wise auxiliary balance loss
    seq_aux_loss_alpha: float = 0.0  # sequence-wise balance loss (DeepSeek-V3 eq. 17-20)
    # Multi-head latent attention (model/mla.py); kv_lora_rank = 0 is standard attention
    q_lora_rank: int = 0  # 0 = full-rank query projection
    kv_lora_rank: int = 0  # width of the compressed key/value latent
    qk_nope_head_dim: int = 0  # per-head query/key width without rotary embedding
    qk_rope_head_dim: int = 0  # the decoupled rotary query/key width (one rotary key shared by all heads)
    v_head_dim: int = 0
    # YaRN rotary scaling (model/yarn.py), latent attention only
    rope_factor: float = 1.0  # 1 = no scaling
    rope_original_max_seq_len: int = 4096
    rope_beta_fast: float = 32.0
    rope_beta_slow: float = 1.0
    rope_mscale: float = 1.0
    rope_mscale_all_dim: float = 0.0
    # Multi-token prediction (model/mtp.py)
    mtp_depth: int = 0  # MTP modules after the main model (DeepSeek-V3: 1); 0 = none

    def __post_init__(self) -> None:
        # Positive sizes first: 0 heads would otherwise be a ZeroDivisionError.
        check_shape({f: getattr(self, f) for f in _FIELD_KEYS}, _FIELD_KEYS)
        if self.n_routed_experts:
            check_moe({f: getattr(self, f) for f in MOE_KEYS}, self.n_layers)
        check_mla({f: getattr(self, f) for f in MLA_KEYS})
        check_mtp_depth(self.mtp_depth)

    @property
    def is_moe(self) -> bool:
        return self.n_routed_experts > 0

    def is_moe_layer(self, layer: int) -> bool:
        return self.is_moe and layer >= self.n_dense_layers

    @property
    def n_moe_layers(self) -> int:
        return max(0, self.n_layers - self.n_dense_layers) if self.is_moe else 0

    @property
    def is_mla(self) -> bool:
        return self.kv_lora_rank > 0

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    @property
    def rope_head_dim(self) -> int:
        """Width of the rotary tables: the decoupled rotary dims under MLA, else the head dim."""
        return self.qk_rope_head_dim if self.is_mla else self.head_dim

    def attention_params(self) -> int:
        """Parameters of one block's attention (latent norms included)."""
        d, H = self.dim, self.n_heads
        if not self.is_mla:
            return d * H * self.head_dim * 2 + d * self.n_kv_heads * self.head_dim * 2
        qk = self.qk_nope_head_dim + self.qk_rope_head_dim
        r = self.q_lora_rank
        q = d * r + r + r * H * qk if r else d * H * qk
        kv = d * (self.kv_lora_rank + self.qk_rope_head_dim) + self.kv_lora_rank
        kv += self.kv_lora_rank * H * (self.qk_nope_head_dim + self.v_head_dim)
        return q + kv + H * self.v_head_dim * d

    def num_params(self, include_embedding: bool = True, active: bool = False, mtp: bool = True) -> int:
        """Parameter count computed from the shape (no model needed). ``active``: only
        what one token uses (a MoE layer's router, shared and ``n_activated_experts``
        routed experts; equal to the total for a dense model). ``mtp``: include the MTP
        modules (their embedding and output projection are the main model's: counted once)."""
        d = self.dim
        emb = self.vocab_size * d
        out = 0 if self.tie_embeddings else self.vocab_size * d
        total = sum(self._block_params(i, active) for i in range(self.n_layers)) + d + out
        if mtp:
            total += self.mtp_params(active)
        return total + (emb if include_embedding else 0)

    def _block_params(self, layer: int, active: bool) -> int:
        """One ``TransformerBlock`` with index ``layer`` (MoE from ``n_dense_layers`` on)."""
        d, attn = self.dim, self.attention_params()
        if not self.is_moe_layer(layer):
            return attn + 3 * d * self.ffn_hidden_dim + 2 * d
        routed = self.n_activated_experts if active else self.n_routed_experts
        return attn + 2 * d + d * self.n_routed_experts + 3 * d * self.moe_inter_dim * (self.n_shared_experts + routed)

    def mtp_params(self, active: bool = False) -> int:
        """The MTP modules' own parameters: per depth enorm, hnorm, proj (2·dim -> dim), a
        block (index n_layers + k) and the final norm."""
        d = self.dim
        return sum(3 * d + 2 * d * d + self._block_params(self.n_layers + k, active) for k in range(self.mtp_depth))

    def flops_per_token(self, seq_len: int) -> float:
        """Training FLOPs per token (forward + backward): 6·N for the matmuls (N: the
        active parameters) plus the attention score/value products, 6·L·H·(d_qk + d_v)·T
        (PaLM appendix B's 12·L·d·T when d_qk = d_v = dim / H; MLA's q·k uses
        qk_nope + qk_rope dims, its values v_head_dim). The input embedding is a lookup,
        not a matmul, so it is excluded. Each MTP depth adds its block and projection, one
        more pass through the shared output projection and its attention (its k fewer
        positions are ignored)."""
        n = self.num_params(include_embedding=False, active=True)
        n += self.mtp_depth * self.vocab_size * self.dim  # the shared head, once per depth
        if self.is_mla:
            widths = self.n_heads * (self.qk_nope_head_dim + self.qk_rope_head_dim + self.v_head_dim)
        else:
            widths = 2 * self.dim
        return 6.0 * n + 6.0 * (self.n_layers + self.mtp_depth) * widths * seq_len

    def describe_params(self) -> str:
        """"12.3M parameters" or, for MoE, "45.6M parameters (12.3M active)"; with MTP
        modules "(1.2M of them in MTP)" (included in the total). B from a billion on."""
        def n(x: int) -> str:
            return f"{x / 1e9:.2f}B" if x >= 1e9 else f"{x / 1e6:.2f}M"
        text = f"{n(self.num_params())} parameters"
        if self.is_moe:
            text += f" ({n(self.num_params(active=True))} active per token)"
        if self.mtp_depth:
            text += f" ({n(self.mtp_params())} of them in MTP)"
        return text


FLAVORS: dict[str, ModelConfig] = {
    # < 1M parameters: unit tests and parity checks.
    "debug": ModelConfig(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=512, ffn_hidden_dim=176),
    # ~10M: the quickstart model, trains in minutes on a laptop CPU.
    "tiny": ModelConfig(dim=256, n_layers=8, n_heads=8, n_kv_heads=4, vocab_size=8192, ffn_hidden_dim=704),
    # ~120M, GPT-2-small class.
    "small": ModelConfig(dim=768, n_layers=12, n_heads=12, n_kv_heads=4, vocab_size=32000, ffn_hidden_dim=2048),
    # Published Llama 3.x shapes (rope scaling of the originals is not modelled).
    "llama-1b": ModelConfig(dim=2048, n_layers=16, n_heads=32, n_kv_heads=8, vocab_size=128256,
                            ffn_hidden_dim=8192, rope_theta=500000.0, max_seq_len=8192, tie_embeddings=True),
    "llama-8b": ModelConfig(dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, vocab_size=128256,
                            ffn_hidden_dim=14336, rope_theta=500000.0, max_seq_len=8192),
    "llama-70b": ModelConfig(dim=8192, n_layers=80, n_heads=64, n_kv_heads=8, vocab_size=128256,
                             ffn_hidden_dim=28672, rope_theta=500000.0, max_seq_len=8192),
    "llama-405b": ModelConfig(dim=16384, n_layers=126, n_heads=128, n_kv_heads=8, vocab_size=128256,
                              ffn_hidden_dim=53248, rope_theta=500000.0, max_seq_len=8192),
    # Mixture of experts (DeepSeek-V3 style: sigmoid router, loss-free balancing, shared
    # expert, first block dense). < 1M parameters, for tests.
    "moe-debug": ModelConfig(dim=64, n_layers=3, n_heads=4, n_kv_heads=2, vocab_size=512, ffn_hidden_dim=176,
                             n_routed_experts=8, n_shared_experts=1, n_activated_experts=2, moe_inter_dim=32,
                             n_dense_layers=1, score_func="sigmoid", bias_update_rate=1e-3),
    # tiny's shape with its 7 upper feed-forwards split into 16 experts of a quarter of the
    # width (4 active + 1 shared): ~21M parameters, ~11M active; trains on the built-in corpus.
    "moe-tiny": ModelConfig(dim=256, n_layers=8, n_heads=8, n_kv_heads=4, vocab_size=8192, ffn_hidden_dim=704,
                            n_routed_experts=16, n_shared_experts=1, n_activated_experts=4, moe_inter_dim=176,
                            n_dense_layers=1, score_func="sigmoid", route_scale=1.0, n_group=4, topk_group=2,
                            bias_update_rate=1e-3),
    # small's shape, 32 experts of 256 (6 active + 2 shared) in 11 of 12 blocks.
    "moe-small": ModelConfig(dim=768, n_layers=12, n_heads=12, n_kv_heads=4, vocab_size=32000,
                             ffn_hidden_dim=2048, n_routed_experts=32, n_shared_experts=2, n_activated_experts=6,
                             moe_inter_dim=256, n_dense_layers=1, score_func="sigmoid", route_scale=2.5, n_group=4,
                             topk_group=2, bias_update_rate=1e-3),
    # DeepSeek-V3 (model/mla.py + model/moe.py): latent attention with a low-rank query,
    # sigmoid routing over expert groups, first block dense. < 1M parameters, for tests.
    "dsv3-debug": ModelConfig(dim=64, n_layers=3, n_heads=4, n_kv_heads=4, vocab_size=512, ffn_hidden_dim=176,
                              n_routed_experts=8, n_shared_experts=1, n_activated_experts=2, moe_inter_dim=32,
                              n_dense_layers=1, score_func="sigmoid", route_scale=2.5, n_group=4, topk_group=2,
                              bias_update_rate=1e-3, q_lora_rank=32, kv_lora_rank=32, qk_nope_head_dim=16,
                              qk_rope_head_dim=8, v_head_dim=16),
    # moe-tiny's size with latent attention; trains on the built-in corpus.
    "dsv3-tiny": ModelConfig(dim=256, n_layers=8, n_heads=8, n_kv_heads=8, vocab_size=8192, ffn_hidden_dim=704,
                             n_routed_experts=16, n_shared_experts=1, n_activated_experts=4, moe_inter_dim=176,
                             n_dense_layers=1, score_func="sigmoid", route_scale=2.5, n_group=4, topk_group=2,
                             bias_update_rate=1e-3, q_lora_rank=96, kv_lora_rank=64, qk_nope_head_dim=32,
                             qk_rope_head_dim=16, v_head_dim=32),
    # The published DeepSeek-V3 config (671B total, 37B active; the MTP module is counted
    # separately). The first three blocks are dense; YaRN as the released long-context model.
    "deepseek-v3-671b": ModelConfig(dim=7168, n_layers=61, n_heads=128, n_kv_heads=128, vocab_size=129280,
                                    ffn_hidden_dim=18432, norm_eps=1e-6, rope_theta=10000.0, max_seq_len=163840,
                                    n_routed_experts=256, n_shared_experts=1, n_activated_experts=8,
                                    moe_inter_dim=2048, n_dense_layers=3, score_func="sigmoid", route_scale=2.5,
                                    n_group=8, topk_group=4, bias_update_rate=1e-3, seq_aux_loss_alpha=1e-4,
                                    q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64,
                                    v_head_dim=128, rope_factor=40.0, rope_original_max_seq_len=4096,
                                    rope_beta_fast=32.0, rope_beta_slow=1.0, rope_mscale=1.0,
                                    rope_mscale_all_dim=1.0, mtp_depth=1),
}

# [model] keys that override a flavor (ModelSection's fields of the same names).
OVERRIDES = ("dim", "n_layers", "n_heads", "n_kv_heads", "ffn_hidden_dim", "tie_embeddings", *MOE_KEYS, *MLA_KEYS,
             "mtp_depth")


def model_config_from_section(section, vocab_size: int | None, seq_len: int | None = None) -> ModelConfig:
    """Resolve ``[model]`` (a ``ModelSection``) into a ModelConfig.

    ``vocab_size`` comes from the prepared data's tokenizer, so a flavor trains on
    any corpus; ``seq_len`` raises ``max_seq_len`` when training needs longer rope tables."""
    base = FLAVORS[section.flavor]
    changes = {k: getattr(section, k) for k in OVERRIDES if getattr(section, k) is not None}
    if vocab_size is not None:
        changes["vocab_size"] = vocab_size
    if seq_len is not None and seq_len > base.max_seq_len:
        changes["max_seq_len"] = seq_len
    # Named as the user set them (model.*, training.seq_len), before ModelConfig checks its fields.
    check_shape({f: changes.get(f, getattr(base, f)) for f in MODEL_KEYS}, MODEL_KEYS)
    if changes.get("n_routed_experts", base.n_routed_experts):
        check_moe({f: changes.get(f, getattr(base, f)) for f in MOE_KEYS}, changes.get("n_layers", base.n_layers))
    check_mla({f: changes.get(f, getattr(base, f)) for f in MLA_KEYS})
    check_mtp_depth(changes.get("mtp_depth", base.mtp_depth))
    return dataclasses.replace(base, **changes)


# [model] keys that tune training, not the weights: with model.init_from they override the directory's values.
TRAINING_ONLY_KEYS = ("bias_update_rate", "aux_loss_alpha", "seq_aux_loss_alpha")


def model_config_from_init(section, source: ModelConfig, where: str, source_keys: dict[str, str],
                           vocab_size: int, seq_len: int | None = None) -> ModelConfig:
    """Resolve ``[model]`` when ``model.init_from`` names weights whose shape is ``source``.

    The shape is the directory's. Every explicit shape key of ``section`` and, unless it
    is left at the default, every shape field of ``section.flavor`` must equal it (a
    ConfigError lists each mismatch, named ``model.<key>`` and as ``source_keys`` names it
    in ``where``); ``TRAINING_ONLY_KEYS`` override it. ``vocab_size`` is the data tokenizer's
    and may be below the embedding's rows (published vocabularies are often padded); the
    model keeps the directory's rows. ``seq_len`` raises ``max_seq_len`` as for a flavor."""
    from trainforge.errors import ConfigError

    # The section's own default (model/section.py imports this module, so not imported from there).
    default_flavor = next(f.default for f in dataclasses.fields(section) if f.name == "flavor")
    shape_keys = [k for k in OVERRIDES if k not in TRAINING_ONLY_KEYS]
    wanted: dict[str, tuple[object, str]] = {}  # field -> (value, where it was asked for)
    if section.flavor != default_flavor:
        flavor = FLAVORS[section.flavor]
        wanted = {k: (getattr(flavor, k), f"model.flavor = {section.flavor!r} has {k} = {getattr(flavor, k)!r}")
                  for k in shape_keys}
    for k in shape_keys:
        v = getattr(section, k)
        if v is not None:
            wanted[k] = (v, f"model.{k} = {v!r}")
    mismatches = [f"{why} but {where} has {source_keys.get(k, k)} {getattr(source, k)!r}"
                  for k, (v, why) in wanted.items() if v != getattr(source, k)]
    if mismatches:
        raise ConfigError("model.init_from: the model shape asked for does not match the weights: "
                          + "; ".join(mismatches) + f". Remove those [model] keys (and leave model.flavor at "
                          f"{default_flavor!r}, or name a flavor of that shape): with model.init_from the shape "
                          "comes from the directory")
    if vocab_size > source.vocab_size:
        raise ConfigError(f"model.init_from: the data's tokenizer has {vocab_size} tokens but {where} has "
                          f"{source_keys.get('vocab_size', 'vocab_size')} {source.vocab_size} (embedding rows): "
                          "tokenise the data with the directory's tokenizer.json (trainforge prepare --tokenizer)")
    changes = {k: getattr(section, k) for k in TRAINING_ONLY_KEYS if getattr(section, k) is not None}
    if seq_len is not None and seq_len > source.max_seq_len:
        changes["max_seq_len"] = seq_len
    return dataclasses.replace(source, **changes)
