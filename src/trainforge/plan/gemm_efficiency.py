"""How fast a GPU runs one block's kernels, by shape and by training stack: the cost
model's compute rate (``compute_s``), the memory-bound byte factors (``stream_factor``,
``loss_bytes_per_logit``) and the tensor-parallel overlap (``tp_exposed_s``).

GEMM shape. One GEMM (m x k) @ (k x n) runs as tiles of ``tile_m x tile_n`` outputs, one
tile per SM at a time: ``ceil(tiles / n_sms)`` waves of ``2 tile_m tile_n (k + k_fill)``
FLOPs at ``peak / n_sms x tile_efficiency`` (``k_fill``: the pipeline's fill and the epilogue,
as k-steps that do no math), never faster than its operands stream from HBM, plus a fixed
``launch_s``. ``gemm_shape_factor`` is that rate over the large-GEMM limit (wave count and k
large): 1 for a big GEMM, lower for a small k, a partial last wave, or a short GEMM. The
four parameters are fitted (least squares on log rate) to one published measurement of
cuBLAS on H100, nothing from the validation rows: OpenXLA's sm_90 matmul table
(``H100_CUBLAS_POINTS``, bf16, 72 shapes from 256 to 4096 per dim, b x m x n x k): rms
error 9.7 % in log rate, the shapes of 30 GFLOP and more within 7 %, the worst (small m, n
with k = 4096, where cuBLAS splits k) 28 %. The level stays the GPU's ``matmul_efficiency`` (a large
training-shaped GEMM); the factor multiplies it per GEMM. The block's GEMMs are its
projections and MLP (forward, and the input- and weight-gradient GEMMs of backward, each
with its own shape); MoE experts get the tokens routed to one expert; the head its own.

Attention products: a flash-attention kernel, not a GEMM. Its published speed on H100 SXM5
(FlashAttention-3 paper, Shah et al. 2024, arXiv 2407.08608, figures 5-6, head dim 128,
causal forward, backward) is kept per kernel and sequence length as a fraction of the dense
peak; those figures count the causal half of the products (and 2.5x the forward for
backward), so the model's full products (``ModelConfig.flops_per_token``) are halved here.

Stacks (``Workload.stack``). ``trainforge``: eager PyTorch, FSDP2/DTensor, the design of
``trainforge train`` and torchtitan; ``F.scaled_dot_product_attention`` (FlashAttention-2
kernels on H100); every elementwise op its own kernel (``EAGER_STREAM_FACTOR``); the loss in
fp32 unfused; TP collectives exposed (no async TP). ``trainforge-compile``: the same with
``parallel.compile``: the blocks' elementwise ops fused (the cost model's memory-bound count
is such a fused count, factor 1); the loss is outside the compiled blocks. ``megatron``:
Megatron-Core + Transformer Engine: fused kernels (factor 1), cuDNN fused attention,
Megatron's fp32 vocab-parallel loss, and TP communication overlapped by userbuffers
(``tp_exposed_s``), the GEMMs it overlaps with cut into chunks as TE cuts them (``_splits``:
ring-exchanged all-gathers in tp chunks of m / tp rows, pipelined reduce-scatters in 4, three
chunks in flight at once): smaller GEMMs, priced by the same wave model.

Only a cluster with a ``kernel_table`` (a GPU from ``hardware.py``) gets these terms: a
measured cluster (``probe.py``) is calibrated end to end, with its own stack in its one
``matmul_efficiency``, and keeps exactly the rate and byte counts it was calibrated with.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

from trainforge.model.config import ModelConfig
from trainforge.plan.spec import Cluster

# OpenXLA's default matmul performance table for sm_90 (H100 SXM), bf16 x bf16 -> bf16, as
# (b, m, n, k, TFLOP/s): the first 72 entries of kDefaultMatmulPTable in
# https://github.com/tensorflow/tensorflow/blob/372d578bb861cc5804e56d37d93aec931a59762c/
# third_party/xla/xla/service/gpu/model/matmul_interpolator_data.h (TFLOP/s rounded to 0.1).
H100_CUBLAS_SOURCE = ("OpenXLA sm_90 matmul table (cuBLAS, bf16): https://github.com/tensorflow/tensorflow/blob/"
                      "372d578bb861cc5804e56d37d93aec931a59762c/third_party/xla/xla/service/gpu/model/"
                      "matmul_interpolator_data.h")
H100_CUBLAS_POINTS: tuple[tuple[int, int, int, int, float], ...] = (
    (1, 1024, 2048, 256, 139.5), (2, 256, 2048, 2048, 332.2), (1, 256, 2048, 256, 41.8), (4, 512, 256, 256, 42.4),
    (1, 4096, 512, 512, 238.8), (4, 4096, 256, 2048, 588.7), (1, 512, 256, 512, 21.8), (2, 2048, 256, 512, 139.2),
    (2, 1024, 2048, 1024, 493.4), (1, 256, 2048, 4096, 285.9), (2, 512, 2048, 2048, 525.3),
    (4, 1024, 2048, 2048, 712.7), (1, 4096, 1024, 512, 343.7), (1, 2048, 2048, 2048, 632.0), (4, 256, 256, 256, 22.6),
    (2, 256, 256, 1024, 37.0), (1, 256, 512, 4096, 91.7), (1, 256, 1024, 256, 22.7), (1, 4096, 4096, 256, 392.2),
    (2, 256, 1024, 2048, 216.1), (2, 2048, 4096, 1024, 678.7), (2, 4096, 512, 256, 211.0),
    (2, 4096, 4096, 2048, 763.0), (4, 512, 2048, 1024, 487.2), (4, 1024, 512, 2048, 514.2),
    (1, 2048, 512, 2048, 347.7), (2, 512, 512, 2048, 216.5), (4, 4096, 512, 1024, 589.0), (2, 1024, 256, 256, 43.7),
    (1, 4096, 4096, 4096, 783.3), (1, 512, 4096, 1024, 373.3), (2, 256, 512, 2048, 119.6), (1, 512, 256, 4096, 91.1),
    (2, 2048, 256, 4096, 378.6), (1, 256, 1024, 4096, 172.3), (1, 4096, 2048, 512, 447.0), (1, 2048, 256, 1024, 135.8),
    (2, 512, 1024, 2048, 349.5), (4, 1024, 1024, 2048, 626.1), (4, 4096, 1024, 1024, 673.8),
    (4, 1024, 256, 1024, 218.2), (2, 512, 256, 1024, 66.6), (4, 4096, 4096, 512, 619.9), (1, 2048, 1024, 2048, 523.3),
    (4, 256, 2048, 1024, 358.9), (2, 4096, 1024, 4096, 750.6), (2, 1024, 256, 4096, 306.4), (2, 2048, 256, 256, 78.8),
    (1, 512, 256, 256, 11.5), (4, 512, 256, 512, 77.9), (1, 1024, 256, 1024, 68.3), (1, 4096, 256, 2048, 304.7),
    (1, 1024, 1024, 2048, 350.0), (4, 4096, 512, 512, 441.5), (2, 4096, 1024, 256, 301.6), (1, 256, 512, 256, 11.5),
    (2, 4096, 512, 4096, 729.7), (2, 1024, 4096, 1024, 596.5), (4, 256, 256, 512, 41.2), (1, 256, 4096, 2048, 324.6),
    (4, 2048, 2048, 2048, 725.7), (1, 1024, 512, 2048, 220.0), (2, 4096, 2048, 4096, 783.2),
    (4, 4096, 1024, 512, 542.0), (4, 4096, 4096, 256, 503.9), (4, 2048, 512, 2048, 621.4),
    (1, 512, 2048, 1024, 232.6), (1, 4096, 512, 1024, 370.8), (4, 512, 4096, 1024, 592.2),
    (4, 256, 256, 4096, 171.6), (1, 1024, 2048, 2048, 524.3), (2, 2048, 2048, 1024, 600.2),
)

_FA3 = "FlashAttention-3 paper (Shah et al. 2024, arXiv 2407.08608) figs. 5-6: H100 80GB SXM5, head dim 128"


@dataclass(frozen=True)
class KernelTable:
    """Per-kernel figures of one GPU kind (module docstring). ``attention``: kernel name ->
    ((seq_len, forward TFLOP/s, backward TFLOP/s), ...) as the source measured them (causal
    half counted) on a GPU of ``attention_peak_flops``; used as fractions of that peak."""

    name: str
    n_sms: int
    tile_m: int
    tile_n: int
    k_fill: int
    tile_efficiency: float
    launch_s: float
    peak_flops: float  # the dense peak the GEMM points were measured against
    memory_bandwidth_bytes_per_s: float
    attention: dict[str, tuple[tuple[int, float, float], ...]]
    attention_peak_flops: float
    sources: dict[str, str]


KERNEL_TABLES: dict[str, KernelTable] = {
    # H100 and H200 SXM: the same GH100 die, 132 SMs, the same clocks.
    "hopper": KernelTable(
        name="hopper", n_sms=132, tile_m=64, tile_n=128, k_fill=192, tile_efficiency=0.94, launch_s=5.5e-6,
        peak_flops=989.4e12, memory_bandwidth_bytes_per_s=3.35e12,
        attention={
            # seq_len, causal forward, backward (TFLOP/s of the causal half)
            "flash-attention-2": ((512, 191, 214), (1024, 260, 260), (2048, 298, 291), (4096, 319, 310),
                                  (8192, 333, 318), (16384, 335, 322)),
            "cudnn": ((512, 315, 305), (1024, 410, 408), (2048, 484, 465), (4096, 518, 499), (8192, 529, 518),
                      (16384, 539, 516)),
        },
        attention_peak_flops=989.4e12,
        sources={"gemm": f"{H100_CUBLAS_SOURCE}: tile 64x128, k_fill 192, tile_efficiency 0.94, launch 5.5 us "
                         "fitted (least squares on log rate; rms 9.7 %)",
                 "attention": f"{_FA3} (FlashAttention-2 and cuDNN bars, bf16, read off the figures)"}),
}

# Eager PyTorch runs each elementwise op as its own kernel; bytes moved per element of the
# tensors involved, counted from the trainer's model code (model/norm.py, rope.py,
# swiglu.py) against a fused kernel (read inputs once, write outputs once), forward + backward:
# RMSNorm in fp32 (float, pow, mean, mul, cast, weight mul): 36 + ~60 B vs 4 + 8; rotary
# (neg, cat, two products with fp32 tables, add, cast): ~40 + ~50 vs 4 + 6; SwiGLU (silu,
# mul): 10 + 18 vs 6 + 10; residual adds the same. Weighted by llama's widths (2 norms of
# dim, q + k rotated, 3.5 x dim of MLP), eager moves ~3.7x the fused bytes.
EAGER_STREAM_FACTOR = 3.7
# Cross-entropy bytes per logit (the logits' own dtype bf16 in, its gradient bf16 out):
# fused 14 (the cost model's count); F.cross_entropy on .float() logits (parallel/
# tensor_parallel.py's cross_entropy_loss, torchtitan's): cast 6, log_softmax 16, its
# backward 12, nll backward 4, cast back 6 = 44; Megatron's vocab-parallel cross-entropy on
# .float() logits (cast 6, max 4, subtract 8, exp 8, sum 4, divide 8, backward multiply 8,
# cast back 6) = 52.
FUSED_LOSS_BYTES = 14.0


@dataclass(frozen=True)
class Stack:
    """One training software stack (module docstring). ``tp_overlap``: TP collectives run
    beside the GEMMs (Transformer Engine userbuffers) on ``comm_sms`` SMs; ``tp_exposed_share``:
    the part that waits anyway (TE's default methods, see ``tp_exposed_s``); ``tp_chunked``: the
    GEMMs they overlap with are cut into chunks to do so (``_splits``)."""

    name: str
    attention_kernel: str
    stream_factor: float
    loss_bytes_per_logit: float
    tp_overlap: bool = False
    comm_sms: int = 0
    tp_exposed_share: float = 1.0
    tp_chunked: bool = False  # the overlapped GEMMs run as chunks (``_splits``)
    description: str = ""


# Transformer Engine's initialize_ub defaults (transformer_engine/pytorch/module/base.py):
# forward all-gathers (qkv, fc1) ring-exchange, each step's GEMM on the chunk already there
# (nothing waits); forward reduce-scatters (proj, fc2) pipelined in 4 splits (the last split's
# reduce-scatter waits); backward all-gathers ring-exchange, reduce-scatters bulk-overlapped
# with the weight-gradient GEMM. Of the 8 collectives per block, 2 leave 1/4 exposed: 1/16.
# The communication kernels take num_sm = 16 SMs while they run.
TE_COMM_SMS = 16
TE_PIPELINE_SPLITS = 4
TE_STREAMS = 3  # _NUM_MAX_UB_STREAMS: chunk GEMMs in flight at once
TE_TP_EXPOSED_SHARE = 2 * (1 / TE_PIPELINE_SPLITS) / 8

STACKS: dict[str, Stack] = {
    "trainforge": Stack("trainforge", "flash-attention-2", EAGER_STREAM_FACTOR, 44.0,
                        description="eager PyTorch FSDP2/DTensor (trainforge train, torchtitan without compile)"),
    "trainforge-compile": Stack("trainforge-compile", "flash-attention-2", 1.0, 44.0,
                                description="trainforge / torchtitan with torch.compile on the blocks"),
    "megatron": Stack("megatron", "cudnn", 1.0, 52.0, tp_overlap=True, comm_sms=TE_COMM_SMS,
                      tp_exposed_share=TE_TP_EXPOSED_SHARE, tp_chunked=True,
                      description="Megatron-Core + Transformer Engine (fused kernels, --tp-comm-overlap)"),
}


def stack(name: str) -> Stack:
    """The ``Stack`` named ``name``; ValueError naming the known stacks."""
    if name not in STACKS:
        raise ValueError(f"unknown training stack {name!r}: choose one of {', '.join(STACKS)}")
    return STACKS[name]


def kernel_table(cluster: Cluster) -> KernelTable | None:
    """The cluster's per-kernel figures, or None (a measured cluster: one efficiency)."""
    if not cluster.kernel_table:
        return None
    if cluster.kernel_table not in KERNEL_TABLES:
        raise ValueError(f"cluster {cluster.name}: unknown kernel_table {cluster.kernel_table!r} (known: "
                         f"{', '.join(KERNEL_TABLES)})")
    return KERNEL_TABLES[cluster.kernel_table]


# ---------------------------------------------------------------- one GEMM


def gemm_time_s(t: KernelTable, m: int, n: int, k: int, b: int = 1, peak_flops: float | None = None,
                memory_bandwidth_bytes_per_s: float | None = None, bytes_per_element: int = 2) -> float:
    """Seconds of b GEMMs (m x k) @ (k x n) on one GPU (module docstring's wave model)."""
    peak = peak_flops or t.peak_flops
    bw = memory_bandwidth_bytes_per_s or t.memory_bandwidth_bytes_per_s
    tiles = b * math.ceil(m / t.tile_m) * math.ceil(n / t.tile_n)
    waves = math.ceil(tiles / t.n_sms)
    math_s = waves * 2 * t.tile_m * t.tile_n * (k + t.k_fill) / (peak / t.n_sms * t.tile_efficiency)
    memory_s = b * (m * k + k * n + m * n) * bytes_per_element / bw
    return t.launch_s + max(math_s, memory_s)


def gemm_shape_factor(t: KernelTable, m: int, n: int, k: int, peak_flops: float | None = None,
                      memory_bandwidth_bytes_per_s: float | None = None) -> float:
    """This GEMM's rate over the large-GEMM limit (peak x tile_efficiency), in (0, 1]."""
    peak = peak_flops or t.peak_flops
    m, n, k = max(1, int(m)), max(1, int(n)), max(1, int(k))
    rate = 2 * m * n * k / gemm_time_s(t, m, n, k, 1, peak, memory_bandwidth_bytes_per_s)
    return min(1.0, rate / (peak * t.tile_efficiency))


def _block_shapes(cfg: ModelConfig, layer: int, tokens: int, tp: int, ep: int) -> list[tuple[int, int, int, str]]:
    """Forward GEMMs (m, n, k, kind) of one block on one TP rank (``tokens`` rows); kind:
    "col" (column-parallel: its input all-gathered under sequence parallelism), "row" (row-
    parallel: its output reduce-scattered), "" (routed experts: no TP collective)."""
    h = cfg.dim
    if cfg.is_mla:  # latent attention: its projections, approximately, as dim-wide matrices
        attn = [(tokens, cfg.n_heads * (cfg.qk_nope_head_dim + cfg.qk_rope_head_dim) // tp, h, "col"),
                (tokens, h, cfg.n_heads * cfg.v_head_dim // tp, "row")]
    else:
        hd = cfg.head_dim
        attn = [(tokens, (cfg.n_heads + 2 * cfg.n_kv_heads) * hd // tp, h, "col"),
                (tokens, h, cfg.n_heads * hd // tp, "row")]
    if cfg.is_moe_layer(layer):
        per_expert = max(1, tokens * cfg.n_activated_experts * ep // max(1, cfg.n_routed_experts))
        f = cfg.moe_inter_dim
        mlp = [(per_expert, 2 * f, h, ""), (per_expert, h, f, "")]
        if cfg.n_shared_experts:
            fs = f * cfg.n_shared_experts // tp
            mlp += [(tokens, 2 * fs, h, "col"), (tokens, h, fs, "row")]
    else:
        f = cfg.ffn_hidden_dim // tp
        mlp = [(tokens, f, h, "col"), (tokens, f, h, "col"), (tokens, h, f, "row")]
    return attn + mlp


def _splits(kind: str, tp: int, st: Stack) -> tuple[int, int, int]:
    """How many chunks the forward, input-gradient and weight-gradient GEMM of a ``kind``
    GEMM is cut into by the stack's TP overlap (1: whole). Transformer Engine: the forward of a
    column-parallel GEMM and the input gradient of a row-parallel one ring-exchange their
    all-gather (tp chunks); a row-parallel forward pipelines its reduce-scatter (4 splits);
    the rest (bulk overlap, weight gradients) run whole."""
    if not (st.tp_overlap and st.tp_chunked) or tp <= 1 or not kind:
        return 1, 1, 1
    return (tp, 1, 1) if kind == "col" else (TE_PIPELINE_SPLITS, tp, 1)


def _gemm_chunks_s(t: KernelTable, m: int, n: int, k: int, split: int, peak: float, bw: float,
                   bytes_per_element: int = 2) -> float:
    """One GEMM cut into ``split`` chunks of m / split rows, ``TE_STREAMS`` of them in flight
    at a time (their tiles share the waves)."""
    if split <= 1:
        return gemm_time_s(t, m, n, k, 1, peak, bw, bytes_per_element)
    streams = min(TE_STREAMS, split)
    return math.ceil(split / streams) * gemm_time_s(t, max(1, m // split), n, k, streams, peak, bw,
                                                    bytes_per_element)


def _harmonic_factor(t: KernelTable, shapes: list[tuple[int, int, int, str]], peak: float, bw: float,
                     st: Stack | None = None, tp: int = 1, bytes_per_element: int = 2) -> float:
    """FLOP-weighted harmonic mean of the shape factors of ``shapes`` and their backward
    GEMMs (input gradient (m, k, n), weight gradient (k, n, m): the same FLOPs each), each cut
    as the stack's TP overlap cuts it (``_splits``)."""
    flops = time = 0.0
    for m, n, k, kind in shapes:
        f = 2.0 * m * n * k
        splits = _splits(kind, tp, st) if st is not None else (1, 1, 1)
        for (mm, nn, kk), split in zip(((m, n, k), (m, k, n), (k, n, m)), splits):
            flops += f
            time += _gemm_chunks_s(t, mm, nn, kk, split, peak, bw, bytes_per_element)
    rate = flops / time if time else peak * t.tile_efficiency
    return min(1.0, rate / (peak * t.tile_efficiency))


@functools.lru_cache(maxsize=1 << 14)
def _shape_factor(table: str, shapes: tuple[tuple[int, int, int, str], ...], peak: float, bw: float, stack_name: str,
                  tp: int, bytes_per_element: int) -> float:
    """``_harmonic_factor`` memoised: the planner prices each block shape (tokens, tp, ep) for
    thousands of layouts that share it."""
    return _harmonic_factor(KERNEL_TABLES[table], list(shapes), peak, bw, STACKS[stack_name] if stack_name else None,
                            tp, bytes_per_element)


def _attention_fraction(t: KernelTable, kernel: str, seq_len: int) -> tuple[float, float]:
    """(forward, backward) rate of ``kernel`` at ``seq_len`` as fractions of the peak it was
    measured on (log-linear in seq_len between the published points, clamped at the ends)."""
    pts = t.attention[kernel]
    if seq_len <= pts[0][0]:
        s, f, b = pts[0]
    elif seq_len >= pts[-1][0]:
        s, f, b = pts[-1]
    else:
        i = next(j for j in range(1, len(pts)) if pts[j][0] >= seq_len)
        (s0, f0, b0), (s1, f1, b1) = pts[i - 1], pts[i]
        w = math.log(seq_len / s0) / math.log(s1 / s0)
        f, b = f0 + w * (f1 - f0), b0 + w * (b1 - b0)
    return f * 1e12 / t.attention_peak_flops, b * 1e12 / t.attention_peak_flops


def attention_flops_per_token(cfg: ModelConfig, seq_len: int) -> float:
    """The score and value products of one block per token, forward + backward, full
    (``ModelConfig.flops_per_token``'s count: 6 x widths x seq_len)."""
    widths = (cfg.n_heads * (cfg.qk_nope_head_dim + cfg.qk_rope_head_dim + cfg.v_head_dim) if cfg.is_mla
              else 2 * cfg.dim)
    return 6.0 * widths * seq_len


# ---------------------------------------------------------------- the cost model's terms


def compute_s(cfg: ModelConfig, block_flops: list[float], layers: list[int], head_flops: float, seq_len: int,
              tokens: int, tp: int, ep: int, recompute: bool, cluster: Cluster, peak: float, stack_name: str,
              gemm_peak: float | None = None, gemm_bytes: int = 2) -> float:
    """Seconds of one microbatch's matmul work (``tokens`` tokens) on one rank: the blocks
    ``layers`` (their training FLOPs per token ``block_flops``, recomputed forward included
    when ``recompute``) and ``head_flops`` per token (0 off the last stage), all split by tp.
    ``gemm_peak``/``gemm_bytes``: the blocks' linear GEMMs' peak and operand bytes where they
    run in another dtype than ``peak``'s (FP8); attention and the head stay at ``peak``.
    Without a kernel table: FLOPs / (peak x matmul_efficiency), as before this module."""
    rate = peak * cluster.matmul_efficiency
    gemm_peak = gemm_peak or peak
    gemm_rate = gemm_peak * cluster.matmul_efficiency
    t = kernel_table(cluster)
    ac = 4 / 3 if recompute else 1.0
    if t is None:
        if gemm_peak == peak:
            return (sum(block_flops) * ac + head_flops) * tokens / tp / rate
        att = attention_flops_per_token(cfg, seq_len) * ac
        gemm = sum(max(0.0, f * ac - att) for f in block_flops)
        return (gemm / gemm_rate + (len(block_flops) * att + head_flops) / rate) * tokens / tp
    st = stack(stack_name)
    bw = cluster.memory_bandwidth_bytes_per_s
    total = 0.0
    att_fwd, att_bwd = _attention_fraction(t, st.attention_kernel, seq_len)
    factors: dict[bool, float] = {}
    for layer, flops in zip(layers, block_flops):
        att = attention_flops_per_token(cfg, seq_len)
        moe = cfg.is_moe_layer(layer)
        if moe not in factors:
            factors[moe] = _shape_factor(t.name, tuple(_block_shapes(cfg, layer, tokens, tp, ep)), gemm_peak, bw,
                                         st.name, tp, gemm_bytes)
        total += (flops - att) * ac / (gemm_rate * factors[moe])
        # the kernel does the causal half: forward (twice with recomputation) and 2.5x it backward
        half_fwd = att / 6
        total += half_fwd * (2 if recompute else 1) / (peak * att_fwd) + 2.5 * half_fwd / (peak * att_bwd)
    if head_flops:
        head = ((tokens, cfg.vocab_size // tp, cfg.dim, ""),)
        total += head_flops / (rate * _shape_factor(t.name, head, peak, bw, "", 1, 2))
    return total * tokens / tp


def stream_factor(cluster: Cluster, stack_name: str) -> float:
    """What the stack's elementwise kernels move over the cost model's fused count (1
    without a kernel table: a calibrated cluster keeps its byte count)."""
    return stack(stack_name).stream_factor if cluster.kernel_table else 1.0


def loss_bytes_per_logit(cluster: Cluster, stack_name: str) -> float:
    """HBM bytes per logit of the loss under the stack (``FUSED_LOSS_BYTES`` without a kernel table)."""
    return stack(stack_name).loss_bytes_per_logit if cluster.kernel_table else FUSED_LOSS_BYTES


def tp_exposed_s(tp_comm_s: float, compute_s: float, cluster: Cluster, stack_name: str) -> float:
    """The part of ``tp_comm_s`` (this rank's TP collectives, one micro-step) on the
    critical path. Eager stacks (no async TP), or no kernel table: all of it. ``megatron``:
    ``tp_exposed_share`` waits; the rest runs beside the GEMMs, hidden up to the compute
    time (what exceeds it waits too), and takes ``comm_sms`` of the SMs while it runs, which
    the GEMMs lose: + hidden x comm_sms / n_sms."""
    t = kernel_table(cluster)
    st = stack(stack_name)
    if t is None or not st.tp_overlap or tp_comm_s <= 0:
        return tp_comm_s
    overlappable = tp_comm_s * (1 - st.tp_exposed_share)
    hidden = min(overlappable, compute_s)
    return tp_comm_s - hidden + hidden * st.comm_sms / t.n_sms
