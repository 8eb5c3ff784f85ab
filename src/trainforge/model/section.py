"""``[model]``: which model shape to train (a named flavor, optionally overridden).
``model_config_from_section`` (``config.py`` beside it) turns it into a ``ModelConfig``, or
``model_config_from_init`` when ``init_from`` names weights to start from."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from trainforge.config_base import _f, _require
from trainforge.errors import ConfigError
from trainforge.model.hourglass_spec import parse_spec


def _hourglass_tables(text: str, key: str) -> list[dict]:
    """model.hourglass's compact command-line form ("2@1 4@2/2 2@1") as its TOML tables."""
    try:
        stages = parse_spec(text, key)
    except ConfigError as e:
        raise ConfigError(f"{e}, or a TOML list of tables, e.g. '[{{blocks = 2}}, {{blocks = 4, shorten = 2}}, "
                          "{blocks = 2}]'") from None
    return [{"blocks": s.blocks, "shorten": s.shorten, "width_ratio": s.width_ratio} for s in stages]


@dataclass
class ModelSection:
    flavor: str = _f("tiny", "named model shape: debug, tiny, small, llama-1b, llama-8b, llama-70b, llama-405b; "
                                        "mixture of experts: moe-debug, moe-tiny, moe-small; DeepSeek-V3 (latent "
                                        "attention + experts): dsv3-debug, dsv3-tiny, deepseek-v3-671b; hourglass "
                                        "(shortened, narrower middle): hourglass-tiny, hourglass-small. With model.init_from, "
                                        "left at tiny the shape is the directory's; another flavor must match it")
    init_from: str | None = _f(None, "start from these weights (fine-tuning): a Hugging Face directory (config.json "
                                     "+ *.safetensors; Llama, DeepSeek-V3, Glm4Moe or Mixtral) or a trainforge "
                                     "checkpoint or run directory (its newest checkpoint). Only the weights are "
                                     "taken: the optimizer, step and LR schedule start fresh (--resume continues a "
                                     "run instead). The shape comes from the directory (model.* shape keys and a "
                                     "non-default flavor must match it) and so does the tokenizer: data.path must be "
                                     "tokenised with its tokenizer.json; unset, the built-in corpus is prepared with "
                                     "it")
    dim: int | None = _f(None, "override the flavor's hidden size")
    n_layers: int | None = _f(None, "override the flavor's number of transformer blocks")
    n_heads: int | None = _f(None, "override the flavor's number of query heads")
    n_kv_heads: int | None = _f(None, "override the flavor's number of key/value heads (GQA)")
    ffn_hidden_dim: int | None = _f(None, "override the flavor's SwiGLU hidden size")
    tie_embeddings: bool | None = _f(None, "share input embedding and output projection weights")
    # Mixture of experts (the moe-* flavors set these; None keeps the flavor's value).
    n_routed_experts: int | None = _f(None, "routed experts per MoE block (0 = dense model)")
    n_shared_experts: int | None = _f(None, "always-on experts per MoE block")
    n_activated_experts: int | None = _f(None, "experts each token is routed to (top-k)")
    moe_inter_dim: int | None = _f(None, "SwiGLU hidden size of each expert")
    n_dense_layers: int | None = _f(None, "the first blocks keep a dense feed-forward")
    score_func: Literal["sigmoid", "softmax"] | None = _f(None, "router scores: sigmoid (DeepSeek-V3) or "
                                                               "softmax (Mixtral)")
    route_scale: float | None = _f(None, "multiplies the chosen experts' normalised weights")
    norm_topk_prob: bool | None = _f(None, "softmax router: renormalise the chosen experts' weights "
                                           "(sigmoid always does)")
    n_group: int | None = _f(None, "group-limited routing: experts split into this many groups")
    topk_group: int | None = _f(None, "group-limited routing: groups a token may use (best by top-2 sum)")
    bias_update_rate: float | None = _f(None, "auxiliary-loss-free balancing: the router bias moves by this "
                                              "times sign(mean load - load) after each step; 0 = off")
    aux_loss_alpha: float | None = _f(None, "batch-wise auxiliary balance loss coefficient (0 = off)")
    seq_aux_loss_alpha: float | None = _f(None, "sequence-wise balance loss coefficient (DeepSeek-V3; "
                                                "e.g. 1e-4 beside the bias; 0 = off)")
    # Multi-head latent attention and YaRN (the dsv3-* flavors set these; None keeps the flavor's value).
    q_lora_rank: int | None = _f(None, "latent attention: rank of the low-rank query projection (0 = full rank)")
    kv_lora_rank: int | None = _f(None, "latent attention: width of the compressed key/value latent "
                                        "(0 = standard attention)")
    qk_nope_head_dim: int | None = _f(None, "latent attention: per-head query/key dims without rotary embedding")
    qk_rope_head_dim: int | None = _f(None, "latent attention: rotary query/key dims (one rotary key shared by all "
                                            "heads)")
    v_head_dim: int | None = _f(None, "latent attention: per-head value dims")
    rope_factor: float | None = _f(None, "YaRN context extension factor (1 = no scaling; DeepSeek-V3: 40)")
    rope_original_max_seq_len: int | None = _f(None, "YaRN: the context length the model was pretrained at")
    rope_beta_fast: float | None = _f(None, "YaRN: rotations above which a frequency is kept (extrapolated)")
    rope_beta_slow: float | None = _f(None, "YaRN: rotations below which a frequency is divided by rope_factor")
    rope_mscale: float | None = _f(None, "YaRN: attention temperature coefficient of the rotary tables")
    rope_mscale_all_dim: float | None = _f(None, "YaRN: attention temperature coefficient of the softmax scale "
                                                 "(0 = none)")
    # Multi-token prediction (model/mtp.py).
    mtp_depth: int | None = _f(None, "multi-token prediction modules after the main model (DeepSeek-V3: 1), each "
                                     "predicting one token further; 0 = none. Loss weight: training.mtp_loss_weight")
    # Hourglass (model/hourglass.py, model/hourglass_spec.py).
    hourglass: list[dict] | None = _f(None, "hourglass stages in the order they run, outside in and back out, e.g. "
                                            "[{blocks = 2}, {blocks = 4, shorten = 2, width_ratio = 2}, "
                                            "{blocks = 2}]: each stage's blocks run on 1/shorten of the tokens "
                                            "at width dim/width_ratio (both counted from the input). Each step "
                                            "in shortens by an integer k >= 2 (shift right by k-1, pool k "
                                            "positions, project down); the way out mirrors it (repeat each "
                                            "position k times, project up, add the stream from before). The "
                                            "blocks add up to model.n_layers; [] = dense. On the command "
                                            "line also BLOCKS@SHORTEN[/WIDTH_RATIO] per stage: '2@1 4@2/2 2@1'",
                                  example="[{blocks = 2}, {blocks = 4, shorten = 2}, {blocks = 2}] or '2@1 4@2 2@1'",
                                  from_text=_hourglass_tables)
    hourglass_pool: Literal["mean", "linear"] | None = _f(None, "hourglass shortening: mean of each k positions, "
                                                                "or a learned linear map of their concatenation")

    def validate(self) -> None:
        from trainforge.model.config import FLAVORS

        _require(self.flavor in FLAVORS, "model.flavor", self.flavor, f"one of {sorted(FLAVORS)}")
        for name in ("dim", "n_layers", "n_heads", "n_kv_heads", "ffn_hidden_dim"):
            v = getattr(self, name)
            _require(v is None or v > 0, f"model.{name}", v, "a positive integer")
        if self.init_from is not None:
            _require(self.init_from != "", "model.init_from", self.init_from, "a directory path, or leave unset")
            _require(Path(self.init_from).is_dir(), "model.init_from", self.init_from,
                     "an existing directory (a Hugging Face model directory or a trainforge checkpoint/run "
                     "directory); check the path")
        _require(self.mtp_depth is None or self.mtp_depth >= 0, "model.mtp_depth", self.mtp_depth, "an integer >= 0")
        if self.hourglass is not None:
            from trainforge.model.hourglass_spec import stages_from_tables

            stages_from_tables(self.hourglass)  # names the table and key; the shape is checked with the flavor
