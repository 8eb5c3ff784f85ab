"""What one rank holds and computes, from the model's shape alone (no weights built):
bytes per dtype of a precision policy, parameters, FLOPs and saved activations per
layer, and the pipeline stage split.

Activations saved for backward, per token of one block (elements; bytes = elements x the
activation dtype's size), derived for this repository's Llama block (RMSNorm, SDPA,
SwiGLU, no dropout) the way Korthikanti et al. 2022 ("Reducing Activation Recomputation in
Large Transformer Models", eq. 1: 34·s·b·h + 5·a·s²·b bytes per GPT layer) count theirs:

- attention: RMSNorm keeps its input, the normalised value and the scaled output (3h;
  every norm here keeps 3 x its width), q (h), k and v (2·h_kv), the SDPA output (h, also
  the output projection's input), SDPA's fp32 log-sum-exp (n_heads x 4 bytes). SDPA /
  flash attention recomputes the s x s scores, so Korthikanti's 5·a·s²·b term is gone.
  Latent attention (MLA) keeps its low-rank latents (normed: 3x), the rotary key and the
  up-projected keys and values as well.
- feed-forward: the norm (3h), w1's and w3's outputs, silu(w1 x) and the product fed to
  w2 (4·f). A MoE layer: the router's fp32 scores (twice), the k dispatched copies of each
  token in, out and weighted (3·k·h) and 4·f_e per routed (k) and shared expert.

For GPT's shape (f = 4h, h_kv = h) that gives 26·h elements = 52·h bytes in 16 bits: more
than Korthikanti's 34·h because SwiGLU keeps three f-wide tensors where GeLU keeps two and
an RMSNorm computed in fp32 keeps three tensors, less their dropout masks. Checked against
what autograd saves (``precision.memory.measure_activation_bytes``) for the small flavors
in ``tests/plan/test_cost_model.py``. Tensor parallelism with sequence parallelism (the
trainer's default) divides all of it by tp. With activation checkpointing a block keeps
only its input (h) and one block's full set lives again while it is recomputed in
backward.

The head (final norm, output projection, cross-entropy on fp32 logits) holds, for the
microbatch in its loss, the bf16 logits, their fp32 copy and its gradient: V/tp x (a + 8)
bytes per token.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass

from trainforge.model.config import ModelConfig
from trainforge.precision.section import PRESETS

DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}


@dataclass(frozen=True)
class PrecisionBytes:
    """Bytes per value of each kind of state under a ``[precision] policy``."""

    compute_dtype: str  # the autocast dtype: activations, attention, the head; which peak MFU is of
    param: int
    grad: int
    reduce: int
    activation: int
    optimizer_state: int  # per AdamW moment (two of them)
    master: int  # fp32 master copy where parameters are stored low (0 otherwise)
    # The blocks' linear GEMMs' dtype where it differs from compute_dtype ("fp8": priced at the
    # board's FP8 peak); "" = compute_dtype.
    gemm_dtype: str = ""


# Planning only (the trainer has no FP8 policy): bf16-mixed with every linear GEMM of the blocks in
# FP8, as Transformer Engine's fp8_autocast and DeepSeek-V3's recipe run them. Attention, the
# embedding, the output head, norms and the router stay bf16 (both do so), and so does every byte
# held: activations, fp32 master weights, gradients and AdamW moments are counted as bf16-mixed
# (DeepSeek keeps bf16 moments and some fp8 activations: an upper bound on memory).
FP8 = "fp8"


def precision_bytes(policy: str) -> PrecisionBytes:
    """A preset name (fp32, bf16-mixed, fp16-mixed, dynamic), bf16 / fp16 (parameters
    stored in that dtype with fp32 AdamW state and fp32 master weights) or fp8 (``FP8``:
    bf16-mixed with FP8 linear GEMMs). ValueError else."""
    if policy == FP8:
        return dataclasses.replace(precision_bytes("bf16-mixed"), gemm_dtype="fp8")
    if policy in ("bf16", "fp16"):
        d = {"param_dtype": policy, "compute_dtype": policy, "reduce_dtype": policy, "optimizer_state_dtype": "fp32"}
    elif policy in PRESETS:
        d = PRESETS[policy]
    else:
        raise ValueError(f"unknown precision policy {policy!r}: choose one of "
                         f"{', '.join([*PRESETS, 'bf16', 'fp16', FP8])}")
    param = DTYPE_BYTES[d["param_dtype"]]
    return PrecisionBytes(compute_dtype=d["compute_dtype"], param=param, grad=param,
                          reduce=DTYPE_BYTES[d["reduce_dtype"]], activation=DTYPE_BYTES[d["compute_dtype"]],
                          optimizer_state=DTYPE_BYTES[d["optimizer_state_dtype"]],
                          master=4 if param != 4 and d["optimizer_state_dtype"] == "fp32" else 0)


# ---------------------------------------------------------------- parameters and FLOPs


def routed_expert_params(cfg: ModelConfig, layer: int) -> int:
    """The routed experts of one block (what expert parallelism splits); 0 if dense."""
    return 3 * cfg.dim * cfg.moe_inter_dim * cfg.n_routed_experts if cfg.is_moe_layer(layer) else 0


def block_params(cfg: ModelConfig, layer: int) -> tuple[int, int]:
    """(dense parameters, routed expert parameters) of block ``layer``."""
    total = cfg._block_params(layer, active=False)
    routed = routed_expert_params(cfg, layer)
    return total - routed, routed


def block_flops_per_token(cfg: ModelConfig, layer: int, seq_len: int) -> float:
    """Training FLOPs (forward + backward) of one block per token: 6 x its active
    parameters plus its attention products, as ``ModelConfig.flops_per_token`` counts (its
    ``block_flops_per_token``, which also counts an hourglass block at its stage's rate and
    width, and an MTP block, numbered from n_layers, at the full rate)."""
    return cfg.block_flops_per_token(layer, seq_len)


def head_flops_per_token(cfg: ModelConfig, seq_len: int) -> float:
    """The output projection, plus each MTP depth (its block, projection and one more pass
    through the shared output projection): what runs on the last stage after the blocks."""
    v, d = cfg.vocab_size, cfg.dim
    mtp = sum(block_flops_per_token(cfg, cfg.n_layers + k, seq_len) + 6.0 * (2 * d * d + v * d)
              for k in range(cfg.mtp_depth))
    return 6.0 * v * d + mtp


def head_params(cfg: ModelConfig) -> int:
    """Final norm, output projection (unless tied) and the MTP modules: the last stage's extra."""
    return cfg.dim + (0 if cfg.tie_embeddings else cfg.vocab_size * cfg.dim) + cfg.mtp_params()


def embedding_params(cfg: ModelConfig) -> int:
    return cfg.vocab_size * cfg.dim


# ---------------------------------------------------------------- activations


def block_activation_elements(cfg: ModelConfig, layer: int, activation_bytes: int) -> float:
    """Elements saved per token by one block without checkpointing (module docstring),
    fp32 side tensors converted to elements of ``activation_bytes``."""
    h = cfg.dim
    fp32 = 4 / activation_bytes
    H = cfg.n_heads
    if cfg.is_mla:
        qk = cfg.qk_nope_head_dim + cfg.qk_rope_head_dim
        attn = (3 * h + 3 * cfg.q_lora_rank + 2 * H * qk + cfg.qk_rope_head_dim + 3 * cfg.kv_lora_rank
                + H * (cfg.qk_nope_head_dim + cfg.v_head_dim) + 2 * H * cfg.v_head_dim)
    else:
        attn = 3 * h + 2 * h + 2 * cfg.n_kv_heads * cfg.head_dim
    attn += H * fp32
    if cfg.is_moe_layer(layer):
        k = cfg.n_activated_experts
        ffn = 3 * h + 3 * k * h + 4 * cfg.moe_inter_dim * (k + cfg.n_shared_experts) + 2 * cfg.n_routed_experts * fp32
    else:
        ffn = 3 * h + 4 * cfg.ffn_hidden_dim
    return attn + ffn


def head_activation_bytes_per_token(cfg: ModelConfig, activation_bytes: int, tp: int) -> float:
    """The last stage's loss: final norm in and out, logits (bf16 + fp32 copy + its
    gradient), per MTP depth a block and its logits once more."""
    h, v = cfg.dim, cfg.vocab_size
    logits = v / tp * (activation_bytes + 8)
    per_depth = block_activation_elements(cfg, cfg.n_layers, activation_bytes) * activation_bytes / tp + logits
    return 3 * h * activation_bytes / tp + logits + cfg.mtp_depth * per_depth


@dataclass(frozen=True)
class LayerTable:
    """Per block: dense and routed-expert parameters, training FLOPs per token, saved
    activation bytes per token (no checkpointing, before tp); plus the head's FLOPs and
    activation bytes per token (before tp) and the whole model's FLOPs per token."""

    dense_params: tuple[int, ...]
    expert_params: tuple[int, ...]
    flops_per_token: tuple[float, ...]
    activation_bytes_per_token: tuple[float, ...]
    moe: tuple[bool, ...]
    head_flops_per_token: float
    model_flops_per_token: float


@functools.lru_cache(maxsize=256)
def layer_table(cfg: ModelConfig, seq_len: int, activation_bytes: int) -> LayerTable:
    """Everything the cost model sums over layers, computed once per model (hashing a
    ModelConfig costs more than one estimate's arithmetic)."""
    n = range(cfg.n_layers)
    params = [block_params(cfg, i) for i in n]
    return LayerTable(dense_params=tuple(p[0] for p in params), expert_params=tuple(p[1] for p in params),
                      flops_per_token=tuple(block_flops_per_token(cfg, i, seq_len) for i in n),
                      activation_bytes_per_token=tuple(block_activation_elements(cfg, i, activation_bytes)
                                                       * activation_bytes for i in n),
                      moe=tuple(cfg.is_moe_layer(i) for i in n),
                      head_flops_per_token=head_flops_per_token(cfg, seq_len),
                      model_flops_per_token=cfg.flops_per_token(seq_len))


# ---------------------------------------------------------------- the pipeline split


@functools.lru_cache(maxsize=1024)
def stage_boundaries(cfg: ModelConfig, seq_len: int, num_stages: int, checkpointed: bool) -> tuple[int, ...]:
    """First layer of each stage, as ``parallel.pp_split = auto`` would choose it if its
    measured layer times were the FLOPs: ``choose_boundaries`` (the trainer's own
    partitioner) over per-block FLOPs, the head's counted with the last block (where
    ``split_model`` puts it). Recomputation adds a forward (a third) to every block."""
    from trainforge.parallel.stage_balance import choose_boundaries

    ac = 4 / 3 if checkpointed else 1.0
    costs = [block_flops_per_token(cfg, i, seq_len) * ac for i in range(cfg.n_layers)]
    costs[-1] += head_flops_per_token(cfg, seq_len)
    return tuple(choose_boundaries(costs, num_stages))
