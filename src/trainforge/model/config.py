"""Model shapes. ``ModelConfig`` is everything the single-device model needs;
``FLAVORS`` are named shapes, from a < 1M-parameter test model to Llama 3.1 405B.

The real-size flavors follow the published Llama 3.x shapes so the planner and
memory estimates can build them on the meta device (no memory is allocated).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from trainforge.model.hourglass_spec import (HourglassStage, check_pool, check_spec, format_spec, parse_spec,
                                             shortening_spans, stage_of_layers, stages_from_tables)
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
    # Hourglass (model/hourglass.py): stages at shortened rates and narrower widths, as the
    # canonical text of model/hourglass_spec.py ("2@1 4@2/2 2@1"); "" = every block at full rate.
    hourglass: str = ""
    hourglass_pool: str = "mean"  # "mean" or "linear": how each k positions become one

    def __post_init__(self) -> None:
        # Positive sizes first: 0 heads would otherwise be a ZeroDivisionError.
        check_shape({f: getattr(self, f) for f in _FIELD_KEYS}, _FIELD_KEYS)
        if self.n_routed_experts:
            check_moe({f: getattr(self, f) for f in MOE_KEYS}, self.n_layers)
        check_mla({f: getattr(self, f) for f in MLA_KEYS})
        check_mtp_depth(self.mtp_depth)
        check_hourglass(self)

    # -- hourglass (model/hourglass_spec.py) ------------------------------------------------

    @property
    def is_hourglass(self) -> bool:
        return bool(self.hourglass)

    @property
    def hourglass_stages(self) -> tuple[HourglassStage, ...]:
        return parse_spec(self.hourglass)

    def layer_stage(self, layer: int) -> HourglassStage:
        """The stage block ``layer`` runs in (the full-rate stage of a dense model; the MTP
        blocks, numbered from n_layers, run at the full rate)."""
        stages = self.hourglass_stages
        if not stages or layer >= self.n_layers:
            return HourglassStage(self.n_layers)
        return stages[stage_of_layers(stages)[layer]]

    def layer_widths(self, layer: int) -> tuple[int, int]:
        """(stream width, feed-forward width) of block ``layer``: dim and ffn_hidden_dim over
        its stage's width_ratio."""
        r = self.layer_stage(layer).width_ratio
        return self.dim // r, self.ffn_hidden_dim // r

    def stage_config(self, layer: int) -> ModelConfig:
        """The config block ``layer`` is built from: this one at full rate, else a dense
        config of its stage's widths (same heads, each dim / n_heads / width_ratio wide)."""
        if not self.is_hourglass or self.layer_stage(layer).width_ratio == 1:
            return self
        d, ffn = self.layer_widths(layer)
        return dataclasses.replace(self, dim=d, ffn_hidden_dim=ffn, hourglass="", mtp_depth=0)

    @property
    def pipeline_spans(self) -> tuple[tuple[int, int], ...]:
        """[first, last) block ranges a pipeline stage must hold whole, or none: an hourglass
        level's shortening, blocks and upsampling (the upsampling adds the stream from before
        the shortening). ``parallel/`` checks stage starts against them without knowing why."""
        return tuple(shortening_spans(self.hourglass_stages)) if self.is_hourglass else ()

    @property
    def pipeline_spans_source(self) -> str:
        """The key that sets ``pipeline_spans``, for the error that names it."""
        return f"model.hourglass = {self.hourglass!r}"

    def hourglass_params(self) -> int:
        """Parameters of the shortenings and upsamplings (hourglass.py): per level, the pool's
        projection (mean: width_out -> width_in, none when equal; linear: k·width_out -> width_in)
        and the upsampling's width_in -> width_out (none when equal)."""
        total = 0
        stages = self.hourglass_stages
        for outer, inner in zip(stages[:len(stages) // 2], stages[1:len(stages) // 2 + 1]):
            k = inner.shorten // outer.shorten
            d_out, d_in = self.dim // outer.width_ratio, self.dim // inner.width_ratio
            if self.hourglass_pool == "linear":
                total += k * d_out * d_in
            elif d_out != d_in:
                total += d_out * d_in
            total += d_out * d_in if d_out != d_in else 0
        return total

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

    def attention_params(self, width: int | None = None) -> int:
        """Parameters of one block's attention (latent norms included); ``width``: the stream
        width of an hourglass stage (the heads are kept, each ``width / n_heads`` wide)."""
        d, H = width or self.dim, self.n_heads
        if not self.is_mla:
            head_dim = d // H
            return d * H * head_dim * 2 + d * self.n_kv_heads * head_dim * 2
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
        total += self.hourglass_params()
        if mtp:
            total += self.mtp_params(active)
        return total + (emb if include_embedding else 0)

    def _block_params(self, layer: int, active: bool) -> int:
        """One ``TransformerBlock`` with index ``layer`` (MoE from ``n_dense_layers`` on)."""
        if self.is_hourglass:  # dense, standard attention (check_hourglass), at the stage's width
            d, ffn = self.layer_widths(layer)
            return self.attention_params(d) + 3 * d * ffn + 2 * d
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
        positions are ignored). An hourglass model counts per stage
        (``hourglass_flops_per_token``)."""
        if self.is_hourglass:
            return sum(self.hourglass_flops_per_token(seq_len).values())
        n = self.num_params(include_embedding=False, active=True)
        n += self.mtp_depth * self.vocab_size * self.dim  # the shared head, once per depth
        if self.is_mla:
            widths = self.n_heads * (self.qk_nope_head_dim + self.qk_rope_head_dim + self.v_head_dim)
        else:
            widths = 2 * self.dim
        return 6.0 * n + 6.0 * (self.n_layers + self.mtp_depth) * widths * seq_len

    def block_flops_per_token(self, layer: int, seq_len: int) -> float:
        """Training FLOPs of block ``layer`` per *input* token: 6 x its parameters plus its
        attention products over its stage's context, at its width, divided by its stage's
        shortening (it sees one position per ``shorten`` tokens). For a dense block this is
        ``flops_per_token``'s per-layer term (plan/memory_model.py's block_flops_per_token)."""
        stage = self.layer_stage(layer)
        width, _ = self.layer_widths(layer)
        if self.is_mla:
            widths = self.n_heads * (self.qk_nope_head_dim + self.qk_rope_head_dim + self.v_head_dim)
        else:
            widths = 2 * width
        positions = seq_len / stage.shorten
        return (6.0 * self._block_params(layer, active=True) + 6.0 * widths * positions) / stage.shorten

    def hourglass_flops_per_token(self, seq_len: int) -> dict[str, float]:
        """Training FLOPs per input token by part, in the order they run: each stage's
        blocks (its key "stage i: B blocks @k/r"), each level's shortening and upsampling
        (their projections run once per shortened position: the upsampling projects before
        it repeats, the same linear map), and the head (final norm + output projection,
        and the MTP depths as ``flops_per_token`` counts them). Sums to ``flops_per_token``."""
        stages = self.hourglass_stages
        parts: dict[str, float] = {}
        layer = 0
        mid = len(stages) // 2
        for i, s in enumerate(stages):
            if 0 < i <= mid:
                outer = stages[i - 1]
                k = s.shorten // outer.shorten
                d_out, d_in = self.dim // outer.width_ratio, self.dim // s.width_ratio
                pool = k * d_out * d_in if self.hourglass_pool == "linear" else (d_out * d_in if d_out != d_in else 0)
                parts[f"shorten to 1/{s.shorten}"] = 6.0 * pool / s.shorten
            if i > mid:
                inner = stages[i - 1]
                d_out, d_in = self.dim // s.width_ratio, self.dim // inner.width_ratio
                parts[f"upsample to 1/{s.shorten}"] = 6.0 * (d_out * d_in if d_out != d_in else 0) / inner.shorten
            parts[f"stage {i}: {format_spec((s,))}"] = sum(self.block_flops_per_token(j, seq_len)
                                                           for j in range(layer, layer + s.blocks))
            layer += s.blocks
        d = self.dim
        head = 6.0 * self.vocab_size * d * (1 + self.mtp_depth) + 6.0 * d  # output (+ once per depth), norm
        head += sum(6.0 * (3 * d + 2 * d * d) + self.block_flops_per_token(self.n_layers + k, seq_len)
                    for k in range(self.mtp_depth))
        parts["head"] = head
        return parts

    def describe_flops(self, seq_len: int) -> str:
        """"61.2M training FLOPs/token at seq_len 256" (forward + backward); an hourglass model
        adds the per-stage split ("stage 0: 2@1 8.9M, shorten to 1/2 0.2M, ...")."""
        def n(x: float) -> str:
            return f"{x / 1e9:.2f}G" if x >= 1e9 else f"{x / 1e6:.2f}M"
        text = f"{n(self.flops_per_token(seq_len))} training FLOPs/token at seq_len {seq_len}"
        if self.is_hourglass:
            parts = self.hourglass_flops_per_token(seq_len).items()
            text += " (" + ", ".join(f"{k} {n(v)}" for k, v in parts if v) + ")"  # leave out parameter-free pools
        return text

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
        if self.is_hourglass:
            text += f" (hourglass {self.hourglass}, {self.hourglass_pool} pool)"
        return text


def check_hourglass(cfg: ModelConfig, keys: dict[str, str] = _FIELD_KEYS) -> None:
    """``cfg.hourglass`` / ``hourglass_pool`` against the shape (hourglass_spec.check_spec);
    the hourglass runs dense blocks with standard attention only."""
    check_pool(cfg.hourglass_pool)
    if not cfg.hourglass:
        return
    if cfg.is_moe or cfg.is_mla:
        from trainforge.errors import ConfigError

        raise ConfigError(f"config key 'model.hourglass' = {cfg.hourglass!r} needs a dense model with standard "
                          "attention (its narrower stages scale dim, heads' width and the feed-forward); set "
                          "model.n_routed_experts = 0 and model.kv_lora_rank = 0, or leave model.hourglass unset")
    check_spec(parse_spec(cfg.hourglass), n_layers=cfg.n_layers, dim=cfg.dim, n_heads=cfg.n_heads,
               ffn_hidden_dim=cfg.ffn_hidden_dim, n_layers_key=keys["n_layers"])


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
    # Hourglass (model/hourglass.py): tiny's shape, the middle 6 blocks on half the tokens (k = 2,
    # Dynamic Token Pooling's fixed-k anchor; like its 2 + 8/10 + 2 layouts, most blocks are
    # shortened), mean pooling: tiny's parameters, 0.69x its FLOPs/token at seq_len 256. With
    # only the middle 4 shortened ("2@1 4@2 2@1", 0.79x) the FLOPs bound 1.26x was below the 1.3x
    # training target, and at 600 steps 1@1 6@2 1@1 reached the lower validation loss of the two
    # (docs/benchmarks-archive.md "Hourglass vs dense").
    "hourglass-tiny": ModelConfig(dim=256, n_layers=8, n_heads=8, n_kv_heads=4, vocab_size=8192, ffn_hidden_dim=704,
                                  hourglass="1@1 6@2 1@1"),
    # small's width, shortened twice (k = 2, then 2) with the 8 innermost blocks at half the width
    # (dim 384): 18 blocks, +0.5% of small's parameters, 0.68x its FLOPs/token at seq_len 1024.
    "hourglass-small": ModelConfig(dim=768, n_layers=18, n_heads=12, n_kv_heads=4, vocab_size=32000,
                                   ffn_hidden_dim=2048, hourglass="2@1 3@2 8@4/2 3@2 2@1"),
}

# [model] keys that override a flavor (ModelSection's fields of the same names).
OVERRIDES = ("dim", "n_layers", "n_heads", "n_kv_heads", "ffn_hidden_dim", "tie_embeddings", *MOE_KEYS, *MLA_KEYS,
             "mtp_depth", "hourglass", "hourglass_pool")


def _section_value(section, key: str):
    """``section``'s value of an OVERRIDES key as a ModelConfig field (None: unset); the
    hourglass's TOML tables become the spec's canonical text ([] is no hourglass: "")."""
    v = getattr(section, key)
    if key == "hourglass" and v is not None:
        return format_spec(stages_from_tables(v))
    return v


def model_config_from_section(section, vocab_size: int | None, seq_len: int | None = None) -> ModelConfig:
    """Resolve ``[model]`` (a ``ModelSection``) into a ModelConfig.

    ``vocab_size`` comes from the prepared data's tokenizer, so a flavor trains on
    any corpus; ``seq_len`` raises ``max_seq_len`` when training needs longer rope tables."""
    base = FLAVORS[section.flavor]
    changes = {k: v for k in OVERRIDES if (v := _section_value(section, k)) is not None}
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
    # ModelConfig's own check_hourglass names model.hourglass / model.n_layers as the user set them.
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
        v = _section_value(section, k)
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
