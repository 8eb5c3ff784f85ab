"""Published training throughput at published layouts, and the cost model's prediction
for each (validation (a) of issue 21: target median absolute error <= ``TARGET_MEDIAN_ERROR``).

Every row carries its source (repository + path + commit, or URL), the table line as
published (``quote``), the shape, the layout and the one metric it publishes. A field the
source does not give is ``None`` in ``published`` and, where the cost model needs a value,
the value used is listed in ``assumptions`` with why. Nothing here is measured by us.

Sources (``SOURCES`` keys):

- ``megatron``: NVIDIA/Megatron-LM README "Training Speed and Scalability" and its table
  ``images/model_table.png`` (added in commit f2e5db4, 2024-07-15, "New scaling figures on
  H100 GPUs"; the table is an image, transcribed row by row below). GPT models, vocabulary
  131072, sequence 4096, up to 6144 H100s, DP/TP/PP communication overlapped.
- ``torchtitan-2412``: pytorch/torchtitan ``benchmarks/llama3_h100_202412_torchtitan.md``
  (commit 820504e; the same tables were docs/performance.md at d4c86e3, 2025-01-30). H100
  96GB HBM2e at 500 W ("the actual peak TFLOPs number is between SXM and NVL").
- ``torchtitan-2506``: pytorch/torchtitan ``benchmarks/asyncTP_llama3_h100_2025-06_torchtitan.md``
  (commit 2887250), same hardware.
- ``torchtitan-2408``: pytorch/torchtitan ``docs/performance.md`` at commit 3faaa1a
  (2024-08-23): Llama 3.1 405B on 128 H100s.
- ``llama3-paper``: "The Llama 3 Herd of Models" (arXiv 2407.21783) Table 4, as transcribed
  from the SC'24 talk slide at https://glennklockwood.com/garden/llama-3.1 (GPUs, TP, CP,
  PP, tokens/batch, TFLOPS/GPU). Reported, not in the target median (layout partly derived).
- ``deepseek-v3``: "DeepSeek-V3 Technical Report" (arXiv 2412.19437): 2048 H800, PP 16, EP 64
  over 8 nodes, ZeRO-1 DP, batch 15,360 x 4096 tokens, FP8 training; 2.664M H800 GPU hours for
  14.8T pre-training tokens (180K per trillion) -> tokens/s per GPU. Reported, not in the
  target median (FP8; a figure from GPU hours of the whole pre-training).

Stacks and boards. Each row names the software stack that ran it (``stack``:
``gemm_efficiency.STACKS``: Megatron-Core + TE -> megatron, torchtitan -> trainforge or, with
torch.compile, trainforge-compile) and the board: torchtitan's 500 W HBM2e H100s are
``hardware.VARIANTS['h100-96g-500w']``, DeepSeek's ``h800``, the others the SXM table entry.
Float8 rows (torchtitan's Float8 linears, DeepSeek's FP8 recipe) are priced with the
planner's ``fp8`` precision (linear GEMMs at the board's FP8 peak); none counts toward the
bf16 target.

Shapes. torchtitan and Llama 3 rows are our ``llama-8b/70b/405b`` flavors. Megatron's GPT
models are built with ``gpt_shape``: GPT's MLP (two d x 4d matrices, 8d^2 weights) becomes a
SwiGLU of width 8d/3 rounded to a multiple of 8 (three d x f matrices, 3df = 8d^2): the same
parameters and the same matmul FLOPs per token (within 0.05 % from the rounding); GPT's biases and LayerNorm
weights (O(d) per layer) are left out. Megatron's MFU formula (Narayanan et al. 2021,
72·B·s·l·h²·(1 + s/6h + V/12lh)) is exactly ``ModelConfig.flops_per_token`` x tokens for
this shape, so published and predicted TFLOP/s use the same FLOP count.
"""

from __future__ import annotations

import dataclasses
import math
import statistics
from dataclasses import dataclass, field
from typing import Any, Callable, Literal

from trainforge.model.config import FLAVORS, ModelConfig
from trainforge.plan.spec import Cluster, Estimate, Layout, Workload

TARGET_MEDIAN_ERROR = 0.15  # issue 21: median |predicted / published - 1| over the target rows
H100_BF16_PEAK_FLOPS = 989e12  # dense; what Megatron and torchtitan divide by for MFU

Metric = Literal["tflops_per_gpu", "tokens_per_s_per_gpu", "mfu"]

SOURCES: dict[str, str] = {
    "megatron": "https://github.com/NVIDIA/Megatron-LM/blob/f2e5db402c44ae309aa6448bcb4ae87e8ae0f5f4/README.md "
                "(table: images/model_table.png at the same commit)",
    "torchtitan-2412": "https://github.com/pytorch/torchtitan/blob/820504e20d1149fbf0b98c567af24c4b0433b22d/"
                       "benchmarks/llama3_h100_202412_torchtitan.md",
    "torchtitan-2506": "https://github.com/pytorch/torchtitan/blob/2887250bbd9103d0bc997ea2efb3a525b5e5dbc0/"
                       "benchmarks/asyncTP_llama3_h100_2025-06_torchtitan.md",
    "torchtitan-2408": "https://github.com/pytorch/torchtitan/blob/3faaa1a0dee68ce028400e3dafd1735d152cb4f8/"
                       "docs/performance.md",
    "llama3-paper": "https://arxiv.org/abs/2407.21783 Table 4; transcription of the SC'24 slide: "
                    "https://glennklockwood.com/garden/llama-3.1",
    "deepseek-v3": "https://arxiv.org/abs/2412.19437 (DeepSeek-V3 Technical Report: Table 1, sections 3.1-3.3, "
                   "4.2)",
}


def gpt_shape(dim: int, n_layers: int, n_heads: int, vocab_size: int = 131072, seq_len: int = 4096) -> ModelConfig:
    """A Megatron GPT model as a ModelConfig: multi-head attention, untied embeddings (the
    published sizes, e.g. 7.1B = 12·30·4096² + 2·131072·4096, count both), and the 4d MLP
    as a SwiGLU of width 8d/3 (same weights and FLOPs, see the module docstring)."""
    # 8d/3 rounded to a multiple of 8 so that every TP degree up to 8 divides it (the trainer's check)
    return ModelConfig(dim=dim, n_layers=n_layers, n_heads=n_heads, n_kv_heads=n_heads, vocab_size=vocab_size,
                       ffn_hidden_dim=8 * round(dim / 3), max_seq_len=seq_len, tie_embeddings=False)


@dataclass(frozen=True)
class PublishedRow:
    """One published measurement. ``published``: the layout and setup exactly as the
    source gives it (``None`` = not published). ``layout``: the same layout in our
    ``Layout`` fields, for the cost model; every value in it that is not published is named
    in ``assumptions``. ``in_target``: counted in the median the target applies to (bf16,
    a layout our ``Layout`` can express); otherwise ``excluded_why`` says why."""

    id: str
    source: str
    quote: str
    model: ModelConfig
    flavor: str  # our flavor name, or "" for a shape built by gpt_shape
    model_name: str
    seq_len: int
    global_batch: int  # sequences per optimizer step
    n_gpus: int
    gpu: str
    precision: str  # "bf16" or "float8"
    published: dict[str, Any]
    layout: Layout
    metric: Metric
    value: float
    assumptions: tuple[str, ...] = ()
    notes: tuple[str, ...] = ()
    in_target: bool = True
    excluded_why: str = ""
    stack: str = "trainforge"  # the training software stack that ran it (gemm_efficiency.STACKS)

    def workload(self) -> Workload:
        """bf16 rows as bf16-mixed; float8 rows with the planner's fp8 (FP8 linear GEMMs)."""
        return Workload(model=self.model, seq_len=self.seq_len, global_batch=self.global_batch,
                        precision="fp8" if self.precision == "float8" else "bf16-mixed",
                        flavor=self.flavor or self.model_name, stack=self.stack)


# ---------------------------------------------------------------------------------------------
# Megatron-LM, weak scaling on H100 (README, images/model_table.png). Columns: model size,
# attention heads, hidden size, layers, TP, PP, DP, GPUs, batch size, per-GPU TFLOP/s, MFU,
# aggregate PFLOP/s.
_MEGATRON_TABLE = (
    ("1.7B", 16, 2048, 24, 1, 1, 48, 48, 192, 408.8, "41%", 19.6),
    ("7.1B", 32, 4096, 30, 2, 1, 48, 96, 192, 465.9, "47%", 44.7),
    ("16B", 48, 6144, 32, 4, 1, 48, 192, 192, 489.1, "49%", 93.9),
    ("32B", 56, 7168, 48, 8, 1, 48, 384, 192, 459.6, "46%", 176.5),
    ("70B", 64, 8192, 84, 8, 2, 48, 768, 384, 419.7, "42%", 322.3),
    ("119B", 80, 10240, 92, 8, 4, 48, 1536, 768, 420.5, "43%", 645.9),
    ("177B", 96, 12288, 96, 8, 6, 48, 2304, 1152, 432.8, "44%", 997.2),
    ("314B", 128, 16384, 96, 8, 8, 48, 3072, 1536, 474.4, "48%", 1457.4),
    ("462B", 144, 18432, 112, 8, 16, 48, 6144, 3072, 459.9, "47%", 2825.6),
)
_MEGATRON_ASSUMPTIONS = (
    "micro_batch_size = 1 (not published; Megatron's examples/gpt3 script uses 1): with a pipeline the "
    "batch/DP sequences are its microbatches (= 4 x PP in every row)",
    "without a pipeline, Megatron's 4 accumulated microbatches of 1 -> one micro-step of 4 sequences "
    "(grad_accum_steps = 1): Megatron reduces gradients once per step, after the last microbatch, while our "
    "trainer (and so the cost model) reduces every micro-step; FLOPs and TP bytes are the same, only "
    "activation memory differs",
    "pp_schedule = 1f1b (the virtual-pipeline size, i.e. interleaving, is not published)",
    "activation_checkpoint = False (recomputation is not published)",
    "DP -> dp_replicate: the distributed optimizer (implied by --overlap-param-gather) shards only the "
    "optimizer state (ZeRO-1); its reduce-scatter + all-gather moves the bytes of one all-reduce",
)
_MEGATRON_NOTES = (
    "sequence parallelism implied: --tp-comm-overlap needs --sequence-parallel",
    "DP, TP and PP communication overlapped with compute (--overlap-grad-reduce --overlap-param-gather "
    "--tp-comm-overlap; PP overlap on by default); throughput end to end, data loading and logging included",
    "MFU = per-GPU TFLOP/s / 989 (rounded to a percent in the table)",
)


def _megatron_rows() -> list[PublishedRow]:
    rows = []
    for size, heads, hidden, layers, tp, pp, dp, gpus, batch, tflops, mfu, agg in _MEGATRON_TABLE:
        per_dp = batch // dp
        layout = Layout(dp_replicate=dp, tp=tp, pp=pp, microbatches=per_dp if pp > 1 else 1,
                        pp_schedule="1f1b", activation_checkpoint=False)
        rows.append(PublishedRow(
            id=f"megatron-gpt-{size.lower()}-{gpus}", source="megatron",
            quote=f"| {size} | {heads} | {hidden} | {layers} | {tp} | {pp} | {dp} | {gpus} | {batch} | {tflops} | "
                  f"{mfu} | {agg} |",
            model=gpt_shape(hidden, layers, heads), flavor="", model_name=f"GPT {size}", seq_len=4096,
            global_batch=batch, n_gpus=gpus, gpu="h100", precision="bf16",
            published={"dp": dp, "tp": tp, "pp": pp, "cp": None, "micro_batch_size": None,
                       "virtual_pipeline": None, "recompute": None, "sequence_parallel": None,
                       "distributed_optimizer": None, "global_batch": batch, "seq_len": 4096, "mfu": mfu},
            layout=layout, metric="tflops_per_gpu", value=tflops,
            assumptions=_MEGATRON_ASSUMPTIONS, notes=_MEGATRON_NOTES, stack="megatron"))
    return rows


# ---------------------------------------------------------------------------------------------
# torchtitan on H100 (Grand Teton, 96GB HBM2e, 500 W power limit).
_TT_SEQ = ("seq_len = 8192: not in the table; the llama3 train_configs preset at the commit the benchmark "
           "names (torchtitan 9dec370 / 820504e / 3faaa1a) sets it")
_TT_HW = ("H100 96GB HBM2e at 500 W: predicted on hardware.VARIANTS['h100-96g-500w'] (the source says the real "
          "peak lies between SXM and NVL: their midpoint; HBM2e bandwidth assumed 2.4 TB/s)")
_TT_GPU = "h100-96g-500w"
_SAC = ("selective (per-op) activation checkpointing -> activation_checkpoint = True (full; Layout has no "
        "selective mode): torchtitan's op policy recomputes every other matmul and the cheap ops, about half the "
        "forward, so the full-recompute prediction leans low by up to ~1/8")


def _tt(id: str, source: str, quote: str, flavor: str, n_gpus: int, published: dict[str, Any], layout: Layout,
        global_batch: int, value: float, precision: str = "bf16", assumptions: tuple[str, ...] = (),
        notes: tuple[str, ...] = (), in_target: bool = True, excluded_why: str = "",
        seq_len: int = 8192) -> PublishedRow:
    # torch.compile on -> the compiled stack; off (or not stated, where the preset turns it on: see notes)
    stack = "trainforge" if published.get("compile") is False else "trainforge-compile"
    return PublishedRow(id=id, source=source, quote=quote, model=FLAVORS[flavor], flavor=flavor,
                        model_name=f"Llama 3.1 {flavor.split('-')[1].upper()}", seq_len=seq_len,
                        global_batch=global_batch, n_gpus=n_gpus, gpu=_TT_GPU, precision=precision, stack=stack,
                        published=published, layout=layout, metric="tokens_per_s_per_gpu", value=value,
                        assumptions=(_TT_SEQ, *assumptions) if seq_len == 8192 else assumptions,
                        notes=(_TT_HW, *notes), in_target=in_target, excluded_why=excluded_why)


def _torchtitan_rows() -> list[PublishedRow]:
    fsdp8 = {"fsdp": 8, "tp": 1, "pp": 1, "cp": 1, "local_batch": 2, "ac": "selective", "compile": False,
             "float8": False}
    fsdp128 = {**fsdp8, "fsdp": 128}
    no_compile = "torch.compile off"
    compiled = "torch.compile on (stack trainforge-compile)"
    fp8 = "Float8 linears (torchao): priced with the fp8 precision, shown only (the target is bf16)"
    rows = [
        _tt("torchtitan-8b-fsdp8", "torchtitan-2412", "Table 1 (8 GPUs, local batch 2, global 16, selective AC): "
            "| FSDP | 5,762 | 82.4 |", "llama-8b", 8, fsdp8, Layout(dp_shard=8, activation_checkpoint=True), 16, 5762,
            assumptions=(_SAC,), notes=(no_compile, "MFU 33% per the text (SXM peak)")),
        _tt("torchtitan-8b-fsdp8-compile", "torchtitan-2412", "Table 1: | FSDP + torch.compile | 6,667 | 77.0 |",
            "llama-8b", 8, {**fsdp8, "compile": True}, Layout(dp_shard=8, activation_checkpoint=True), 16, 6667,
            assumptions=(_SAC,), notes=(compiled, "MFU 39% per the text (SXM peak)")),
        _tt("torchtitan-8b-fsdp8-compile-fp8", "torchtitan-2412",
            "Table 1: | FSDP + torch.compile + Float8 | 8,532 | 76.8 |", "llama-8b", 8,
            {**fsdp8, "compile": True, "float8": True}, Layout(dp_shard=8, activation_checkpoint=True), 16, 8532, precision="float8",
            assumptions=(_SAC,), in_target=False, excluded_why=fp8),
        _tt("torchtitan-8b-fsdp128", "torchtitan-2412", "Table 3 (128 GPUs, local batch 2, global 256, selective "
            "AC): | FSDP | 5,605 | 67.0 |", "llama-8b", 128, fsdp128, Layout(dp_shard=128, activation_checkpoint=True), 256, 5605,
            assumptions=(_SAC,), notes=(no_compile,)),
        _tt("torchtitan-8b-fsdp128-compile", "torchtitan-2412", "Table 3: | FSDP + torch.compile | 6,514 | 62.0 |",
            "llama-8b", 128, {**fsdp128, "compile": True}, Layout(dp_shard=128, activation_checkpoint=True), 256, 6514,
            assumptions=(_SAC,), notes=(compiled,)),
        _tt("torchtitan-8b-fsdp128-compile-fp8", "torchtitan-2412",
            "Table 3: | FSDP + torch.compile + Float8 | 8,380 | 61.8 |", "llama-8b", 128,
            {**fsdp128, "compile": True, "float8": True}, Layout(dp_shard=128, activation_checkpoint=True), 256, 8380, precision="float8",
            assumptions=(_SAC,), in_target=False, excluded_why=fp8),
        _tt("torchtitan-70b-fsdp32-tp8-fp8", "torchtitan-2412", "Table 4 (256 GPUs, FSDP 32, TP 8, local batch "
            "16, global 512, full AC, compile, Float8): | 2D | 829 | 71.9 |", "llama-70b", 256,
            {"fsdp": 32, "tp": 8, "pp": 1, "local_batch": 16, "ac": "full", "compile": True, "float8": True},
            Layout(dp_shard=32, tp=8, activation_checkpoint=True), 512, 829, precision="float8",
            in_target=False, excluded_why=fp8),
        _tt("torchtitan-405b-fsdp8-tp8-pp8-1f1b-fp8", "torchtitan-2412", "Table 5 (512 GPUs, FSDP 8, TP 8, PP 8, "
            "local batch 32, global 256, full AC, compile, Float8, async TP): | 1F1B | 100 | 82.5 |", "llama-405b",
            512, {"fsdp": 8, "tp": 8, "pp": 8, "local_batch": 32, "ac": "full", "float8": True, "async_tp": True,
                  "microbatches": None},
            Layout(dp_shard=8, tp=8, pp=8, microbatches=32, activation_checkpoint=True), 256, 100,
            precision="float8", assumptions=("32 microbatches of 1 (torchtitan's default microbatch size 1)",), in_target=False, excluded_why=fp8 + "; async TP"),
        _tt("torchtitan-70b-fsdp32-tp8-compile", "torchtitan-2506", "Llama3 70b on 256 H100s with FSDP=32, TP=8, "
            "torch.compile, full AC, local batch size 16: | None (bfloat16) | 597.3 | 652.4 | 1.09 |",
            "llama-70b", 256, {"fsdp": 32, "tp": 8, "pp": 1, "local_batch": 16, "ac": "full", "compile": True,
                               "float8": False, "async_tp": False},
            Layout(dp_shard=32, tp=8, activation_checkpoint=True), 512, 597.3,
            assumptions=("global batch 512 = local 16 x FSDP 32 (not stated in this file)",),
            notes=(compiled, "vanilla TP column")),
        _tt("torchtitan-70b-fsdp32-tp8-compile-asynctp", "torchtitan-2506", "same row, Async TP column: 652.4",
            "llama-70b", 256, {"fsdp": 32, "tp": 8, "pp": 1, "local_batch": 16, "ac": "full", "compile": True,
                               "float8": False, "async_tp": True},
            Layout(dp_shard=32, tp=8, activation_checkpoint=True), 512, 652.4, notes=(compiled,), in_target=False,
            excluded_why="async TP (TP comm overlapped with matmuls) is not a Layout field"),
        _tt("torchtitan-8b-fsdp8-tp8-compile", "torchtitan-2506", "Llama3 8b on 64 H100s with FSDP=8, TP=8, "
            "torch.compile, per op SAC, local batch size 12: | None (bfloat16) | 4378 | 4809.4 | 1.10 |",
            "llama-8b", 64, {"fsdp": 8, "tp": 8, "pp": 1, "local_batch": 12, "ac": "selective-op", "compile": True,
                             "float8": False, "async_tp": False},
            Layout(dp_shard=8, tp=8, activation_checkpoint=True), 96, 4378,
            assumptions=(_SAC, "global batch 96 = local 12 x FSDP 8 (not stated)"),
            notes=(compiled, "vanilla TP column")),
        _tt("torchtitan-8b-fsdp8-tp8-compile-asynctp", "torchtitan-2506", "same row, Async TP column: 4809.4",
            "llama-8b", 64, {"fsdp": 8, "tp": 8, "pp": 1, "local_batch": 12, "ac": "selective-op", "compile": True,
                             "float8": False, "async_tp": True},
            Layout(dp_shard=8, tp=8, activation_checkpoint=True), 96, 4809.4, assumptions=(_SAC,), notes=(compiled,), in_target=False,
            excluded_why="async TP (TP comm overlapped with matmuls) is not a Layout field"),
        _tt("torchtitan-405b-fsdp16-tp8", "torchtitan-2408", "| 405B | 2 | full | 109 | 29.0%[^1] | None",
            "llama-405b", 128, {"fsdp": 16, "tp": 8, "pp": 1, "local_batch": 2, "ac": "full", "compile": None,
                                "float8": False, "mfu": "29.0%"},
            Layout(dp_shard=16, tp=8, activation_checkpoint=True), 32, 109,
            notes=("128 H100 (95GB HBM2e, lower TDP SXM); global batch 32 = 2 x FSDP 16 (published)",
                   "compile not stated for this row (the preset toml has compile = true)")),
    ]
    return rows


# ---------------------------------------------------------------------------------------------
# Llama 3 405B pre-training (paper Table 4). Quoted: the SC'24 slide transcription.
_L3_ASSUMPTIONS = (
    "seq_len 8192 for the CP=1 rows: the paper's initial pre-training stage is 8K; 131072 for the CP=16 row, its "
    "long-context stage (neither is in the quoted transcription)",
    "DP = GPUs / (TP x CP x PP), derived",
    "global batch 2048 sequences = 16M tokens / 8192 (16M = 2^24), derived",
    "micro_batch_size 1, pp_schedule interleaved-1f1b (Meta's own tuned interleaved schedule; microbatch count "
    "not in the transcription)",
    "DP -> dp_shard (FSDP)",
)


def _llama3_rows() -> list[PublishedRow]:
    rows = []
    for gpus, tp, cp, pp, tflops in ((8192, 8, 1, 16, 430), (16384, 8, 1, 16, 400), (16384, 8, 16, 16, 380)):
        dp = gpus // (tp * cp * pp)
        seq = 8192 if cp == 1 else 131072
        batch = (1 << 24) // seq
        per_dp = batch // dp
        expressible = cp == 1
        rows.append(PublishedRow(
            id=f"llama3-405b-{gpus}-cp{cp}", source="llama3-paper",
            quote=f"{gpus:,} | {tp} | {cp} | {pp} | 16M | {tflops} |", model=FLAVORS["llama-405b"],
            flavor="llama-405b", model_name="Llama 3.1 405B", seq_len=seq, global_batch=batch, n_gpus=gpus,
            gpu="h100", precision="bf16",
            published={"tp": tp, "cp": cp, "pp": pp, "dp": None, "tokens_per_batch": "16M", "seq_len": None,
                       "micro_batch_size": None, "schedule": None},
            layout=Layout(dp_shard=dp, tp=tp, pp=pp, microbatches=max(per_dp, 1), pp_schedule="interleaved-1f1b"),
            metric="tflops_per_gpu", value=tflops, assumptions=_L3_ASSUMPTIONS,
            notes=("700 W H100 80GB HBM3, RoCE 400 Gb/s",
                   "stack megatron: Meta's own stack is not public; the nearest of ours (fused kernels, TP overlap)"),
            stack="megatron", in_target=False,
            excluded_why="reported only: layout partly derived" if expressible else
            "context parallelism (CP 16) is not a Layout field"))
    return rows


# ---------------------------------------------------------------------------------------------
# DeepSeek-V3 pre-training (technical report, arXiv 2412.19437). The figure: Table 1's 2,664K H800
# GPU hours for pre-training on 14.8T tokens ("each trillion tokens requires only 180K H800 GPU
# hours, i.e., 3.7 days on our cluster with 2048 H800 GPUs") -> 14.8e12 / (2.664e6 x 3600) =
# 1,543 tokens/s per GPU; with our FLOPs per token (MTP depth 1 included, full attention
# products: 291.9 GFLOP at 4096) that is 450 TFLOP/s per GPU, 45.5 % of the dense bf16 peak
# (22.8 % of the FP8 one).
DSV3_PRETRAIN_GPU_HOURS = 2.664e6
DSV3_PRETRAIN_TOKENS = 14.8e12
DSV3_TOKENS_PER_S_PER_GPU = DSV3_PRETRAIN_TOKENS / (DSV3_PRETRAIN_GPU_HOURS * 3600)
_DSV3_ASSUMPTIONS = (
    "micro_batch_size 1 (not published): the 15,360 / 128 = 120 sequences per DP rank are 120 microbatches "
    "(Megatron's num_microbatches = global_batch / (micro_batch_size x dp))",
    "pp_schedule dualpipev: DualPipe (bidirectional, two parameter copies) is not a schedule here; DualPipe-V, its "
    "V-shaped half, has the same bubble and one copy",
    "activation_checkpoint = False: the report recomputes only RMSNorm and the MLA up-projections",
    "ZeRO-1 DP -> dp_replicate (the same gradient bytes on the wire; optimizer state counted unsharded, so memory "
    "leans high)",
    "stack megatron: DeepSeek's HAI-LLM is not public; the nearest of ours (fused kernels, cuDNN attention)",
    "precision fp8: linear GEMMs at the FP8 peak, attention/head/router in bf16 (as the report keeps them); "
    "all-to-all dispatch counted in bf16 (the report sends FP8)",
    "the whole pre-training's GPU hours over its tokens: the batch ramp (3,072 -> 15,360 over the first 469B "
    "tokens) and any overhead of the run are in the figure",
)


def _deepseek_rows() -> list[PublishedRow]:
    tp, pp, ep, gpus, batch = 1, 16, 64, 2048, 15360
    dp = gpus // (tp * pp)
    return [PublishedRow(
        id="deepseek-v3-671b-2048-h800", source="deepseek-v3",
        quote="Table 1: Pre-Training 2664K H800 GPU hours, 14.8T tokens; section 3.2: 16-way PP, 64-way EP spanning "
              "8 nodes, ZeRO-1 DP; section 4.2: batch size 15360, sequence length 4K",
        model=FLAVORS["deepseek-v3-671b"], flavor="deepseek-v3-671b", model_name="DeepSeek-V3 671B", seq_len=4096,
        global_batch=batch, n_gpus=gpus, gpu="h800", precision="float8",
        published={"tp": tp, "pp": pp, "ep": ep, "dp": dp, "cp": 1, "zero": 1, "micro_batch_size": None,
                   "schedule": "DualPipe", "recompute": "RMSNorm, MLA up-projections", "global_batch": batch,
                   "seq_len": 4096, "gpu_hours": DSV3_PRETRAIN_GPU_HOURS, "tokens": DSV3_PRETRAIN_TOKENS},
        layout=Layout(dp_replicate=dp, tp=tp, pp=pp, ep=ep, microbatches=batch // dp, pp_schedule="dualpipev"),
        metric="tokens_per_s_per_gpu", value=DSV3_TOKENS_PER_S_PER_GPU, assumptions=_DSV3_ASSUMPTIONS,
        notes=("H800 SXM5: the H100's peaks and HBM, NVLink 400 GB/s (hardware.GPUS['h800'])",
               "MTP depth 1 trained (the flavor's mtp_depth = 1)"),
        stack="megatron", in_target=False,
        excluded_why="FP8 training, and a figure from GPU hours of the whole pre-training: reported, not in the "
                     "bf16 target median")]


ROWS: tuple[PublishedRow, ...] = (*_megatron_rows(), *_torchtitan_rows(), *_llama3_rows(), *_deepseek_rows())


# ---------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Comparison:
    """Predicted against published for one row, in the row's own metric. ``fits_memory``:
    whether the predicted peak memory fits the GPU (the published run did fit, so False is a
    memory-model miss; the time is predicted either way)."""

    row: PublishedRow
    predicted: float
    estimate: Estimate = field(repr=False)
    fits_memory: bool = True

    @property
    def rel_error(self) -> float:
        """predicted / published - 1 (positive: the model is optimistic)."""
        return self.predicted / self.row.value - 1.0


EstimateFn = Callable[[Workload, Layout, Cluster], Estimate]
ClusterFn = Callable[[str, int], Cluster]


def _default_fns() -> tuple[EstimateFn, ClusterFn]:
    try:
        from trainforge.plan import cost_model, hardware
    except ImportError as e:  # the cost model lands from its own branch
        raise RuntimeError(f"trainforge.plan.cost_model / hardware not importable ({e}): pass estimate= and "
                           "cluster= explicitly, or merge the cost model first") from e
    return cost_model.estimate, hardware.cluster


def predicted_metric(row: PublishedRow, est: Estimate) -> float:
    """The estimate in the row's metric: tokens/s per GPU, model TFLOP/s per GPU (our
    FLOPs per token, the count Megatron and torchtitan use) or MFU."""
    if row.metric == "tokens_per_s_per_gpu":
        return est.tokens_per_s_per_gpu
    if row.metric == "tflops_per_gpu":
        return est.tokens_per_s_per_gpu * row.model.flops_per_token(row.seq_len) / 1e12
    return est.mfu


def compare(rows: tuple[PublishedRow, ...] | list[PublishedRow] = ROWS, estimate: EstimateFn | None = None,
            cluster: ClusterFn | None = None) -> list[Comparison]:
    """Run the cost model on every row that has a layout it can express (all but the CP
    rows: float8 and async-TP rows are predicted as bf16 and shown, never counted).
    ``estimate``/``cluster`` default to the real cost model.

    The published runs ran, so their step time is predicted on the cluster with its memory
    limit lifted (an over-memory estimate has no step time); whether the predicted memory
    fits the real GPU is kept beside it (``fits_memory``)."""
    if estimate is None or cluster is None:
        est_fn, cl_fn = _default_fns()
        estimate, cluster = estimate or est_fn, cluster or cl_fn
    out = []
    for row in rows:
        if row.published.get("cp", 1) not in (1, None):
            continue  # no context-parallel axis in Layout: nothing to predict
        real = cluster(row.gpu, row.n_gpus)
        est = estimate(row.workload(), row.layout, dataclasses.replace(real, memory_bytes=math.inf))
        out.append(Comparison(row=row, predicted=predicted_metric(row, est), estimate=est,
                              fits_memory=est.memory_bytes_per_gpu <= real.memory_bytes))
    return out


def median_abs_error(comparisons: list[Comparison], target_only: bool = True) -> float:
    """Median of |predicted / published - 1| over the target rows (all rows if not ``target_only``)."""
    errs = [abs(c.rel_error) for c in comparisons if c.row.in_target or not target_only]
    if not errs:
        raise ValueError("no comparisons to take the median of")
    return statistics.median(errs)


def published_mfu(row: PublishedRow) -> float:
    """The row's figure as MFU of the H100 dense bf16 peak, with our FLOPs per token."""
    if row.metric == "mfu":
        return row.value
    tflops = row.value if row.metric == "tflops_per_gpu" else row.value * row.model.flops_per_token(row.seq_len) / 1e12
    return tflops * 1e12 / H100_BF16_PEAK_FLOPS


def constant_mfu_baseline(rows: tuple[PublishedRow, ...] | list[PublishedRow] = ROWS) -> tuple[float, float]:
    """The yardstick a cost model has to beat: predict one MFU for every target row (the
    median of theirs, the best constant for a median error). Returns (that MFU, its median
    absolute error)."""
    mfus = [published_mfu(r) for r in rows if r.in_target]
    c = statistics.median(mfus)
    return c, statistics.median(abs(c / m - 1) for m in mfus)
